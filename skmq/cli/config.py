"""`skmq config [--json] [--markdown]`: the settings in effect, each with where its value
came from (default, file, env or flag), secrets masked; `--markdown` prints
docs/CONFIG.md, every setting's meaning and default (from skmq/config.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import SecretStr
from pydantic_settings import (
    DotEnvSettingsSource,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SecretsSettingsSource,
    TomlConfigSettingsSource,
)

from skmq.config import (
    Settings,
    add_settings_flags,
    env_name,
    flag_name,
    redacted,
    sections,
    settings_from_args,
    settings_help,
    shown,
    shown_default,
    unknown_env,
)

REGENERATE = "skmq config --markdown > docs/CONFIG.md"

Origin = Literal["default", "file", "env", "flag"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The settings `skmq serve` would run with here (its flags, the SKMQ_* environment, "
        "--config), each with where it comes from; secrets masked."
    )
    parser.usage = "skmq config [--json | --markdown] [--config PATH] [--SETTING VALUE ...]"
    parser.formatter_class = settings_help
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help=f"print every setting's meaning and default as Markdown ({REGENERATE})",
    )
    add_settings_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.markdown:
        print(markdown(), end="")
        return 0
    settings = settings_from_args(args)
    overrides = {name: getattr(args, name, None) for name in Settings.model_fields}
    origins = setting_origins(args.config, **overrides)
    if args.json:
        config_file = None if args.config is None else str(args.config)
        rows = in_effect(settings, origins)
        print(json.dumps({"config_file": config_file, "settings": rows}, indent=2))
    else:
        print(as_text(settings, origins, args.config), end="")
    for name in unknown_env(os.environ):
        print(f"skmq config: an environment variable names no setting: {name}", file=sys.stderr)
    return 0


def setting_origins(config_file: Path | None, **overrides: Any) -> dict[str, Origin]:
    """Where each setting's value comes from: the first of the sources Settings reads
    (its settings_customise_sources: flags, env, file) that has it, else its default."""
    given = {k: v for k, v in overrides.items() if v is not None}
    settings_cls = Settings.reading(config_file)
    sources = settings_cls.settings_customise_sources(
        settings_cls,
        InitSettingsSource(settings_cls, given),
        EnvSettingsSource(settings_cls),
        DotEnvSettingsSource(settings_cls),
        SecretsSettingsSource(settings_cls),
    )
    origins: dict[str, Origin] = {}
    for source in reversed(sources):  # the first source wins: it is written last
        origin = ORIGINS[type(source)]
        origins.update({name.lower(): origin for name in source()})
    return {name: origins.get(name, "default") for name in Settings.model_fields}


ORIGINS: dict[type[PydanticBaseSettingsSource], Origin] = {
    InitSettingsSource: "flag",
    EnvSettingsSource: "env",
    TomlConfigSettingsSource: "file",
}


def in_effect(settings: Settings, origins: dict[str, Origin]) -> list[dict[str, Any]]:
    """One row a setting: its names, its value (as JSON; a secret `***`, a URL's
    password too) and where it came from."""
    values = settings.model_dump(mode="json")
    return [
        {
            "name": name,
            "env": env_name(name),
            "value": _masked(name, getattr(settings, name), values[name]),
            "source": origins[name],
        }
        for name in Settings.model_fields
    ]


def _masked(name: str, value: Any, dumped: Any) -> Any:
    if isinstance(value, SecretStr):
        return "***"
    if name == "redis_url":
        return redacted(value)
    return dumped


def as_text(settings: Settings, origins: dict[str, Origin], config_file: Path | None) -> str:
    """`NAME  value  where it came from` a line, in columns."""
    names = list(Settings.model_fields)
    values = {name: shown(name, getattr(settings, name)) for name in names}
    width = max(len(name) for name in names)
    value_width = max(len(v) for v in values.values() if len(v) <= VALUE_COLUMN)
    lines = []
    for name in names:
        where = _where(name, origins[name], config_file)
        lines.append(f"{name.upper():<{width}}  {values[name]:<{value_width}}  {where}")
    return "\n".join(lines) + "\n"


VALUE_COLUMN = 32  # a longer value (a URL, a list) pushes its line's origin further


def _where(name: str, origin: Origin, config_file: Path | None) -> str:
    if origin == "env":
        return f"env {env_name(name)}"
    if origin == "flag":
        return f"flag {flag_name(name)}"
    if origin == "file":
        return f"file {config_file}"
    return "default"


def markdown() -> str:
    """docs/CONFIG.md: how settings are given, then each group's table."""
    out = [
        "# Configuration",
        "",
        f"<!-- Generated from skmq/config.py by `{REGENERATE}`: edit the descriptions "
        "there, not here. -->",
        "",
        "`skmq serve` runs with no settings at all (an embedded Redis under `./skmq-data`). "
        "Each setting below may be given three ways; the first found wins:",
        "",
        "1. a flag: `skmq serve --max-frame-bytes 65536`;",
        "2. an environment variable: `SKMQ_MAX_FRAME_BYTES=65536`;",
        "3. a key of the TOML file named by `--config`: `max_frame_bytes = 65536`, in lower "
        "or upper case (`MAX_FRAME_BYTES = 65536`). A key that names no setting stops the "
        "broker with one line naming it (and the closest setting).",
        "",
        "`skmq config` takes the same flags and prints the settings in effect, each with "
        "where it came from (`default`, `file`, `env` or `flag`), secrets and passwords in "
        "URLs masked; `skmq config --json` prints them for scripts. `skmq serve --help` "
        "shows this table's text.",
        "",
        "Times are in seconds unless a setting says ms; sizes in bytes. A list is "
        "comma-separated (`SKMQ_RETRY_BACKOFF=1,5,10`; in TOML a string or an array).",
    ]
    for title, names in sections():
        out += ["", f"## {title}", "", "| Setting | Default | Meaning |", "|---|---|---|"]
        for name in names:
            about = str(Settings.model_fields[name].description)
            about = about.replace("|", "\\|").replace("<", "&lt;")  # (text, not markup)
            default = shown_default(name)
            default = "none" if default == "none" else f"`{default}`"
            out.append(f"| `{name.upper()}` | {default} | {about} |")
    return "\n".join(out) + "\n"
