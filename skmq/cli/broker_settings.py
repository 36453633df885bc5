"""Where a client command finds the broker: from the settings the broker itself reads,
in the broker's order (skmq/config.py): `SKMQ_HOST`, `SKMQ_PORT`, `SKMQ_HTTP_PORT` in the
environment, then the broker's TOML file (`--config`, as given to `skmq serve`), then the
defaults. A flag of the command beats them all. So a consumer started beside its broker,
with the same environment or file, needs no address flag.

Standard library only: the client commands do not install pydantic (the `server` extra),
so the three settings are read and checked here, as the broker would refuse them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skmq.errors import UsageError
from skmq.settings_file import read_settings_file, setting_keys

DEFAULTS: dict[str, Any] = {"host": "127.0.0.1", "port": 1734, "http_port": 1735}

# A broker listening on every address is reached on the loopback one.
ANY_ADDRESS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


@dataclass(frozen=True, slots=True)
class BrokerAddresses:
    host: str
    port: int
    http_port: int  # 0: the gateway is off

    @property
    def gateway(self) -> str:
        """Where a pull consumer goes: the HTTP gateway, or, while it is off
        (HTTP_PORT=0), the protocol port (`tcp://`), which serves the same pull calls."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.http_port:
            return f"http://{host}:{self.http_port}"
        return f"tcp://{host}:{self.port}"


def broker_addresses(
    config: Path | None, environ: Mapping[str, str] = os.environ
) -> BrokerAddresses:
    """The broker's HOST, PORT and HTTP_PORT as it would read them; UsageError (one line
    naming the setting or the file) for a value it would refuse."""
    file: dict[str, Any] = {}
    keys: dict[str, str] = {}  # each setting's key as written in the file
    if config is not None:
        file = read_settings_file(config)
        keys = setting_keys(file, config)
    found: dict[str, Any] = {}
    for name, default in DEFAULTS.items():
        env = f"SKMQ_{name.upper()}"
        if env in environ:
            value, where = environ[env], env
        elif name in keys:
            value, where = file[keys[name]], f"{keys[name]} in {config}"
        else:
            value, where = default, ""
        found[name] = _port(value, where) if name != "host" else _host(value, where)
    return BrokerAddresses(**found)


def _port(value: Any, where: str) -> int:
    text = str(value).strip() if not isinstance(value, bool) else ""
    if not (text.isascii() and text.isdigit() and int(text) <= 65535):
        raise UsageError(f"invalid setting {where}={value!r}: not a port (0-65535)")
    return int(text)


def _host(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise UsageError(f"invalid setting {where}={value!r}: not a host name or address")
    return ANY_ADDRESS.get(value.strip(), value.strip())
