"""The LoRA adapters an engine holds: read and checked on demand, installed into the replica's slots
(models/lora.py), the least recently used unpinned one evicted for room, drained on unload.

Every live request of an adapter (waiting, running or preempted) pins it: a pinned adapter never loses
its slot, so the rows of a request keep their delta from its first step to its last. An adapter that
finds every slot pinned waits, checked, for one; its requests are not ready meanwhile (Request.is_ready)
and the scheduler passes over them. A load is never refused for want of a slot.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from models.lora import LoraSlots
from models.lora_format import AdapterError, AdapterSpec, LoraShapes, cache_salt, check_adapter, read_adapter
from server.engine.request import Request
from server.wire import LoraRef


def adapter_ref(name: str, path: str, parent: str = "") -> LoraRef:
    """A LoraRef for the adapter at `path`, salted by its digest (offline use: the CLI, the tests)."""
    return LoraRef(name, parent, str(path), cache_salt(read_adapter(str(path)).digest))


@dataclass(eq=False)
class Adapter:
    """One adapter the engine knows: in a slot, or checked and waiting for one."""

    ref: LoraRef
    spec: AdapterSpec
    slot: int | None = None
    requests: set[Request] = field(default_factory=set)  # its live requests: they pin it
    draining: bool = False  # unloaded: it takes no new request, and leaves once its requests finish
    seconds: float = 0.0  # reading and checking it, then installing it


class LoraManager:
    """Adapters by (name, salt), least recently used first: a name loaded again with other weights is
    another adapter (its KV never matches the old one's), and the old one drains."""

    def __init__(self, slots: LoraSlots) -> None:
        self.slots = slots
        self.adapters: OrderedDict[tuple[str, bytes], Adapter] = OrderedDict()
        self.num_loads = self.num_evictions = 0  # installed into a slot; gone from one (for room, or unloaded)
        self.load_seconds = 0.0  # the loads' time, in total

    @property
    def shapes(self) -> LoraShapes:
        return self.slots.shapes

    def load(self, ref: LoraRef) -> float:
        """Make `ref` resident, or waiting for a slot when every slot is pinned; returns the seconds it took
        (0 for one already known). Raises AdapterError for an adapter that cannot be served."""
        key = (ref.name, ref.salt)
        adapter = self.adapters.get(key)
        new = adapter is None
        if new:
            start = time.perf_counter()
            spec = read_adapter(ref.path)
            check_adapter(spec, self.shapes)
            # NOTE: the salt keys its KV blocks: weights that changed on disk since the ref was made would
            # match the old weights' blocks
            if cache_salt(spec.digest) != ref.salt:
                raise AdapterError(f"adapter {ref.name!r} at {ref.path} changed since it was registered; "
                                   "load it again", 409)
            adapter = self.adapters[key] = Adapter(ref, spec, seconds=time.perf_counter() - start)
        else:
            adapter.draining = False  # NOTE: loaded again before it drained: it stays, slot and all
            self.adapters.move_to_end(key)
        # NOTE: one name, one adapter taking requests: the name's other weights finish what they have
        for other in [a for a in self.adapters.values() if a.ref.name == ref.name and a is not adapter]:
            self._drain(other)
        self._place()
        return adapter.seconds if new else 0.0

    def acquire(self, ref: LoraRef, requests: list[Request]) -> None:
        """Pin `ref` for `requests` (a group's samples), loading it if it is not resident, and set their
        adapter and slot (None while it waits for one)."""
        adapter = self.adapters.get((ref.name, ref.salt))
        if adapter is not None and adapter.draining:
            raise AdapterError(f"the LoRA adapter {ref.name!r} is being unloaded", 404, "model")
        self.load(ref)
        adapter = self.adapters[ref.name, ref.salt]
        adapter.requests.update(requests)
        for req in requests:
            req.lora, req.lora_slot = ref, adapter.slot
            req.stats.lora = ref.name

    def release(self, req: Request) -> None:
        """A request of an adapter finished (not preempted: a preempted request still pins it)."""
        # NOTE: a pinned adapter is never evicted, and a draining one leaves only once unpinned: it is here
        adapter = self.adapters[req.lora.name, req.lora.salt]
        adapter.requests.discard(req)
        if adapter.requests:
            return
        # NOTE: one that never got a slot is forgotten with its last request, not installed for nobody later
        if adapter.draining or adapter.slot is None:
            self._drop(adapter)
        self._place()

    def unload(self, name: str) -> bool:
        """Drain every adapter named `name`: new requests for it are refused, those in flight finish, then
        its slot is cleared. False when no such adapter is loaded."""
        found = [a for a in self.adapters.values() if a.ref.name == name and not a.draining]
        for adapter in found:
            self._drain(adapter)
        self._place()
        return bool(found)

    def _drain(self, adapter: Adapter) -> None:
        adapter.draining = True
        if not adapter.requests:
            self._drop(adapter)

    def resident(self) -> tuple[str, ...]:
        """The names of the adapters in a slot, least recently used first."""
        return tuple(dict.fromkeys(a.ref.name for a in self.adapters.values() if a.slot is not None))

    def _place(self) -> None:
        """Slots for the adapters that wait for one: those with requests first, then the rest (loaded with
        no request yet), each in least recently used order."""
        waiting = sorted((a for a in self.adapters.values() if a.slot is None), key=lambda a: not a.requests)
        for adapter in waiting:
            slot = self._free_slot()
            if slot is None:
                return
            start = time.perf_counter()
            self.slots.install(slot, adapter.spec)
            adapter.slot = slot
            adapter.seconds += time.perf_counter() - start
            self.num_loads += 1
            self.load_seconds += adapter.seconds
            for req in adapter.requests:
                req.lora_slot = slot

    def _free_slot(self) -> int | None:
        """A slot no adapter holds, else the slot of the least recently used unpinned adapter, evicted;
        None when every slot is pinned."""
        held = {a.slot for a in self.adapters.values() if a.slot is not None}
        free = next((s for s in range(self.shapes.max_loras) if s not in held), None)
        if free is not None:
            return free
        victim = next((a for a in self.adapters.values() if a.slot is not None and not a.requests), None)
        if victim is None:
            return None
        self._drop(victim, clear=False)  # NOTE: install clears the slot it fills
        return victim.slot

    def _drop(self, adapter: Adapter, clear: bool = True) -> None:
        """Forget an unpinned adapter, and take it out of its slot."""
        del self.adapters[adapter.ref.name, adapter.ref.salt]
        if adapter.slot is not None:
            if clear:
                self.slots.clear(adapter.slot)
            self.num_evictions += 1
