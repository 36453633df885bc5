"""A local Redis Cluster on loopback, from the embedded `valkey-server` binary: 3 masters
(or any number), each with 0 or more replicas, on free ports. For tests, benchmarks and
trying `redis+cluster://` by hand:

    python -m skmq.embedded_cluster DIR [--masters 3] [--replicas 1]

prints the REDIS_URL and runs until interrupted. The slots are split evenly over the
masters (CLUSTER ADDSLOTSRANGE), the nodes meet, the replicas follow their masters;
`start` returns once every node reports `cluster_state:ok`."""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import redis

from skmq.embedded import (
    SERVER_ARGS,
    _die_with_parent,
    _wait_port,
    free_port,
    server_binary,
    server_env,
)

SLOTS = 16384
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
BUS_OFFSET = 10000  # a node's cluster bus listens on its port + 10000


def _node_signals() -> None:
    """In a node, before it runs: the stop signals that `main` blocks (to sigwait for
    them) unblocked again, else a node never stops on SIGTERM (stop() waited 10 s a node
    and then killed it), and SIGTERM once its parent dies."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    _die_with_parent()


def _free_cluster_port(host: str, taken: set[int]) -> int:
    """A free port whose cluster bus port is free too."""
    for _ in range(200):
        port = free_port(host)
        if port + BUS_OFFSET > 65535 or port in taken:
            continue
        with contextlib.suppress(OSError), socket.socket() as sock:
            sock.bind((host, port + BUS_OFFSET))
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _until(check: Callable[[], object], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError):
            if check():
                return
        time.sleep(0.05)
    raise RuntimeError(f"local cluster: {what} not within {timeout}s")


@dataclass
class LocalCluster:
    data_dir: Path
    masters: int = 3
    replicas: int = 0  # replicas of each master
    host: str = "127.0.0.1"
    node_timeout_ms: int = 2000  # how soon a replica takes over a dead master
    ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{self.host}:{p}" for p in self.ports)

    @property
    def master_ports(self) -> list[int]:
        return self.ports[: self.masters]

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(self.host, port, socket_timeout=5.0)

    def launch(self, port: int) -> None:
        """Start (or restart, after `kill`) the node on `port`."""
        node_dir = self.data_dir / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        args = [
            str(server_binary()),
            "--bind",
            self.host,
            "--port",
            str(port),
            "--dir",
            str(node_dir.resolve()),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
            # (the masters of the other slots serve while one master is down and not yet
            # replaced: docs/OPERATIONS.md, Redis Cluster)
            "--cluster-require-full-coverage",
            "no",
            *SERVER_ARGS,
            "--logfile",
            "server.log",
        ]  # fmt: skip (in --dir)
        self.procs[port] = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=server_env(),
            preexec_fn=_node_signals,
        )
        _wait_port(self.host, port, self.procs[port], 10.0)

    def start(self, timeout: float = 30.0) -> LocalCluster:
        taken: set[int] = set()
        for _ in range(self.masters * (1 + self.replicas)):
            port = _free_cluster_port(self.host, taken)
            taken |= {port, port + BUS_OFFSET}
            self.ports.append(port)
            self.launch(port)
        clients = {port: self.client(port) for port in self.ports}
        try:
            self._form(clients, timeout)
        finally:
            for c in clients.values():
                c.close()
        return self

    def _form(self, clients: dict[int, redis.Redis], timeout: float) -> None:
        per = SLOTS // self.masters
        for i, port in enumerate(self.master_ports):
            last = SLOTS - 1 if i == self.masters - 1 else (i + 1) * per - 1
            clients[port].execute_command("CLUSTER ADDSLOTSRANGE", i * per, last)
        first = self.ports[0]
        for port in self.ports[1:]:
            clients[port].execute_command("CLUSTER MEET", self.host, first)

        def all_met() -> bool:
            return all(
                len(c.execute_command("CLUSTER NODES")) == len(self.ports) for c in clients.values()
            )

        _until(all_met, "nodes meeting", timeout)
        ids = {p: clients[p].execute_command("CLUSTER MYID") for p in self.master_ports}
        for n, port in enumerate(self.ports[self.masters :]):
            master = self.master_ports[n % self.masters]
            replica, master_id = clients[port], ids[master]
            _until(
                partial(replica.execute_command, "CLUSTER REPLICATE", master_id),
                "a replica following its master",
                timeout,
            )

        def ok() -> bool:
            return all(
                c.execute_command("CLUSTER INFO").get("cluster_state") == "ok"
                for c in clients.values()
            )

        _until(ok, "cluster_state:ok", timeout)

        def replicas_online() -> bool:
            return all(
                str(clients[p].info("replication").get("slave0", {})).count("online")
                for p in self.master_ports
            )

        if self.replicas:
            _until(replicas_online, "replicas in sync", timeout)

    def kill(self, port: int) -> None:
        """kill -9 one node (a master: its replica takes over after node_timeout_ms)."""
        proc = self.procs[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--masters", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=0)
    args = parser.parse_args(argv)
    cluster = LocalCluster(args.data_dir, args.masters, args.replicas)
    try:
        cluster.start()
    except (RuntimeError, OSError) as exc:
        cluster.stop()
        sys.stderr.write(f"local cluster failed: {exc}\n")
        return 1
    sys.stdout.write(cluster.url + "\n")
    sys.stdout.flush()
    try:
        signal.sigwait(STOP_SIGNALS)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    sys.exit(main())
