"""The event loop SKMQ's commands run on: uvloop where it is installed (pyproject.toml
installs it with CPython on Linux and macOS), else asyncio's own, so that the client and
its commands run wherever Python does (Windows, PyPy). The broker runs the same way."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_main(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion in a new event loop, uvloop's where there is one."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    result: T = uvloop.run(main)
    return result
