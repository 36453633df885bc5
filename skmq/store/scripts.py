"""The Lua scripts of recipients and consumer groups, in `skmq/store/lua/` (the
consumer groups' transitions are listed in skmq/pull/groups.py; the delivery engine's
own scripts are skmq/queue/lua/'s).

Each script gets every key it touches in KEYS, in the order `KEYS` below names them
(each name is under the app's key base; a group's keys are appended by the caller), so
Redis Cluster and proxies can route it: all of one app's keys share the app's hash tag,
and no script touches a key of another app or of the whole store (the apps directory is
kept outside the scripts: skmq/store/directory.py). The helpers of `lib.lua` it uses
(and its preludes below) are prepended to a script when it is loaded.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

# The app keys each script touches, in KEYS order.
KEYS: dict[str, tuple[str, ...]] = {
    "set_state": ("recipients", "rstate", "rbeat"),
    "register": ("recipients", "rstate", "rbeat", "listed", "tally"),
    "unregister": ("recipients", "rstate", "rbeat"),
    # Consumer groups (skmq/pull/): + the group's inflight, delayed, held, gstate, dead, kq.
    # group_create and group_reset: + gadded, gsince, after them; group_delete: + gseen,
    # gadded, gsince.
    "group_create": ("groups", "glog"),
    "group_reset": ("groups", "glog"),
    "group_delete": ("groups", "glog"),
    "group_trim": ("groups", "glog", "gseen", "gadded", "gsince"),  # + each group's held
    "pull_receive": ("groups", "glog"),
    "pull_ack": ("groups", "glog"),
    "pull_nack": ("groups", "glog"),
    "pull_extend": ("groups", "glog"),
    "pull_replay": ("groups", "glog"),
    "pull_purge": ("groups", "glog"),
}

_PRELUDES: dict[str, tuple[str, ...]] = {
    "group_create": ("group_position",),
    "group_reset": ("group_position",),
    **{
        name: ("pull_lib",)
        for name in (
            *("pull_receive", "pull_ack", "pull_nack", "pull_extend"),
            *("pull_replay", "pull_purge"),
        )
    },
}


def _read(name: str) -> str:
    return resources.files("skmq.store").joinpath("lua", f"{name}.lua").read_text("utf-8")


# A top-level definition of lib.lua: `local function name(` or `local name =`.
_DEFINITION = re.compile(r"^local (?:function )?(\w+)", re.MULTILINE)
_COMMENT = re.compile(r"--[^\n]*")
# lib.lua's paragraphs start after a blank line, at a comment or a definition (a blank
# line inside a function is followed by indented code).
_PARAGRAPH = re.compile(r"\n\n(?=--|local )")


def _paragraphs(lib: str) -> list[tuple[set[str], str]]:
    """lib.lua cut into paragraphs, each with the names it defines."""
    return [(set(_DEFINITION.findall(p)), p + "\n\n") for p in _PARAGRAPH.split(lib)]


def _used(code: str, names: set[str]) -> set[str]:
    words = set(re.findall(r"\w+", _COMMENT.sub("", code)))
    return names & words


def lib_for(code: str, lib: str | None = None) -> str:
    """The paragraphs of lib.lua (or of `lib`, another such file's text) defining what
    `code` uses, directly or through another, in file order: Redis runs a script's whole
    prelude on every call (each helper a new closure, more for Lua's collector to sweep),
    so a script carries only what it calls."""
    paragraphs = _paragraphs(_read("lib") if lib is None else lib)
    names = set().union(*(defined for defined, _ in paragraphs))
    needed = _used(code, names)
    for defined, text in reversed(paragraphs):  # a helper calls only those above it
        if defined & needed:
            needed |= _used(text, names - defined)
    return "".join(text for defined, text in paragraphs if defined & needed)


@functools.cache
def source(name: str) -> str:
    """The full source of script `name`: the lib.lua helpers it uses, its preludes, then
    its own file (built once a process: every Store registers every script)."""
    own = "\n".join([*(_read(p) for p in _PRELUDES.get(name, ())), _read(name)])
    return lib_for(own) + "\n" + own
