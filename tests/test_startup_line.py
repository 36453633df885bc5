"""The broker's start-up line names every address it listens on (a real `skmq serve`,
its log read as a user would)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from skmq.embedded import EmbeddedRedis
from tests.conftest import BrokerProcess, free_port


def startup_line(log_path: Path, timeout: float = 20.0) -> dict[str, Any]:
    """The `broker listening` event of a JSON log, once written (within `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if line.startswith("{"):
                event: dict[str, Any] = json.loads(line)
                if event.get("event") == "broker listening":
                    return event
        time.sleep(0.05)
    raise TimeoutError(f"no start-up line in {log_path}:\n{log_path.read_text()[-2000:]}")


def test_the_start_up_line_names_the_protocol_http_and_metrics_addresses(
    broker_env: dict[str, str], tmp_path: Path
) -> None:
    http_port, metrics_port = free_port(), free_port()
    broker_env.update(
        SKMQ_LOG_LEVEL="info",
        SKMQ_LOG_FORMAT="json",
        SKMQ_HTTP_PORT=str(http_port),
        SKMQ_METRICS_PORT=str(metrics_port),
    )
    broker = BrokerProcess(broker_env, tmp_path / "broker.log").start()
    try:
        event = startup_line(broker.log_path)
        assert event["protocol"] == f"127.0.0.1:{broker.port}"
        assert event["http"] == f"127.0.0.1:{http_port}"
        assert event["metrics"] == f"127.0.0.1:{metrics_port}"
    finally:
        assert broker.terminate() == 0


def test_the_start_up_line_says_the_gateway_is_off_and_no_metrics_port(
    broker_env: dict[str, str], tmp_path: Path
) -> None:
    broker_env.update(SKMQ_LOG_LEVEL="info", SKMQ_LOG_FORMAT="json", SKMQ_HTTP_PORT="0")
    broker = BrokerProcess(broker_env, tmp_path / "broker.log").start()
    try:
        event = startup_line(broker.log_path)
        assert (event["protocol"], event["http"]) == (f"127.0.0.1:{broker.port}", "off")
        assert "metrics" not in event
    finally:
        assert broker.terminate() == 0


def test_the_start_up_line_hides_a_password_given_in_the_redis_urls_query(
    broker_env: dict[str, str], tmp_path: Path, redis_server: EmbeddedRedis
) -> None:
    """`?password=` (redis-py's form for unix sockets) is as secret as `:password@`."""
    password = urlsplit(redis_server.tcp_url).password
    assert password and redis_server.socket_path is not None
    url = f"unix://{redis_server.socket_path}?db=0&password={password}"
    broker_env.update(
        SKMQ_LOG_LEVEL="info", SKMQ_LOG_FORMAT="json", SKMQ_REDIS_URL=url,
        SKMQ_KEY_PREFIX=f"t{uuid.uuid4().hex[:10]}",
    )  # fmt: skip
    broker = BrokerProcess(broker_env, tmp_path / "broker.log").start()
    try:
        event = startup_line(broker.log_path)
        assert event["redis"] == f"unix://{redis_server.socket_path}?db=0&password=***"
        assert password not in broker.log_path.read_text()
    finally:
        assert broker.terminate() == 0
