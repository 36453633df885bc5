"""Settings, exactly as SPEC section 9: flags beat `SKMQ_*` environment, which beats a TOML file."""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args, get_origin
from urllib.parse import unquote_plus, urlsplit

from pydantic import (
    Field,
    NonNegativeInt,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from skmq.settings_file import SettingsError, read_settings_file, setting_keys

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
    """Every setting of the broker, each with its meaning (`Field(description=...)`): the
    one source of `skmq serve --help`, `skmq config` and docs/CONFIG.md."""

    model_config = SettingsConfigDict(env_prefix="SKMQ_", extra="ignore")
    _toml_file: ClassVar[Path | None] = None

    # Where: the listener, the store, files.
    host: str = Field(
        "127.0.0.1",
        description="Address the broker listens on (PORT and HTTP_PORT); one other than "
        "loopback needs auth or ALLOW_UNAUTHENTICATED",
    )
    port: Port = Field(
        1734, description="TCP port of the broker's protocol (producers, recipients); 0: any free"
    )
    redis_url: str = Field(
        "",
        description="The Redis that stores messages: redis://, rediss://, unix://, "
        "redis+sentinel://HOSTS/SERVICE[/DB] or redis+cluster://HOSTS; empty: an embedded "
        "Redis under DATA_DIR",
    )
    redis_wait: Wait = Field(
        30.0, description="Seconds to wait at start for Redis to answer and load its data"
    )
    redis_check_interval: Seconds = Field(
        5.0,
        description="Seconds between checks of Redis's maxmemory-policy while running: while "
        "it may evict keys, nothing is stored (producers get error)",
    )
    clock_interval: Seconds = Field(
        60.0,
        description="Seconds between reads of Redis's clock, which every due time and lease "
        "follows (brokers on machines whose clocks differ agree)",
    )
    redis_pool_size: Count = Field(
        64,
        description="Redis connections of the broker; more calls at once wait for one "
        "(up to STORE_TIMEOUT)",
    )
    allow_volatile_redis: bool = Field(
        False,
        description="Start on a Redis without AOF (appendonly no), accepting that a restart of "
        "it loses every message acked since its last snapshot",
    )
    redis_appendfsync: Literal["always", "everysec", "no"] = Field(
        "everysec",
        description="Embedded Redis: when its AOF reaches the disk: always (each write; slow), "
        "everysec (a power loss loses up to a second), no (when the OS decides)",
    )
    redis_allocator: Literal["auto", "libc"] = Field(
        "auto",
        description="Embedded Redis: auto preloads jemalloc where the system has it (less CPU "
        "a message), libc keeps the C library's malloc",
    )
    disk_free_limit: NonNegativeInt = Field(
        50 << 20,
        description="Embedded Redis: while its disk has fewer bytes free, nothing is stored or "
        "acked (producers get error); 0: no check",
    )
    data_dir: Path = Field(
        Path("./skmq-data"),
        description="Directory of the embedded Redis's data (AOF) and of redis.json, by which "
        "operator commands find it",
    )
    key_prefix: str = Field(
        "skmq",
        description="Prefix of every Redis key; brokers on one Redis with the same prefix "
        "share their apps",
    )
    broker_id: str = Field(
        "",
        description="This broker's name in the delivery log and its file names; "
        "empty: host-pid-random",
    )
    # Delivery: retries, leases, heartbeats, rates (docs/PROTOCOL.md).
    retry_times: Count = Field(
        5, description="Failed attempts after which a message is dead (in the dead-letter queue)"
    )
    retry_backoff: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: [float(s) for s in ROCKETMQ_BACKOFF],
        description="Seconds to wait before attempt 2, 3, ... (comma-separated); the last "
        "one repeats",
    )
    retry_jitter: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Fraction (0-1) by which each retry wait may be longer or shorter, so that "
        "failures do not come back in lockstep",
    )
    ack_timeout: Seconds = Field(
        60.0,
        description="Seconds a push may go without a final answer before the attempt fails "
        "(the lease of a message in flight)",
    )
    ack_wait: Wait = Field(
        5.0,
        description="Seconds a push connection that only waits for final answers to `arrived` "
        "pushes stays open",
    )
    ack_linger: Wait = Field(
        0.002,
        description="Longest wait (seconds) of the journal records of answers and pushes for "
        "the next store's flush, to share its round trip; 0: write at once",
    )
    max_lease_extensions: NonNegativeInt = Field(
        10,
        description="Times one attempt's lease may be extended (`arrived` again, `extend`); "
        "past it the recipient gets reject",
    )
    heartbeat_interval: Seconds = Field(
        10.0, description="Seconds between pings of every registered recipient"
    )
    heartbeat_timeout: Seconds = Field(
        3.0, description="Seconds a recipient has to answer a ping before it is marked lost"
    )
    heartbeat_concurrency: Count = Field(
        256, description="Pings of one heartbeat round in flight at once"
    )
    recipient_networks: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="IP networks (comma-separated, like 10.0.0.0/8) recipients may register "
        "in, besides loopback and their own address",
    )
    push_window: Count = Field(
        128, description="Pushes awaiting an answer at once on one recipient's connection"
    )
    legacy_window: Count = Field(
        8,
        description="Connections at once to one original-protocol recipient (one push each, "
        "no pipelining)",
    )
    legacy_answer_timeout: Seconds = Field(
        10.0,
        description="Seconds an original-protocol recipient has to answer a push at all; "
        "else the attempt fails and the connection closes",
    )
    handshake_timeout: Seconds = Field(
        3.0, description="Seconds a new push connection has to answer its first ping"
    )
    rate: PerSecond = Field(
        0.0,
        description="Frames a second read on PORT, all connections together (reading slows, "
        "nothing is dropped); 0: unlimited",
    )
    delivery_rate: PerSecond = Field(
        0.0, description="Pushes a second of each app, on this broker; 0: unlimited"
    )
    dedupe_window: Seconds = Field(
        3600.0,
        description="Seconds a finished message's msgid is still refused as a duplicate",
    )
    default_ttl: NonNegativeInt = Field(
        0,
        description="Milliseconds after which a message sent without a ttl expires "
        "(see EXPIRED); 0: never",
    )
    max_delay: Horizon = Field(
        730 * DAY_MS,
        description="Furthest a message's delay or deliver_at may reach, in ms (730 days); "
        "further is refused",
    )
    max_ttl: Horizon = Field(
        3650 * DAY_MS,
        description="Longest ttl a message may give, in ms (3650 days); longer is refused",
    )
    ttl_by_app: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict,
        description="Default TTL of some apps, beating DEFAULT_TTL: app1:5000,app2:100 (ms)",
    )
    expired: Literal["dead", "drop"] = Field(
        "dead",
        description="What becomes of an expired message: dead (the dead-letter queue) or "
        "drop (forgotten, logged)",
    )
    # Bounds on what peers may send and hold (docs/PROTOCOL.md, limits).
    max_connections: Count = Field(
        10_000,
        description="Connections at once to PORT and HTTP_PORT together; one more is refused",
    )
    max_connections_per_host: Count = Field(
        1000,
        description="Connections at once from one peer address to PORT and HTTP_PORT; one "
        "more is refused",
    )
    max_frame_bytes: int = Field(
        1 << 20,
        ge=2 * PUSH_ROOM,
        description="Largest frame, in bytes; a message's content may be 4096 less (the room "
        "its push needs)",
    )
    max_line_bytes: Bytes = Field(4 << 10, description="Largest header line of a frame, in bytes")
    max_partial_bytes: Bytes = Field(
        64 << 20,
        description="Bytes of incomplete frames held, all connections together; past it the "
        "connection holding most is closed",
    )
    max_registration_bytes: Bytes = Field(
        4 << 10, description="Largest register or unregister content (JSON), in bytes"
    )
    max_recipients_per_app: Count = Field(
        1000, description="Recipients one app may have registered; a new one past it is refused"
    )
    max_store_pending_bytes: BufferBytes = Field(
        64 << 20,
        description="Bytes of producer content waiting for Redis; past it the broker reads no "
        "more frames until Redis catches up",
    )
    store_hold_backlog: NonNegativeInt = Field(
        768,
        description="Messages of one app due and not pushed (those behind their key "
        "included) while its recipients take more, or not read yet by one of its consumer "
        "groups while they receive, past which the app's new messages wait (0.5 s at most) "
        "before they are stored while the broker's CPU is full (STORE_HOLD_CPU): deliveries "
        "first; 0: never",
    )
    store_hold_cpu: float = Field(
        0.9,
        ge=0,
        le=1,
        description="Share (0-1) of one core the broker used over the last 0.1 s for which "
        "its CPU counts as full (STORE_HOLD_BACKLOG)",
    )
    max_unanswered_frames: Count = Field(
        4096,
        description="Frames of one connection read but not answered yet; past it the broker "
        "stops reading that connection",
    )
    max_unanswered_total: Count = Field(
        32768,
        description="Frames read but not answered yet, all connections together (each gets "
        "a share, at most MAX_UNANSWERED_FRAMES)",
    )
    max_write_buffer_bytes: BufferBytes = Field(
        16 << 20,
        description="Bytes of the broker's answers a peer has not read yet; past it that "
        "connection is closed",
    )
    max_peer_store_calls: Count = Field(
        16,
        description="Answers and registrations at Redis at once, all connections together "
        "(at most half of REDIS_POOL_SIZE); more wait",
    )
    max_searches_per_host: Count = Field(
        32,
        description="Answers from one host that name no app (an original peer's late ack) "
        "waiting for a search of every app; more are refused",
    )
    max_store_calls_per_connection: Count = Field(
        32,
        description="Answers and registrations of one connection at Redis at once; more wait "
        "their turn",
    )
    idle_timeout: Seconds = Field(
        5 * 60.0, description="Seconds a silent connection stays open (TCP and HTTP keep-alive)"
    )
    frame_timeout: Seconds = Field(
        30.0,
        description="Seconds a started frame (or HTTP request) has to arrive whole; else the "
        "connection is closed",
    )
    store_timeout: Seconds = Field(
        5.0,
        description="Seconds a producer's message may wait for Redis (a free connection, then "
        "the call); past it the producer gets error (store unavailable)",
    )
    # Replicas a stored message waits for before its `ack`.
    replica_acks: int = Field(
        0,
        ge=0,
        le=16,
        description="Replicas that must hold a stored message before its producer gets ack "
        "(Redis WAIT); 0: do not wait",
    )
    replica_ack_timeout: float = Field(
        1.0,
        gt=0,
        le=60,
        description="Seconds to wait for REPLICA_ACKS replicas; fewer: the producer gets error",
    )
    owner_lease: Seconds = Field(
        5.0,
        description="Seconds an app's owner holds it without renewing; a "
        "broker that dies loses its apps to the others within this",
    )
    backlog_held: int = Field(
        2048,
        ge=1,
        le=1_000_000,
        description="Queue messages an app's owner holds in memory, waiting; "
        "past it a plain queue message waits in Redis's log, its owner keeping its msgid "
        "alone, and is read back in order as those held go (memory against a read back)",
    )
    # The broker's own health: shutdown, supervision, its log, /metrics.
    shutdown_timeout: Wait = Field(
        5.0,
        description="Seconds a stopping broker gives answers to frames read, then pushes in "
        "flight, before handing them back",
    )
    task_max_restarts: NonNegativeInt = Field(
        10,
        description="Restarts in a minute of one failing background task after which the "
        "broker stops (status 1)",
    )
    log_level: str = Field(
        "info", description="Least level of the server log: debug, info, warning, error, critical"
    )
    log_format: Literal["console", "json"] = Field(
        "console", description="Server log as console text or json lines"
    )
    metrics_host: str = Field(
        "127.0.0.1", description="Address of METRICS_PORT's listener (/metrics and /healthz)"
    )
    metrics_port: Port = Field(
        0,
        description="Port serving only /metrics and /healthz (both are on HTTP_PORT too); 0: none",
    )
    # The delivery log (SPEC 7): files, compression, retention, a full disk.
    log_dir: Path | None = Field(
        None,
        description="Directory of the delivery log (what the audit reads); unset: "
        "DATA_DIR/delivery-log",
    )
    log_rotate_bytes: int = Field(
        16 << 20,
        ge=4096,
        description="Size in bytes at which a delivery-log file is closed (then gzipped) and "
        "the next begins",
    )
    log_retention_bytes: NonNegativeInt = Field(
        1 << 30,
        description="Bytes of delivery log kept on disk; past it the oldest compressed files "
        "go; 0: no bound",
    )
    log_retention_age: Wait = Field(
        7 * 86400.0,
        description="Seconds after which a compressed delivery-log file is removed "
        "(7 days); 0: kept",
    )
    log_backlog_bytes: NonNegativeInt = Field(
        16 << 20,
        description="Bytes of delivery-log lines kept while writes fail (disk full); past it "
        "the oldest are dropped and counted",
    )
    # The HTTP gateway (docs/HTTP.md) on HOST; 0: off.
    http_port: Port = Field(
        1735,
        description="Port of the HTTP gateway on HOST (produce, pull, /metrics, /healthz); 0: off",
    )
    http_max_body_bytes: BufferBytes = Field(
        8 << 20, description="Largest HTTP request body, in bytes (larger: 413)"
    )
    http_max_batch: Count = Field(
        1000, description="Most messages in one HTTP produce request (more: 413)"
    )
    # Pull consumption (docs/HTTP.md).
    pull_max_messages: Count = Field(
        100, description="Most messages one pull receive may ask for (more: 400)"
    )
    pull_max_wait: Wait = Field(
        20.0, description="Longest long poll a pull receive may ask for, in seconds (more: 400)"
    )
    pull_max_visibility: Seconds = Field(
        12 * 60 * 60.0,
        description="Longest lease, in seconds, a pull receive or extend may ask for (12 hours)",
    )
    pull_visibility: Seconds = Field(
        30.0, description="Seconds a pulled message stays leased when the receive names none"
    )
    pull_max_waiting: Count = Field(
        10_000, description="Long polls waiting at once on this broker (more: 503)"
    )
    group_log_trim_interval: Seconds = Field(
        5.0,
        description="Seconds between trims of the consumer groups' log (one broker a round)",
    )
    # Security (docs/SECURITY.md). SecretStr: a secret never shows in a repr or a log.
    auth_token: SecretStr | None = Field(
        None,
        description="One token every connection must present first; it may do everything. "
        "Unset: no token",
    )
    auth_file: Path | None = Field(
        None,
        description="TOML file of tenants' tokens, each with its apps and roles "
        "(docs/SECURITY.md). Unset: no tenants",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Let a HOST other than loopback run without auth (else the broker "
        "refuses to start)",
    )
    signing_secret: SecretStr | None = Field(
        None,
        description="Secret signing every push (HMAC-SHA256, Standard Webhooks style: "
        "whsec_<base64> or any text). Unset: unsigned",
    )

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

    @model_validator(mode="after")
    def _a_port_for_each_listener(self) -> Settings:
        """PORT, HTTP_PORT (both on HOST) and METRICS_PORT (on METRICS_HOST) apart, where
        two could be on one address: else the second listener fails, after the embedded
        Redis started."""
        listeners = [
            ("PORT", self.host, self.port),
            ("HTTP_PORT", self.host, self.http_port),
            ("METRICS_PORT", self.metrics_host, self.metrics_port),
        ]
        for i, (name, host, port) in enumerate(listeners):
            for other, other_host, other_port in listeners[:i]:
                if port and port == other_port and _may_overlap(host, other_host):
                    raise ValueError(
                        f"{name}={port} is {other}'s too (each listener needs its own)"
                    )
        return self

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Settings:
        """Build settings from flags (`overrides`, None meaning not given), env and TOML.
        Raises SettingsError (one line naming the setting or file) for anything bad."""
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            if config_file is None:
                return cls(**given)
            check_toml(config_file)
            return cls.reading(config_file)(**given)
        except ValidationError as exc:
            raise SettingsError(one_line(exc)) from None

    @classmethod
    def reading(cls, config_file: Path | None) -> type[Settings]:
        """These settings, read from `config_file` (TOML) too, if given."""
        if config_file is None:
            return cls
        with_file: type[Settings] = type("FileSettings", (cls,), {"_toml_file": config_file})
        return with_file


# Addresses a listener binds every address of the host on (of IPv6 and IPv4 alike).
ANY_ADDRESSES = ("", "0.0.0.0", "::")


def _may_overlap(host: str, other: str) -> bool:
    """Two listen addresses that may be one: the same, or one of them every address."""
    return host == other or host in ANY_ADDRESSES or other in ANY_ADDRESSES


def check_redis_url(url: str) -> None:
    """Raise ValueError (a short reason) for a REDIS_URL of a known scheme that no client
    could use: no host (`redis://` would quietly mean localhost:6379), a port that is
    not a number 0-65535, a db that is not a number, a Sentinel URL without its service,
    a `#` (a URL's fragment, which would cut a password in two, and show a part)."""
    if "#" in url:
        raise ValueError("holds a '#': write it %23 (in a password too)")
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


# Query parameters of a Redis URL whose value is a secret: redis-py passes every query
# parameter to its connection, `?password=` (its documented form for unix sockets) and
# `?ssl_password=` among them.
SECRET_QUERY = re.compile(r"password|secret|token", re.IGNORECASE)


def redacted(url: str) -> str:
    """A Redis URL fit for logs and messages: its credentials replaced by `***`, those
    before the `@` and those in the query (`?password=***`)."""
    head, question, query = url.partition("?")
    # (not urlsplit: it fails on some bad URLs, which must be shown too, and takes a `#`
    # in a password for a fragment)
    scheme, slashes, rest = head.partition("://")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        head = f"{scheme}{slashes}***@{_netloc(netloc)}{slash}{path}"
    if question:
        query = "&".join(map(_redacted_parameter, query.split("&")))
    return head + question + query


def _redacted_parameter(pair: str) -> str:
    """`name=***` for a secret's name; a parameter without `=` (which no client reads) may
    be the rest of a password holding an unquoted `?`, so it is hidden too."""
    name, equals, _ = pair.partition("=")
    if not equals:
        return "***" if pair else pair
    return f"{name}=***" if SECRET_QUERY.search(unquote_plus(name)) else pair


def one_line(exc: ValidationError) -> str:
    """`invalid setting PORT='x': Input should be a valid integer; ...`"""
    parts = []
    for err in exc.errors():
        msg = str(err["msg"]).removeprefix("Value error, ")
        if not err["loc"]:  # settings refused together: the message names them
            parts.append(msg)
            continue
        name = str(err["loc"][0]).upper()
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
    """The settings file exists, parses, and names only known settings, each once: in
    lower or upper case alike (`redis_url`, `REDIS_URL`), as the environment's names."""
    for name, key in setting_keys(read_settings_file(path), path).items():
        if name not in Settings.model_fields:
            close = difflib.get_close_matches(name, list(Settings.model_fields), n=1)
            hint = f" (did you mean {_same_case(close[0], key)!r}?)" if close else ""
            raise SettingsError(f"config file {path}: unknown setting {key!r}{hint}")


def _same_case(name: str, like: str) -> str:
    return name.upper() if like.isupper() else name


# Settings that operator commands also take as flags (they only need to find the store).
STORE_FLAGS = ("data_dir", "redis_url", "key_prefix")

# The settings in groups, for --help and docs/CONFIG.md: the first setting of each group
# (in the order Settings declares them) and its title.
SECTIONS = {
    "host": "Listener and store",
    "retry_times": "Delivery",
    "max_connections": "Limits on peers",
    "replica_acks": "Replication",
    "shutdown_timeout": "The broker's own log, health and metrics",
    "log_dir": "Delivery log",
    "http_port": "HTTP gateway",
    "pull_max_messages": "Pull consumption",
    "auth_token": "Security",
}

# How a flag's value is written, where its type does not say it well enough.
METAVARS = {
    "host": "ADDRESS",
    "metrics_host": "ADDRESS",
    "redis_url": "URL",
    "retry_backoff": "SECONDS,...",
    "retry_jitter": "FRACTION",
    "store_hold_cpu": "FRACTION",
    "recipient_networks": "CIDR,...",
    "ttl_by_app": "APP:MS,...",
    "rate": "PER_SECOND",
    "delivery_rate": "PER_SECOND",
    "default_ttl": "MS",
    "max_delay": "MS",
    "max_ttl": "MS",
    "disk_free_limit": "BYTES",
    "log_dir": "DIR",
    "data_dir": "DIR",
    "log_level": "LEVEL",
}


def sections() -> list[tuple[str, list[str]]]:
    """(title, setting names) a group, every setting in one, in declaration order."""
    groups: list[tuple[str, list[str]]] = []
    for name in Settings.model_fields:
        if name in SECTIONS:
            groups.append((SECTIONS[name], []))
        groups[-1][1].append(name)
    return groups


def metavar(name: str) -> str:
    """How the value of setting `name` is written on a command line."""
    if name in METAVARS:
        return METAVARS[name]
    annotation = Settings.model_fields[name].annotation
    if get_origin(annotation) is Literal:
        return "{" + ",".join(get_args(annotation)) + "}"
    if annotation is bool:
        return "{true,false}"
    if annotation is float:
        return "SECONDS"
    if annotation is int:
        return "BYTES" if name.endswith("_bytes") else "PORT" if name.endswith("port") else "N"
    if SecretStr in get_args(annotation):
        return "SECRET"
    if Path in (annotation, *get_args(annotation)):
        return "PATH"
    return "TEXT"


def shown_default(name: str) -> str:
    """Setting `name`'s default as it is written (a size in bytes also in KiB/MiB/GiB)."""
    return shown(name, Settings.model_fields[name].get_default(call_default_factory=True))


def shown(name: str, value: Any) -> str:
    """A setting's value as an operator writes it; a secret never (`***`)."""
    if value is None or value == "" or value == [] or value == {}:
        return "none"
    if isinstance(value, SecretStr):
        return "***"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ",".join(shown(name, v) for v in value)
    if isinstance(value, dict):
        return ",".join(f"{k}:{v}" for k, v in value.items())
    if isinstance(value, int) and metavar(name) == "BYTES":
        return f"{value}{_in_units(value)}"
    if name == "redis_url":
        return redacted(str(value))
    if isinstance(value, Path) and not value.is_absolute() and not str(value).startswith("."):
        return f"./{value}"  # (as the default is written: a path of the working directory)
    return str(value)


def _in_units(size: int) -> str:
    """` (16 MiB)` for a size that is a whole number of KiB, MiB or GiB; else nothing."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f" ({size >> shift} {unit})"
    return ""


def env_name(name: str) -> str:
    return f"SKMQ_{name.upper()}"


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def setting_help(name: str) -> str:
    """A setting's meaning, default and environment variable: its line in --help."""
    about = Settings.model_fields[name].description
    return f"{about}. Default {shown_default(name)}; env {env_name(name)}."


def add_settings_flags(
    parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None
) -> None:
    """Add `--config` and one `--name` flag a setting: all of them, grouped as SECTIONS,
    or just `names`."""
    parser.add_argument(
        "--config", type=Path, default=None, metavar="PATH",
        help="TOML file of settings (keys as the settings' names, in either case: "
        "port = 1734 or PORT = 1734). Flags beat SKMQ_* environment variables, which beat it.",
    )  # fmt: skip
    if names is not None:
        _add_flags(parser.add_argument, names)
        return
    for title, group in sections():
        _add_flags(parser.add_argument_group(title).add_argument, group)


def _add_flags(add_argument: Callable[..., argparse.Action], names: Iterable[str]) -> None:
    for name in names:
        add_argument(
            flag_name(name), dest=name, default=None, metavar=metavar(name),
            help=setting_help(name),
        )  # fmt: skip


def settings_help(prog: str) -> argparse.HelpFormatter:
    """--help of a command taking every setting: each flag on its own line, its meaning
    below it (the flags are too long for a column of their own)."""
    return argparse.HelpFormatter(prog, max_help_position=8)


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {name: getattr(args, name, None) for name in Settings.model_fields}
    return Settings.load(getattr(args, "config", None), **overrides)
