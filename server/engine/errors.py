"""Every error the engine side raises on purpose; the HTTP layer maps them to status codes."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine can never serve as asked (HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full; retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine process is gone; the replica must be restarted (HTTP 503)."""
