"""The values the decoder produces."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Frame", "InvalidFrame"]


@dataclass(slots=True)
class Frame:
    """One decoded frame.

    ``type`` is the value of the ``type=`` field, ``"ping"``/``"pong"`` for the bare
    heartbeat frames, and ``""`` when the frame has no type field. ``fields`` holds
    every other ``key=value`` line except ``type``, ``length`` and ``content`` (values
    decoded as UTF-8 with ``surrogateescape``, so re-encoding them gives back the
    original bytes; a later duplicate key overwrites an earlier one). ``content`` is
    the raw content, ``None`` when the frame had no content line.
    """

    type: str
    fields: dict[str, str]
    content: bytes | None = None

    def get(self, key: str, default: str | None = None) -> str | None:
        """Shortcut for ``self.fields.get(key, default)``."""
        return self.fields.get(key, default)


@dataclass(slots=True)
class InvalidFrame:
    """A malformed frame that was consumed; the stream goes on with the next frame.

    ``fields`` holds every ``key=value`` line parsed in the frame (``type`` included,
    ``length`` and ``content`` excluded), so the server can echo the msgid in its
    error answer.
    """

    reason: str
    fields: dict[str, str]
