"""The HTTP gateway (docs/HTTP.md): produce over HTTP, /metrics, /healthz, /openapi.json."""

from skmq.http.gateway import Gateway

__all__ = ["Gateway"]
