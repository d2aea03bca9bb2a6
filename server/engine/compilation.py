"""torch.compile (inductor) of the model step, so norms, RoPE, SwiGLU and residual adds fuse.

One graph with dynamic sizes serves every step (any token count, any number of sequences,
any block-table width): duck sizing and 0/1 specialisation are off, so batch-1 decode and a
1024-token prefill share it. Paged attention and packed linears are opaque custom ops inside
it. Compiled artifacts go to the attnserve cache (`inductor/<level>-<torch's capability>-<CPU
flags hash>/`), so a restart loads them instead of compiling again, and a cache shared with
another kind of CPU never hands this one code it cannot run; the engine warms the graph up while
it starts, never during a request.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from models.native.cache import cache_dir
from models.native.cpu_features import apply_isa_cap, capped_march, machine_isa, read_cpu_features

RECOMPILE_LIMIT = 64  # one process may compile several models (tests do); each is one entry


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (warm-up must leave none to do later)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415 - inductor's modules load only where a step compiles

    return int(counters["stats"]["unique_graphs"])


def inductor_cache_dir() -> Path:
    """Where this CPU's compiled steps live: named by the ISA level chosen, the level torch's own
    kernels run at, and the CPU's flags.

    Measured: inductor's cache keys miss torch's own capability. A process whose torch
    started before ATTNSERVE_CPU_ISA could cap it, sharing a directory with capped processes,
    loaded their artifacts and produced garbage (or a double free), and vice versa."""
    features = read_cpu_features()
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return cache_dir() / "inductor" / f"{machine_isa()}-{capability}-{features.key}"


def compile_model(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # noqa: PLC0415 - inductor's modules load only where a step compiles

    # NOTE: inductor fills in its /tmp default on first use (loading an HF model does), so only
    # a directory someone chose on purpose is kept
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
    import torch._dynamo.config as dynamo_config  # noqa: PLC0415 - inductor's modules load only where a step compiles
    import torch._inductor.config as inductor_config  # noqa: PLC0415 - inductor's modules load only where a step compiles
    import torch.fx.experimental._config as fx_config  # noqa: PLC0415 - inductor's modules load only where a step compiles

    # NOTE: below the CPU's own level, generated code must not use what the cap takes away: its
    # vector ISA follows ATEN_CPU_CAPABILITY (read here, even where torch's kernels started uncapped)
    inductor_config.cpp.march = capped_march(apply_isa_cap(), read_cpu_features())

    # process-wide flags; they shape only how our model's graph is specialised
    fx_config.use_duck_shape = False  # sizes that happen to be equal must not be assumed equal
    fx_config.backed_size_oblivious = True  # a size of 1 (batch-1 decode) is not a special case
    dynamo_config.specialize_float = True  # float attributes (norm eps) are constants, not inputs
    inductor_config.emulate_precision_casts = True  # round bf16 intermediates as eager does: same tokens
    inductor_config.cpp.dynamic_threads = True  # kernels follow the engine thread's torch.set_num_threads
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(model, dynamic=True, options={"guard_filter_fn": _skip_module_structure_guards})


# Guards that re-check the module tree's structure on every call: its hooks dicts stay empty and
# its attributes keep their types; and every input's "marked dynamic" dims, which nothing here
# marks after compiling. Shape, dtype and value guards (parameters, config constants such as eps
# or head counts) stay, so a different model never reuses another's graph.
_STRUCTURE_GUARDS = frozenset({"EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT", "TYPE_MATCH"})


def _skip_module_structure_guards(entries) -> list[bool]:
    return [not ((e.orig_guard.source.is_unspecialized_nn_module() and e.guard_type in _STRUCTURE_GUARDS)
                 or e.guard_type == "DIMENSION_DYNAMIC_MARKING_GUARD")
            for e in entries]

