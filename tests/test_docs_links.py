"""README.md and docs/*.md as users read them: every link resolves to a file of this
repository (none points outside it), and the README opens with its two commands (the
second is what CI runs) and reads as a product page, not a lab notebook.

Links are found by a Markdown parser (markdown-it-py, which rich already brings), so
text inside code blocks and code spans is not taken for a link.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]

COMMANDS = (
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[server]" && skmq serve',
    'python3 -m venv .venv && . .venv/bin/activate && pip install -q -e ".[test]" && pytest',
)


def links(page: Path) -> list[str]:
    """Every link and image target of a Markdown page, in order."""
    parser = MarkdownIt("commonmark").enable("table")
    found: list[str] = []

    def visit(tokens: list[Token]) -> None:
        for token in tokens:
            target = token.attrGet("href") if token.type == "link_open" else None
            if token.type == "image":
                target = token.attrGet("src")
            if isinstance(target, str):
                found.append(target)
            if token.children:
                visit(token.children)

    visit(parser.parse(page.read_text(encoding="utf-8")))
    return found


def broken(page: Path, target: str, root: Path = REPO) -> str | None:
    """Why a link of `page` does not lead to a file under `root`, or None if it does."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return "points outside the repository"
    if not parts.path:
        return None  # an anchor on the same page
    if parts.path.startswith("/"):
        return "is an absolute path (links must be relative)"
    resolved = (page.parent / unquote(parts.path)).resolve()
    if not resolved.is_relative_to(root):
        return "leaves the repository"
    if not resolved.is_file():
        return "names no file of the repository"
    return None


def test_the_link_checker_tells_good_links_from_bad(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("# top\n", encoding="utf-8")
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(
        "[a](../README.md) ![b](x.png) `[c](code.md)`\n\n```\n[d](block.md)\n```\n\n"
        "| t |\n|---|\n| [e](https://example.org) |\n",
        encoding="utf-8",
    )
    assert links(page) == ["../README.md", "x.png", "https://example.org"]
    outside = "points outside the repository"
    verdicts = {
        target: broken(page, target, root=tmp_path)
        for target in (
            "../README.md",
            "../README.md#top",
            "#section",
            "https://example.org",
            "//example.org/x",
            "mailto:a@example.org",
            "/etc/passwd",
            "../../outside.md",
            "x.png",
        )
    }
    assert verdicts == {
        "../README.md": None,
        "../README.md#top": None,
        "#section": None,
        "https://example.org": outside,
        "//example.org/x": outside,
        "mailto:a@example.org": outside,
        "/etc/passwd": "is an absolute path (links must be relative)",
        "../../outside.md": "leaves the repository",
        "x.png": "names no file of the repository",
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_link_resolves_to_a_file_of_the_repository(page: Path) -> None:
    problems = [
        f"{target}: {why}" for target in links(page) if (why := broken(page, target)) is not None
    ]
    assert not problems, f"{page.relative_to(REPO)}: " + "; ".join(problems)


def test_the_readme_links_the_docs() -> None:
    targets = {urlsplit(target).path for target in links(README)}
    wanted = {
        f"docs/{name}.md"
        for name in ("PROTOCOL", "HTTP", "SECURITY", "AUDIT", "ARCHITECTURE", "PERFORMANCE")
    }
    wanted |= {"docs/CONFIG.md", "docs/OPERATIONS.md"}
    assert wanted <= targets, f"not linked: {sorted(wanted - targets)}"


def test_the_readme_names_no_web_address() -> None:
    text = README.read_text(encoding="utf-8")
    assert not re.findall(r"https?://\S*", text)


def test_the_readme_opens_with_its_two_commands() -> None:
    head = README.read_bytes()[:4000].decode("utf-8", errors="ignore")
    lines = [line.strip() for line in head.splitlines()]
    for command in COMMANDS:
        assert command in lines, f"not among the README's first 4000 bytes: {command}"
    assert "skmq serve" in head


def test_the_readme_reads_as_a_product_page() -> None:
    """No issue numbers, seeds, commit hashes or pass/fail marks of benchmark goals."""
    text = README.read_text(encoding="utf-8")
    notebook = {
        "issue number": r"\bissues?\s*#?\d+",
        "seed": r"\bseed\b",
        "commit hash": r"(?<![\w-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w-])",
        "pass/fail mark": r":\s*(?:pass|fail)\b|\|\s*(?:pass|fail)\s*\|",
    }
    found = {what: re.findall(pattern, text, re.IGNORECASE) for what, pattern in notebook.items()}
    assert not any(found.values()), {what: hits for what, hits in found.items() if hits}
    assert len(text.splitlines()) <= 260
