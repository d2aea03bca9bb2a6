"""All-reduce and all-gather over shared memory, for a tensor-parallel group whose ranks share a machine.

gloo's all-reduce of a decode step's (1, hidden) activations between two local processes takes
~1.3 ms (socket round trips), and a step makes two per layer. The ranks here instead meet in one
/dev/shm mapping (models/csrc/shm_comm.cpp), as vLLM's CPU backend does. Results are functional
(new tensors), summed in rank order in fp32: every rank gets the same bytes. The ops are opaque
custom ops to torch.compile.
"""
from __future__ import annotations

import logging
import uuid

import torch
import torch.distributed as dist

from models.native.libraries import load

logger = logging.getLogger(__name__)

_WORLD: dict[int, int] = {}  # handle -> world size: the fake all-gather's output shape

# the tensor ops' schemas are defined here, not in the C++, so their fake kernels exist before
# the library loads: a compiled graph holds them as opaque calls
_LIB = torch.library.Library("attnserve", "FRAGMENT")
_LIB.define("shm_all_reduce(Tensor x, int handle) -> Tensor")
_LIB.define("shm_all_gather(Tensor x, int handle) -> Tensor")


@torch.library.register_fake("attnserve::shm_all_reduce")
def _(x, handle):
    return x.new_empty(x.shape)


@torch.library.register_fake("attnserve::shm_all_gather")
def _(x, handle):
    return x.new_empty((*x.shape[:-1], _WORLD[handle] * x.shape[-1]))


def set_timeout(seconds: float) -> None:
    """How long a rank waits for its peers before its collective raises (default 120 s): a dead
    peer becomes an error, not a hang."""
    load("shm_comm")
    torch.ops.attnserve.shm_set_timeout(seconds)


class ShmCommunicator:
    """One rank's view of a group's mapping. Every rank must make the same calls in the same order,
    from one thread, with tensors of at most `max_bytes` (and, for all_gather, one shape on all)."""

    def __init__(self, name: str, rank: int, world_size: int, max_bytes: int, create: bool) -> None:
        load("shm_comm")
        self.name, self.rank, self.world_size, self.max_bytes = name, rank, world_size, max_bytes
        self.handle = torch.ops.attnserve.shm_open(name, rank, world_size, max_bytes, create)
        _WORLD[self.handle] = world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, a new tensor of x's shape and dtype (float32, bfloat16, float16)."""
        return torch.ops.attnserve.shm_all_reduce(x, self.handle)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dim: (..., world_size * last)."""
        return torch.ops.attnserve.shm_all_gather(x, self.handle)

    def stats(self) -> tuple[int, float]:
        """(collectives made, seconds spent in them): copies, waiting for the other ranks, sums."""
        calls, seconds = torch.ops.attnserve.shm_stats(self.handle)
        return calls, seconds

    def unlink(self) -> None:
        """Remove the name from /dev/shm (the mappings stay): once every rank has opened it."""
        torch.ops.attnserve.shm_unlink(self.name)

    @classmethod
    def over_group(cls, group: dist.ProcessGroup, max_bytes: int) -> ShmCommunicator | None:
        """A communicator for the ranks of `group` (collective: every rank calls it; they must share
        a machine). None on every rank where any rank cannot build the library or open the mapping:
        the caller keeps gloo, and the warning says why."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        comm, error = None, ""
        try:
            load("shm_comm")
            if rank == 0:
                comm = cls(f"attnserve-{uuid.uuid4().hex}", 0, world, max_bytes, create=True)
        except (RuntimeError, OSError) as e:
            error = str(e).splitlines()[0]
        name = [comm.name if comm is not None else None]
        dist.broadcast_object_list(name, group=group, group_src=0)
        if rank != 0 and name[0] is not None and not error:
            try:
                comm = cls(name[0], rank, world, max_bytes, create=False)
            except (RuntimeError, OSError) as e:
                error = str(e).splitlines()[0]
        errors: list[str | None] = [None] * world
        # NOTE: the barrier: every rank has opened the mapping (or failed) before rank 0 unlinks its
        # name, so nothing is left in /dev/shm however the processes end later
        dist.all_gather_object(errors, error, group=group)
        if rank == 0 and comm is not None:
            comm.unlink()
        failed = {r: e for r, e in enumerate(errors) if e}
        if failed:
            logger.warning("shared-memory collectives unavailable, using the process group's: %s", failed)
            return None
        return comm
