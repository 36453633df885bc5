"""The addresses the broker itself uses: its Redis (and Sentinels), the embedded server,
its own listening ports. A recipient may never be one of them, whatever
RECIPIENT_NETWORKS says: a push written to the broker's own Redis would be read as
Redis commands (docs/SECURITY.md)."""

from __future__ import annotations

import functools
import ipaddress
import socket
from urllib.parse import urlsplit

import structlog

log = structlog.get_logger("skmq.own_addresses")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@functools.lru_cache(maxsize=4096)
def is_local(ip: Address) -> bool:
    """Loopback, unspecified, or an address of one of this machine's interfaces (a
    socket can be bound to it): connecting there reaches this machine."""
    if ip.is_loopback or ip.is_unspecified:
        return True
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return is_local(ip.ipv4_mapped)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(ip), 0))
    except OSError:
        return False
    return True


def resolve(host: str) -> list[Address]:
    """IP addresses of host (an IP literal, `localhost`, or a name resolved once, at start)."""
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        log.warning("cannot resolve an address the broker uses", host=host, error=str(exc))
        return []
    return [ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in infos]


# Verdicts of used_by_broker kept (it is asked on every push); past this, forgotten.
MAX_VERDICTS = 4096


class OwnAddresses:
    def __init__(self) -> None:
        self._local_ports: set[int] = set()
        self._remote: set[tuple[Address, int]] = set()
        self._verdicts: dict[tuple[str, int], bool] = {}

    def add(self, host: str, port: int) -> None:
        self._verdicts.clear()
        for ip in resolve(host):
            if is_local(ip):
                self._local_ports.add(port)
            else:
                self._remote.add((ip, port))

    def add_redis_url(self, url: str) -> None:
        """Every TCP endpoint of REDIS_URL: `redis(s)://h:p`, `redis+sentinel://h1:p1,h2:p2`
        (and `redis+cluster://` in the same style)."""
        parsed = urlsplit(url)
        if parsed.scheme in ("unix", ""):
            return
        default = 26379 if parsed.scheme == "redis+sentinel" else 6379
        for part in parsed.netloc.rpartition("@")[2].split(","):
            if not part:
                continue
            host, sep, port = part.rpartition(":")
            if not sep or "]" in port:
                host, port = part, ""
            digits = port.isascii() and port.isdigit()
            self.add(host or "localhost", int(port) if digits else default)

    def used_by_broker(self, host: str, port: int) -> bool:
        """True when host:port is (or reaches) an address this broker uses itself."""
        verdict = self._verdicts.get((host, port))
        if verdict is None:
            if len(self._verdicts) >= MAX_VERDICTS:
                self._verdicts.clear()
            verdict = self._verdicts[host, port] = any(
                (ip, port) in self._remote or (port in self._local_ports and is_local(ip))
                for ip in resolve(host)
            )
        return verdict


def _plain(ip: Address) -> Address:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def same_host(registered: str, peer: str) -> bool:
    """True when a connection from address `peer` comes from the host a recipient
    registered (`localhost`: its loopback addresses). Another loopback address such as
    127.0.0.2 is another source, as it is for the kernel."""
    theirs = {_plain(ip) for ip in resolve(registered)}
    return any(_plain(ip) in theirs for ip in resolve(peer))
