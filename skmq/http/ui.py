"""The web console (docs/OPERATIONS.md, "Web console"): one page at /ui/ with its script
and style, shipped in the package (skmq/http/static) and read once at start.

The page holds no data and needs no token: it reads and acts through the gateway's JSON
routes, which do (the operator types the token into the page). Its Content-Security-Policy
lets it load only its own files and talk only to its own origin, so a message preview
holding HTML or script can never run."""

from __future__ import annotations

from importlib import resources

from aiohttp import web

_TYPES = {"index.html": "text/html", "console.js": "text/javascript", "console.css": "text/css"}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_to(app: web.Application) -> None:
    """GET /ui (a redirect to /ui/, so that the page's relative links work behind a path
    prefix too), /ui/ (the page) and /ui/<file> (its script and style)."""
    folder = resources.files("skmq.http") / "static"
    files = {name: (folder / name).read_bytes() for name in _TYPES}

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("ui/", headers=HEADERS)

    async def serve(request: web.Request) -> web.Response:
        name = request.match_info.get("file", "index.html")
        if name not in files:
            raise web.HTTPNotFound()
        return web.Response(
            body=files[name], content_type=_TYPES[name], charset="utf-8", headers=HEADERS
        )

    app.router.add_get("/ui", redirect)
    app.router.add_get("/ui/", serve)
    app.router.add_get("/ui/{file}", serve)
