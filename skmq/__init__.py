"""SKMQ: a push-delivery message broker on asyncio and Redis."""

__version__ = "0.1.0"
