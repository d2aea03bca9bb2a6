"""Stored responses (`store: true`) for `previous_response_id`, GET and DELETE: a bounded map whose
entries expire. Every replica of an application must see the same store, so under Ray Serve
`ResponseStore` runs as one named actor per application (server/deployment.py); without Ray the
API layer holds one in this process. No Ray, no torch here."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class StoreConfig:
    """`max_responses`: the most kept at once (the oldest goes first); `ttl_s`: how long one is kept."""

    max_responses: int = 1024
    ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_responses < 1:
            raise ValueError("responses_store_size must be >= 1")
        if not self.ttl_s > 0:
            raise ValueError("responses_store_ttl_s must be positive")


class ResponseStore:
    """response id -> its record (a JSON-able dict). Records are kept in the order they were stored,
    so eviction by size and by age both take from the front."""

    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self._records: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()  # id -> (stored at, record)

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        self._expire()
        self._records.pop(response_id, None)
        self._records[response_id] = (self.clock(), record)
        while len(self._records) > self.config.max_responses:
            self._records.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any] | None:
        """None: never stored, deleted, evicted or expired."""
        self._expire()
        entry = self._records.get(response_id)
        return None if entry is None else entry[1]

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._records.pop(response_id, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self._records)

    def _expire(self) -> None:
        oldest = self.clock() - self.config.ttl_s
        while self._records and next(iter(self._records.values()))[0] <= oldest:
            self._records.popitem(last=False)


class StoreClient(ABC):
    """What the API layer calls: a store in this process, or the application's actor."""

    @abstractmethod
    async def put(self, response_id: str, record: dict[str, Any]) -> None: ...

    @abstractmethod
    async def get(self, response_id: str) -> dict[str, Any] | None: ...

    @abstractmethod
    async def delete(self, response_id: str) -> bool: ...


class LocalStore(StoreClient):
    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        self.store.put(response_id, record)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        return self.store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)
