"""models/shm_comm.py: shared-memory all-reduce and all-gather between real processes.

Each test spawns its ranks (one torch thread each) joined by a gloo group, as shard workers are.
`python -m tests.test_shm_comm` prints the latency of both against gloo's (2 ranks, 1 thread each).
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import statistics
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytestmark = pytest.mark.kernel  # make test-isa runs this file again under the AVX2 cap and on the portable build

MAX_BYTES = 1 << 16  # 16 Ki float32 elements


def _worker(fn, rank: int, world: int, store: str, errors) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        fn(rank, world)
        dist.destroy_process_group()
        errors.put((rank, ""))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        errors.put((rank, traceback.format_exc()))


def run_ranks(fn, world: int, tmp_path: Path, timeout: float = 300) -> None:
    """Run fn(rank, world) in `world` spawned processes; fails with the first rank's traceback."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(fn, rank, world, str(tmp_path / "store"), errors))
             for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} hung"
    reports = dict(errors.get(timeout=10) for _ in procs)
    failed = {rank: tb for rank, tb in reports.items() if tb}
    assert not failed, "\n".join(f"rank {rank}:\n{tb}" for rank, tb in sorted(failed.items()))


def _setup(rank: int):
    from models.shm_comm import ShmCommunicator, set_timeout

    comm = ShmCommunicator.over_group(dist.group.WORLD, MAX_BYTES)
    assert comm is not None, "no shared-memory communicator (see the warning)"
    set_timeout(30.0)  # a broken test fails in seconds, not after the default 120
    dist.barrier()  # rank 0 has unlinked the name
    assert not Path("/dev/shm", comm.name).exists(), "rank 0 unlinks the name once all have opened it"
    return comm


def _inputs(call: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s input of call `call`: any rank can compute every rank's. Magnitudes from 1e-3 to
    1e3, so a sum in another order rounds differently."""
    g = torch.Generator().manual_seed(call * 64 + rank)
    scale = 10.0 ** torch.randint(-3, 4, (n,), generator=g)
    return (torch.randn(n, generator=g) * scale).to(dtype)


def _sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """Rank order, fp32, rounded once to the inputs' dtype."""
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype)


def _collectives(rank: int, world: int) -> None:
    from models.parallel import TensorParallelGroup

    comm = _setup(rank)
    digest = hashlib.sha256()

    def check(out: torch.Tensor, expected: torch.Tensor) -> None:
        assert out.dtype == expected.dtype and out.shape == expected.shape
        assert torch.equal(out, expected)
        digest.update(out.contiguous().view(torch.uint8).numpy().tobytes())

    for call, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        xs = [_inputs(call, r, 4096, dtype).view(8, 512) for r in range(world)]  # (T, C)
        mine = xs[rank].clone()
        check(comm.all_reduce(xs[rank]), _sum(xs))
        assert torch.equal(xs[rank], mine), "all_reduce leaves x as it was"
        xs = [x.view(2, 4, 512) for x in xs]  # (2, 4, C)
        check(comm.all_gather(xs[rank]), torch.cat(xs, dim=-1))

    # NOTE: back to back, sizes 1 to max_bytes, reduce and gather interleaved: a rank running ahead
    # into the next call's buffer while another still reads this one would show here
    g = torch.Generator().manual_seed(7)
    limit = MAX_BYTES // 4
    sizes = [1, limit, limit - 1, 2, *torch.randint(1, limit + 1, (996,), generator=g).tolist()]
    for call, n in enumerate(sizes, start=10):
        xs = [_inputs(call, r, n, torch.float32) for r in range(world)]
        if call % 3:
            check(comm.all_reduce(xs[rank]), _sum(xs))
        else:
            check(comm.all_gather(xs[rank][: n // world or 1]), torch.cat([x[: n // world or 1] for x in xs]))

    too_big = torch.zeros(limit + 1)
    with pytest.raises(RuntimeError, match=r"x has 65540 bytes, more than this communicator's max_bytes \(65536\)"):
        comm.all_reduce(too_big)
    with pytest.raises(RuntimeError, match="max_bytes"):
        comm.all_gather(too_big)
    xs = [_inputs(5, r, 100, torch.float32) for r in range(world)]
    check(comm.all_reduce(xs[rank]), _sum(xs))  # a refused call posted nothing: the group goes on

    tp = TensorParallelGroup(dist.group.WORLD, world, rank, shm=comm)
    sizes = [5, 4, 4][:world]  # uneven vocabulary slices: padded to 5 for the transfer, trimmed after
    xs = [_inputs(6, r, 3 * n, torch.float32).view(3, n) for r, n in enumerate(sizes)]  # (N, V / tp)
    check(tp.all_gather(xs[rank], sizes), torch.cat(xs, dim=-1))

    if world == 3:  # a subgroup, as a pipeline stage's: its rank 0 (global rank 1) names the mapping
        from models.shm_comm import ShmCommunicator

        stage = dist.new_group([1, 2])  # NOTE: collective: every rank creates it
        if rank > 0:
            pair = ShmCommunicator.over_group(stage, MAX_BYTES)
            xs = [_inputs(8, r, 100, torch.float32) for r in (1, 2)]
            check(pair.all_reduce(xs[rank - 1]), _sum(xs))
        else:
            digest.update(_sum([_inputs(8, r, 100, torch.float32) for r in (1, 2)]).numpy().tobytes())

    digests = [None] * world
    dist.all_gather_object(digests, digest.hexdigest())
    assert len(set(digests)) == 1, "every rank holds the same bytes"


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_match_the_rank_order_sum(world, tmp_path):
    run_ranks(_collectives, world, tmp_path)


def _dead_peer(rank: int, world: int) -> None:
    from models.shm_comm import set_timeout

    comm = _setup(rank)
    if rank == 1:
        return  # exits without making the call
    set_timeout(2.0)
    with pytest.raises(RuntimeError, match=r"rank\(s\) 1 of 2 did not arrive at call 1 within 2 s"):
        comm.all_reduce(torch.ones(4))


def test_a_dead_peer_is_an_error_not_a_hang(tmp_path):
    run_ranks(_dead_peer, 2, tmp_path)


def _no_compiler(rank: int, world: int) -> None:
    import os
    from unittest import mock

    from models.shm_comm import ShmCommunicator, logger

    os.environ.update(CXX="/nonexistent/g++", ATTNSERVE_CACHE_DIR="/nonexistent")  # nothing built, nothing to build
    with mock.patch.object(logger, "warning") as warning:
        assert ShmCommunicator.over_group(dist.group.WORLD, MAX_BYTES) is None
    assert "no C++ compiler" in str(warning.call_args)


@pytest.mark.fallback
def test_without_a_compiler_every_rank_keeps_gloo(tmp_path):
    run_ranks(_no_compiler, 2, tmp_path)


def _compiled(rank: int, world: int) -> None:
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    from models.parallel import TensorParallelGroup
    from server.engine.compilation import compile_model

    inductor_config.compile_threads = 1
    tp = TensorParallelGroup(dist.group.WORLD, world, rank, shm=_setup(rank))
    torch.manual_seed(rank)
    sizes = [5, 4]  # this rank's vocabulary slice: uneven, padded for the gather

    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # this rank's slice of the input features, and of the vocabulary
            self.linear, self.head = nn.Linear(16, 8), nn.Linear(16, sizes[rank])

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.relu(tp.all_reduce(self.linear(x))), tp.all_gather(self.head(x), sizes)

    step = Step()
    compiled = compile_model(step)  # NOTE: as the engine compiles a rank's step (the ISA cap's march included)
    with torch.no_grad():
        for n in (2, 5, 3):  # one graph: sizes 0 and 1 would get graphs of their own
            x = torch.randn(n, 16)
            torch.testing.assert_close(compiled(x), step(x))
    assert not counters["graph_break"]  # the ops sit in the graph


def test_compiled_collectives_match_eager(tmp_path):
    run_ranks(_compiled, 2, tmp_path)


def _latency(rank: int, world: int) -> None:
    from models.shm_comm import ShmCommunicator

    comm = ShmCommunicator.over_group(dist.group.WORLD, 256 * 576 * 4)
    for shape in ((1, 576), (8, 576), (256, 576)):
        x = torch.zeros(shape)  # NOTE: gloo sums in place: zeros stay zeros, call after call
        report = []
        for name, calls, op in (("shm", 5000, comm.all_reduce), ("gloo", 500, dist.all_reduce)):
            for _ in range(calls // 10):  # warm-up
                op(x)
            dist.barrier()
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                op(x)
                times.append(time.perf_counter() - start)
            report.append(f"{name} {statistics.median(times) * 1e6:.1f} us median, "
                          f"{statistics.mean(times) * 1e6:.1f} us mean")
        if rank == 0:
            print(f"all_reduce {shape} float32, {world} ranks: {'; '.join(report)}", flush=True)


if __name__ == "__main__":  # python -m tests.test_shm_comm: latency, shm vs gloo
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_latency, 2, Path(tmp))
