"""The broker's TOML settings file (`--config`), read the one way by `skmq serve` and by
the client commands that find the broker from it. Standard library only: the client
commands do not install pydantic (the `server` extra)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from skmq.errors import UsageError


class SettingsError(UsageError):
    """A bad setting or settings file."""


def read_settings_file(path: Path) -> dict[str, Any]:
    """The file's table; SettingsError (one line naming the file) if it cannot be read."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SettingsError(f"config file {path}: no such file") from None
    except OSError as exc:
        raise SettingsError(f"config file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(f"config file {path}: not valid TOML ({exc})") from None


def setting_keys(data: dict[str, Any], path: Path) -> dict[str, str]:
    """Each setting's name (lower case) and its key as written: a key names a setting in
    lower or upper case alike (`redis_url`, `REDIS_URL`), as the environment's names;
    SettingsError for one setting given twice (`port` and `PORT`)."""
    keys: dict[str, str] = {}
    for key in data:
        name = key.lower()
        if name in keys:
            raise SettingsError(f"config file {path}: {keys[name]!r} and {key!r} name one setting")
        keys[name] = key
    return keys
