"""The served LoRA adapters: name -> LoraRef, one map per application.

An adapter is checked once, when it is registered (`--lora-modules` at start, or
POST /v1/load_lora_adapter), against its parent model's `ModelInfo.lora`; replicas then load it on
demand. `AdapterRegistry` is the map itself: in-process for a server with one HTTP replica, and the
state of a detached named actor under Ray Serve (server/deployment.py), which every ingress replica
reads through `Adapters`.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

from models.lora_format import AdapterError, cache_salt, check_adapter, read_adapter
from server.wire import LoraRef, ModelInfo

REFRESH_S = 1.0  # an ingress's copy of the actor's map is at most this old (an unload lags by up to this)


def checked_ref(name: str, parent: str, path: str, info: ModelInfo) -> LoraRef:
    """The adapter at `path`, checked against `parent` as served; AdapterError (its 4xx) if it cannot be."""
    if info.lora is None:
        raise AdapterError(f"model {parent!r} has no LoRA slots: serve it with --max-loras N", 400, "base_model")
    spec = read_adapter(path)
    check_adapter(spec, info.lora)
    return LoraRef(name, parent, path, cache_salt(spec.digest))


class AdapterRegistry:
    """name -> LoraRef with a version that changes on every add and remove."""

    def __init__(self) -> None:
        self.refs: dict[str, LoraRef] = {}
        self.version = 0

    def add(self, ref: LoraRef) -> bool:
        """False: the name is taken (nothing changes)."""
        if ref.name in self.refs:
            return False
        self.refs[ref.name] = ref
        self.version += 1
        return True

    def remove(self, name: str) -> LoraRef | None:
        ref = self.refs.pop(name, None)
        if ref is not None:
            self.version += 1
        return ref

    def state(self, known: int = -1) -> tuple[int, dict[str, LoraRef] | None]:
        """(version, the map), the map None when it is still version `known`."""
        return self.version, None if known == self.version else dict(self.refs)


class Adapters(ABC):
    """What the API reads and changes: the application's registry, wherever it lives."""

    @abstractmethod
    async def get(self, name: str) -> LoraRef | None: ...

    @abstractmethod
    async def all(self) -> dict[str, LoraRef]: ...

    @abstractmethod
    async def add(self, ref: LoraRef) -> bool:
        """False: the name is taken."""

    @abstractmethod
    async def remove(self, name: str) -> LoraRef | None: ...


class LocalAdapters(Adapters):
    def __init__(self, registry: AdapterRegistry | None = None) -> None:
        self.registry = registry or AdapterRegistry()

    async def get(self, name: str) -> LoraRef | None:
        return self.registry.refs.get(name)

    async def all(self) -> dict[str, LoraRef]:
        return dict(self.registry.refs)

    async def add(self, ref: LoraRef) -> bool:
        return self.registry.add(ref)

    async def remove(self, name: str) -> LoraRef | None:
        return self.registry.remove(name)


class RemoteAdapters(Adapters):
    """The registry in a Ray actor (`actor`: AdapterRegistry's methods as remote calls), with a copy
    here that is refreshed when older than REFRESH_S, and at once before a name is called unknown.

    NOTE: another ingress replica's unload reaches this copy within REFRESH_S: a request in that
    second may still start on the adapter (and finishes normally)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.version, self.refs, self.fetched = -1, {}, float("-inf")

    async def _refresh(self) -> None:
        version, refs = await self.actor.state.remote(self.version)
        if refs is not None:
            self.version, self.refs = version, refs
        self.fetched = time.monotonic()

    async def get(self, name: str) -> LoraRef | None:
        if name not in self.refs or time.monotonic() - self.fetched > REFRESH_S:
            await self._refresh()
        return self.refs.get(name)

    async def all(self) -> dict[str, LoraRef]:
        if time.monotonic() - self.fetched > REFRESH_S:
            await self._refresh()
        return dict(self.refs)

    async def add(self, ref: LoraRef) -> bool:
        added = await self.actor.add.remote(ref)
        await self._refresh()
        return added

    async def remove(self, name: str) -> LoraRef | None:
        ref = await self.actor.remove.remote(name)
        await self._refresh()
        return ref
