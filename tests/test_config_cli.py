"""Settings that explain themselves: every setting's meaning and default in one place
(skmq/config.py), shown by `skmq serve --help` and docs/CONFIG.md; `skmq config` prints
those in effect and where each came from, secrets masked; TOML keys in either case."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skmq.cli.config import REGENERATE, markdown
from skmq.config import Settings, sections

SKMQ = [sys.executable, "-m", "skmq.cli"]
ROOT = Path(__file__).resolve().parent.parent


def skmq(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    done = subprocess.run(
        [*SKMQ, *args], env={**base, **(env or {})},
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return done.returncode, done.stdout, done.stderr


def test_the_committed_docs_are_what_the_code_generates() -> None:
    committed = (ROOT / "docs" / "CONFIG.md").read_text(encoding="utf-8")
    assert committed == markdown(), f"docs/CONFIG.md is out of date: run `{REGENERATE}`"


def test_every_setting_has_a_one_line_meaning_and_a_group() -> None:
    for name, field in Settings.model_fields.items():
        about = field.description or ""
        assert len(about) >= 20 and "\n" not in about, name
        assert not about.endswith("."), f"{name}: --help adds the full stop"
    grouped = [name for _, names in sections() for name in names]
    assert grouped == list(Settings.model_fields)


def test_serve_help_gives_each_setting_its_meaning_default_and_variable() -> None:
    code, out, err = skmq("serve", "--help", env={"COLUMNS": "100"})
    assert code == 0, err
    text = " ".join(out.split())  # (argparse wraps lines where the terminal ends)
    for name in Settings.model_fields:
        assert f"--{name.replace('_', '-')} " in text, name
        assert f"env SKMQ_{name.upper()}." in text, name
    assert (
        "--max-searches-per-host N Answers from one host that name no app (an original "
        "peer's late ack) waiting for a search of every app; more are refused. Default 32; "
        "env SKMQ_MAX_SEARCHES_PER_HOST."
    ) in text
    assert "--max-frame-bytes BYTES Largest frame, in bytes;" in text
    assert "Default 1048576 (1 MiB); env SKMQ_MAX_FRAME_BYTES." in text
    assert "Delivery: --retry-times N" in text  # grouped
    assert "usage: skmq serve [--config PATH] [--SETTING VALUE ...]" in out


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "skmq.toml"
    path.write_text(
        'PORT = 1800\nredis_url = "redis://:filepass@redis.example:6380/0"\n'
        'SIGNING_SECRET = "whsec_c2VjcmV0"\nretry_backoff = [1, 2]\n'
    )
    return path


def test_config_says_where_each_setting_comes_from(config_file: Path) -> None:
    env = {"SKMQ_PORT": "1900", "SKMQ_AUTH_TOKEN": "tok-env-secret", "SKMQ_RETRY_TIMES": "7"}
    code, out, err = skmq(
        "config", "--config", str(config_file), "--retry-times", "9", "--key-prefix", "kp",
        env=env,
    )  # fmt: skip
    assert (code, err) == (0, ""), err
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    assert lines["PORT"] == ["1900", "env", "SKMQ_PORT"]  # env beats the file
    assert lines["RETRY_TIMES"] == ["9", "flag", "--retry-times"]  # a flag beats env
    assert lines["KEY_PREFIX"] == ["kp", "flag", "--key-prefix"]
    assert lines["REDIS_URL"] == ["redis://***@redis.example:6380/0", "file", str(config_file)]
    assert lines["RETRY_BACKOFF"] == ["1,2", "file", str(config_file)]
    assert lines["AUTH_TOKEN"] == ["***", "env", "SKMQ_AUTH_TOKEN"]
    assert lines["SIGNING_SECRET"] == ["***", "file", str(config_file)]
    assert lines["HOST"] == ["127.0.0.1", "default"]
    assert lines["DISK_FREE_LIMIT"] == ["52428800", "(50", "MiB)", "default"]
    assert len(lines) == len(Settings.model_fields)
    for secret in ("filepass", "tok-env-secret", "c2VjcmV0"):
        assert secret not in out


def test_config_json_is_for_scripts(config_file: Path) -> None:
    env = {"SKMQ_AUTH_TOKEN": "tok-env-secret", "SKMQ_PROT": "1"}
    code, out, err = skmq("config", "--json", "--config", str(config_file), env=env)
    assert code == 0
    assert err.strip() == (
        "skmq config: an environment variable names no setting: SKMQ_PROT (did you mean SKMQ_PORT?)"
    )
    doc = json.loads(out)
    assert doc["config_file"] == str(config_file)
    rows = {row["name"]: row for row in doc["settings"]}
    assert rows["port"] == {"name": "port", "env": "SKMQ_PORT", "value": 1800, "source": "file"}
    assert rows["auth_token"]["value"] == "***" and rows["auth_token"]["source"] == "env"
    assert rows["signing_secret"]["value"] == "***"
    assert rows["auth_file"] == {
        "name": "auth_file", "env": "SKMQ_AUTH_FILE", "value": None, "source": "default",
    }  # fmt: skip
    assert rows["redis_url"]["value"] == "redis://***@redis.example:6380/0"
    assert rows["retry_backoff"]["value"] == [1.0, 2.0]
    for secret in ("filepass", "tok-env-secret", "c2VjcmV0"):
        assert secret not in out


def test_config_refuses_a_bad_setting_in_one_line() -> None:
    code, out, err = skmq("config", "--port", "x")
    assert (code, out) == (2, "")
    assert err.strip() == (
        "skmq config: invalid setting PORT='x': Input should be a valid integer, "
        "unable to parse string as an integer"
    )


def test_toml_keys_in_either_case(tmp_path: Path) -> None:
    path = tmp_path / "upper.toml"
    path.write_text('PORT = 1800\nKEY_PREFIX = "up"\nlog_level = "warning"\n')
    settings = Settings.load(path)
    assert (settings.port, settings.key_prefix, settings.log_level) == (1800, "up", "warning")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("prot = 1800\n", "unknown setting 'prot' (did you mean 'port'?)"),
        ("PROT = 1800\n", "unknown setting 'PROT' (did you mean 'PORT'?)"),
        ("port = 1\nPORT = 2\n", "'port' and 'PORT' name one setting"),
    ],
)
def test_a_bad_toml_key_is_one_line(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    code, out, err = skmq("config", "--config", str(path))
    assert (code, out) == (2, "")
    assert err.strip() == f"skmq config: config file {path}: {error}"


def test_a_password_in_the_redis_urls_query_is_never_shown() -> None:
    """redis-py reads `?password=` (its form for unix sockets): masked as the one before `@`."""
    url = "unix:///run/redis.sock?db=0&password=qsecret&username=me&ssl_password=tlssecret"
    code, out, _ = skmq("config", "--redis-url", url)
    assert code == 0
    assert "unix:///run/redis.sock?db=0&password=***&username=me&ssl_password=***" in out
    code, out, _ = skmq("config", "--json", "--redis-url", url)
    rows = {row["name"]: row for row in json.loads(out)["settings"]}
    assert rows["redis_url"]["value"] == (
        "unix:///run/redis.sock?db=0&password=***&username=me&ssl_password=***"
    )
    for secret in ("qsecret", "tlssecret"):
        assert secret not in out
    code, out, err = skmq("config", "--redis-url", "redis://127.0.0.1:1/0?password=qsecret&db=x")
    assert code == 0 and "qsecret" not in out + err


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("redis://:qsec#ret@h:1/0", "'redis://***@h:1/0': holds a '#': write it %23"),
        ("redis://:qsecret@[::1/0", "'redis://***@[::1/0': Invalid IPv6 URL"),
    ],
)
def test_a_password_is_hidden_from_a_url_urlsplit_misreads(url: str, said: str) -> None:
    """A `#` in a password (a fragment to urlsplit) or a bad IPv6 host: refused, hidden."""
    code, out, err = skmq("config", "--redis-url", url)
    assert (code, out) == (2, "")
    assert err.startswith(f"skmq config: invalid setting REDIS_URL={said}"), err
    assert "qsec" not in err


def test_serve_does_not_show_the_query_password_of_a_redis_it_cannot_reach(
    tmp_path: Path,
) -> None:
    code, _, err = skmq(
        "serve", "--redis-url", "redis://127.0.0.1:1/0?password=qsecret", "--redis-wait", "0.2",
        "--log-level", "error", "--data-dir", str(tmp_path / "d"), "--http-port", "0",
    )  # fmt: skip
    assert code == 1
    assert err.startswith(
        "skmq serve: cannot reach Redis at redis://127.0.0.1:1/0?password=*** within 0.2s"
    ), err
    assert "qsecret" not in err
