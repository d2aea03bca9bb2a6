"""Errors the engine raises for bad requests; the HTTP layer maps them to 4xx bodies."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine can never serve as asked; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
