"""The repository as a clone gets it: every file git tracks is there, and no tracked
symbolic link dangles or points outside the repository (where a clone on another
machine would not find its target)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tracked_paths() -> list[str]:
    """What `git ls-files` lists in this checkout; the test is skipped outside one."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=False
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    return [p for p in listed.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def test_every_tracked_path_exists_and_no_link_leads_outside() -> None:
    missing, outside = [], []
    for name in tracked_paths():
        path = ROOT / name
        if not path.is_symlink():
            if not path.exists():
                missing.append(name)
            continue
        target = path.resolve()
        if not target.is_relative_to(ROOT) or not target.exists():
            outside.append(f"{name} -> {path.readlink()}")
    assert not missing, f"tracked but absent (deleted without `git rm`?): {missing}"
    assert not outside, f"links that dangle in a clone: {outside}"
