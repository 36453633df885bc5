"""Settings, exactly as SPEC section 9: flags beat `SKMQ_*` environment, which beats a TOML file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

# RocketMQ's delay levels, in seconds (the last one repeats).
ROCKETMQ_BACKOFF = [1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600]


def _split_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SKMQ_", extra="ignore")
    _toml_file: ClassVar[Path | None] = None

    host: str = "127.0.0.1"
    port: int = Field(1734, ge=0, le=65535)
    redis_url: str = ""
    data_dir: Path = Path("./skmq-data")
    log_dir: Path | None = None
    key_prefix: str = "skmq"
    broker_id: str = ""
    retry_times: int = Field(5, ge=1)
    retry_backoff: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: [float(s) for s in ROCKETMQ_BACKOFF]
    )
    ack_timeout: float = Field(60.0, gt=0)
    ack_wait: float = Field(5.0, ge=0)
    heartbeat_interval: float = Field(10.0, gt=0)
    heartbeat_timeout: float = Field(3.0, gt=0)
    rate: float = Field(0.0, ge=0)
    delivery_rate: float = Field(0.0, ge=0)
    max_frame_bytes: int = Field(1 << 20, ge=64)
    max_line_bytes: int = Field(4096, ge=64)
    max_connections: int = Field(10_000, ge=1)
    idle_timeout: float = Field(300.0, gt=0)
    frame_timeout: float = Field(30.0, gt=0)
    max_partial_bytes: int = Field(64 << 20, ge=64)
    max_connections_per_host: int = Field(1000, ge=1)
    max_unanswered_frames: int = Field(4096, ge=1)
    max_store_calls_per_connection: int = Field(32, ge=1)
    max_registration_bytes: int = Field(4096, ge=64)
    redis_pool_size: int = Field(64, ge=1)
    store_timeout: float = Field(5.0, gt=0)
    max_store_pending_bytes: int = Field(64 << 20, ge=1024)
    recipient_networks: Annotated[list[str], NoDecode] = Field(default_factory=list)
    push_window: int = Field(128, ge=1)
    dedupe_window: float = Field(3600.0, gt=0)
    shutdown_timeout: float = Field(5.0, ge=0)
    redis_appendfsync: Literal["always", "everysec", "no"] = "everysec"
    log_rotate_bytes: int = Field(64 << 20, ge=4096)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(0, ge=0, le=65535)
    log_level: str = "info"
    log_format: Literal["console", "json"] = "console"

    @field_validator("retry_backoff", mode="before")
    @classmethod
    def _backoff(cls, value: Any) -> Any:
        return _split_csv(value)

    @field_validator("recipient_networks", mode="before")
    @classmethod
    def _networks(cls, value: Any) -> Any:
        return _split_csv(value)

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

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Settings:
        """Build settings from flags (`overrides`, None meaning not given), env and TOML."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if config_file is None:
            return cls(**given)
        with_file = type("FileSettings", (cls,), {"_toml_file": config_file})
        settings: Settings = with_file(**given)
        return settings


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
