"""Settings, exactly as SPEC section 9: flags beat `SKMQ_*` environment, which beats a TOML file."""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, NonNegativeInt, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from skmq.errors import UsageError

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster")

# RocketMQ's delay levels, in seconds (the last one repeats).
ROCKETMQ_BACKOFF = [1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600]

BROKER_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")

# The constraint families the settings share (a bad value is refused with the setting's name).
Port = Annotated[int, Field(ge=0, le=65535)]
Seconds = Annotated[float, Field(gt=0)]  # a timeout or an interval
Wait = Annotated[float, Field(ge=0)]  # how long to wait; 0: not at all
PerSecond = Annotated[float, Field(ge=0)]  # a rate limit; 0: unlimited
Count = Annotated[int, Field(ge=1)]  # a size or limit of at least one
Bytes = Annotated[int, Field(ge=64)]  # a size in bytes; less than 64 holds no frame
BufferBytes = Annotated[int, Field(ge=1024)]  # bytes held at once (bodies, pending content)
# A span of ms a message may reach ahead (delay, ttl): at most 10^15, so that every time
# computed from it stays an exact number in Lua (doubles: 2^53 is about 9 * 10^15).
Horizon = Annotated[int, Field(ge=0, le=10**15)]
DAY_MS = 86_400_000


def _split_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


# What a push adds to a message's content (appid, msgid, attempt, stored_at, recipient,
# token, traceparent, signature, length...): at most this, so content of up to
# MAX_FRAME_BYTES less this makes a push no recipient reading MAX_FRAME_BYTES refuses.
PUSH_ROOM = 4096


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SKMQ_", extra="ignore")
    _toml_file: ClassVar[Path | None] = None

    # Where: the listener, the store, files.
    host: str = "127.0.0.1"
    port: Port = 1734
    redis_url: str = ""
    redis_wait: Wait = 30.0
    redis_check_interval: Seconds = 5.0
    clock_interval: Seconds = 60.0
    redis_pool_size: Count = 64
    redis_appendfsync: Literal["always", "everysec", "no"] = "everysec"
    redis_allocator: Literal["auto", "libc"] = "auto"
    disk_free_limit: NonNegativeInt = 50 << 20
    data_dir: Path = Path("./skmq-data")
    key_prefix: str = "skmq"
    broker_id: str = ""
    # Delivery: retries, leases, heartbeats, rates (docs/PROTOCOL.md).
    retry_times: Count = 5
    retry_backoff: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: [float(s) for s in ROCKETMQ_BACKOFF]
    )
    retry_jitter: float = Field(0.1, ge=0, le=1)
    ack_timeout: Seconds = 60.0
    ack_wait: Wait = 5.0
    ack_linger: Wait = 0.002
    max_lease_extensions: NonNegativeInt = 10
    heartbeat_interval: Seconds = 10.0
    heartbeat_timeout: Seconds = 3.0
    heartbeat_concurrency: Count = 256
    recipient_networks: Annotated[list[str], NoDecode] = Field(default_factory=list)
    push_window: Count = 128
    legacy_window: Count = 8
    legacy_answer_timeout: Seconds = 10.0
    handshake_timeout: Seconds = 3.0
    rate: PerSecond = 0.0
    delivery_rate: PerSecond = 0.0
    dedupe_window: Seconds = 3600.0
    default_ttl: NonNegativeInt = 0
    max_delay: Horizon = 730 * DAY_MS
    max_ttl: Horizon = 3650 * DAY_MS
    ttl_by_app: Annotated[dict[str, int], NoDecode] = Field(default_factory=dict)
    expired: Literal["dead", "drop"] = "dead"
    # Bounds on what peers may send and hold (docs/PROTOCOL.md, limits).
    max_connections: Count = 10_000
    max_connections_per_host: Count = 1000
    max_frame_bytes: int = Field(1 << 20, ge=2 * PUSH_ROOM)
    max_line_bytes: Bytes = 4 << 10
    max_partial_bytes: Bytes = 64 << 20
    max_registration_bytes: Bytes = 4 << 10
    max_recipients_per_app: Count = 1000
    max_store_pending_bytes: BufferBytes = 64 << 20
    max_unanswered_frames: Count = 4096
    max_unanswered_total: Count = 32768
    max_write_buffer_bytes: BufferBytes = 16 << 20
    max_peer_store_calls: Count = 16
    max_searches_per_host: Count = 32
    max_store_calls_per_connection: Count = 32
    idle_timeout: Seconds = 5 * 60.0
    frame_timeout: Seconds = 30.0
    store_timeout: Seconds = 5.0
    # Replicas a stored message waits for before its `ack`.
    replica_acks: int = Field(0, ge=0, le=16)
    replica_ack_timeout: float = Field(1.0, gt=0, le=60)
    # The broker's own health: shutdown, supervision, its log, /metrics.
    shutdown_timeout: Wait = 5.0
    task_max_restarts: NonNegativeInt = 10
    log_level: str = "info"
    log_format: Literal["console", "json"] = "console"
    metrics_host: str = "127.0.0.1"
    metrics_port: Port = 0
    # The delivery log (SPEC 7): files, compression, retention, a full disk.
    log_dir: Path | None = None
    log_rotate_bytes: int = Field(16 << 20, ge=4096)
    log_retention_bytes: NonNegativeInt = 1 << 30
    log_retention_age: Wait = 7 * 86400.0
    log_backlog_bytes: NonNegativeInt = 16 << 20
    # The HTTP gateway (docs/HTTP.md) on HOST; 0: off.
    http_port: Port = 1735
    http_max_body_bytes: BufferBytes = 8 << 20
    http_max_batch: Count = 1000
    # Pull consumption (docs/HTTP.md).
    pull_max_messages: Count = 100
    pull_max_wait: Wait = 20.0
    pull_max_visibility: Seconds = 12 * 60 * 60.0
    pull_visibility: Seconds = 30.0
    pull_max_waiting: Count = 10_000
    group_log_trim_interval: Seconds = 5.0
    # Security (docs/SECURITY.md). SecretStr: a secret never shows in a repr or a log.
    auth_token: SecretStr | None = None
    auth_file: Path | None = None
    allow_unauthenticated: bool = False
    signing_secret: SecretStr | None = None

    @property
    def max_content_bytes(self) -> int:
        """The largest content a producer may send: it must fit in a push (PUSH_ROOM)."""
        return self.max_frame_bytes - PUSH_ROOM

    def app_ttl(self, app: str) -> int:
        """The TTL (ms; 0: none) of `app`'s messages sent without one (TTL_BY_APP, else
        DEFAULT_TTL), over TCP and HTTP alike."""
        return self.ttl_by_app.get(app, self.default_ttl)

    @field_validator("retry_backoff", "recipient_networks", mode="before")
    @classmethod
    def _csv(cls, value: Any) -> Any:
        return _split_csv(value)

    @field_validator("ttl_by_app", mode="before")
    @classmethod
    def _ttls(cls, value: Any) -> Any:
        """`app1:5000,app2:100` (ms) -> {"app1": 5000, "app2": 100}."""
        if not isinstance(value, str):
            return value
        ttls = {}
        for part in _split_csv(value):
            app, sep, ms = part.rpartition(":")
            if not sep or not app or not ms.strip().isdigit():
                raise ValueError(f"{part!r} is not app:<ttl ms> (a non-negative integer)")
            ttls[app.strip()] = int(ms)
        return ttls

    @field_validator("ttl_by_app")
    @classmethod
    def _ttls_not_negative(cls, value: dict[str, int]) -> dict[str, int]:
        if any(ms < 0 for ms in value.values()):
            raise ValueError("a ttl is a non-negative integer (ms)")
        return value

    @field_validator("auth_token", "auth_file", "signing_secret", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("data_dir", "log_dir")
    @classmethod
    def _a_directory(cls, value: Path | None) -> Path | None:
        if value is not None and value.exists() and not value.is_dir():
            raise ValueError(f"{str(value)!r} is not a directory")
        return value

    @field_validator("broker_id")
    @classmethod
    def _file_name_part(cls, value: str) -> str:
        """It names the broker's delivery log files (delivery-<BROKER_ID>-<n>.jsonl)."""
        if value and BROKER_ID.fullmatch(value) is None:
            raise ValueError("at most 64 letters, digits, '_', '.' or '-'")
        return value

    @field_validator("recipient_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        """Each an IP network (host bits may be set: 10.0.0.5/8 is 10.0.0.0/8), checked
        at start rather than at the first registration it is needed for."""
        for net in value:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"{net!r} is not an IP network (like 10.0.0.0/8)") from None
        return value

    @field_validator("retry_backoff")
    @classmethod
    def _backoff_not_empty(cls, value: list[float]) -> list[float]:
        if not value or any(v < 0 for v in value):
            raise ValueError("retry_backoff needs at least one wait, none negative")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls._toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls._toml_file))
        return tuple(sources)

    @property
    def delivery_log_dir(self) -> Path:
        return self.log_dir if self.log_dir is not None else self.data_dir / "delivery-log"

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        if value.lower() not in LOG_LEVELS:
            raise ValueError(f"not a log level (one of {', '.join(LOG_LEVELS)})")
        return value.lower()

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        scheme = value.partition("://")[0] if "://" in value else None
        if value and scheme not in REDIS_SCHEMES:
            raise ValueError(f"needs a scheme of {', '.join(s + '://' for s in REDIS_SCHEMES)}")
        if value:
            check_redis_url(value)
        return value

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Settings:
        """Build settings from flags (`overrides`, None meaning not given), env and TOML.
        Raises SettingsError (one line naming the setting or file) for anything bad."""
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            if config_file is None:
                return cls(**given)
            check_toml(config_file)
            with_file = type("FileSettings", (cls,), {"_toml_file": config_file})
            settings: Settings = with_file(**given)
        except ValidationError as exc:
            raise SettingsError(one_line(exc)) from None
        return settings


def check_redis_url(url: str) -> None:
    """Raise ValueError (a short reason) for a REDIS_URL of a known scheme that no client
    could use: no host (`redis://` would quietly mean localhost:6379), a port that is
    not a number 0-65535, a db that is not a number, a Sentinel URL without its service."""
    parsed = urlsplit(url)
    db_path = [p for p in parsed.path.split("/") if p]
    if parsed.scheme == "unix":
        if not parsed.path:
            raise ValueError("a unix:// URL needs the socket's path (unix:///path/redis.sock)")
        return
    if parsed.scheme in ("redis", "rediss"):
        try:
            parsed.port  # noqa: B018 (parsing the port is the check)
        except ValueError:
            raise ValueError(f"{_netloc(parsed.netloc)!r} has no valid port (0-65535)") from None
        if not parsed.hostname:
            raise ValueError(f"needs a host: {parsed.scheme}://HOST[:PORT][/DB]")
        if len(db_path) > 1 or (db_path and not db_path[0].isdigit()):
            raise ValueError(f"the db {parsed.path!r} is not a number (/DB, e.g. /0)")
        return
    # redis+sentinel:// and redis+cluster://: a list of host[:port]
    for part in _netloc(parsed.netloc).split(","):
        host, port = part, ""
        if part.startswith("["):  # [IPv6] or [IPv6]:port
            host, _, rest = part.partition("]")
            host, port = host[1:], rest.removeprefix(":")
            if rest and not rest.startswith(":"):
                port = rest
        elif ":" in part:
            host, _, port = part.rpartition(":")
        if not host:
            raise ValueError(f"needs a host in every host:port ({part!r} has none)")
        if port and not (port.isdigit() and int(port) <= 65535):
            raise ValueError(f"{part!r} has no valid port (0-65535)")
    if parsed.scheme == "redis+sentinel":
        if not db_path:
            raise ValueError("needs the service name: redis+sentinel://HOST:PORT,.../SERVICE[/DB]")
        if len(db_path) > 2 or (len(db_path) == 2 and not db_path[1].isdigit()):
            raise ValueError(f"the db in {parsed.path!r} is not a number (/SERVICE/DB)")


def _netloc(netloc: str) -> str:
    """The host part of a URL's netloc, without the credentials (never shown)."""
    return netloc.rpartition("@")[2]


def redacted(url: str) -> str:
    """A Redis URL fit for logs and messages: its credentials replaced by `***`."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc="***@" + _netloc(parts.netloc)).geturl()


class SettingsError(UsageError):
    """A bad setting or settings file."""


def one_line(exc: ValidationError) -> str:
    """`invalid setting PORT='x': Input should be a valid integer; ...`"""
    parts = []
    for err in exc.errors():
        name = str(err["loc"][0]).upper() if err["loc"] else "?"
        msg = str(err["msg"]).removeprefix("Value error, ")
        value = err["input"]
        if name == "REDIS_URL" and isinstance(value, str):
            value = redacted(value)
        parts.append(f"{name}={value!r}: {msg}")
    return "invalid setting " + "; ".join(parts)


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """`SKMQ_*` variables that name no setting, each with the closest one if any."""
    names = [f"SKMQ_{name.upper()}" for name in Settings.model_fields]
    found = []
    for key in sorted(k for k in environ if k.startswith("SKMQ_") and k not in names):
        close = difflib.get_close_matches(key, names, n=1)
        found.append(f"{key} (did you mean {close[0]}?)" if close else key)
    return found


def check_toml(path: Path) -> None:
    """The settings file exists, parses, and names only known settings."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SettingsError(f"config file {path}: no such file") from None
    except OSError as exc:
        raise SettingsError(f"config file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(f"config file {path}: not valid TOML ({exc})") from None
    for key in data:
        if key not in Settings.model_fields:
            close = difflib.get_close_matches(key, list(Settings.model_fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SettingsError(f"config file {path}: unknown setting {key!r}{hint}")


# Settings that operator commands also take as flags (they only need to find the store).
STORE_FLAGS = ("data_dir", "redis_url", "key_prefix")


def add_settings_flags(
    parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None
) -> None:
    """Add `--config` and one `--name` flag a setting (all of them, or just `names`)."""
    parser.add_argument("--config", type=Path, default=None, help="TOML file with settings")
    for name in names if names is not None else tuple(Settings.model_fields):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(
            flag,
            dest=name,
            default=None,
            metavar=name.upper(),
            help=f"setting {name.upper()} (env SKMQ_{name.upper()})",
        )


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {name: getattr(args, name, None) for name in Settings.model_fields}
    return Settings.load(getattr(args, "config", None), **overrides)
