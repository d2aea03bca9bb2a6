"""Tensor and pipeline parallelism: what each rank holds, and the layers that join the shards.

Megatron-style: q/k/v and gate/up are split by output features (whole heads; with GQA each rank
holds whole K/V head groups), o_proj and down_proj by input features with one all-reduce each,
the embedding and LM head by vocabulary rows. Pipeline stages hold runs of whole layers. Every
decision here is a pure function of the config and the rank, so every rank computes the same.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from models.config import ModelConfig
from models.quant_formats import QuantizedTensor, RowStack

if TYPE_CHECKING:
    from models.shm_comm import ShmCommunicator


@dataclass(frozen=True)
class Shard:
    """One rank of a tensor-parallel x pipeline-parallel group (global rank = pp_rank * tp_size + tp_rank)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError("tensor and pipeline parallel sizes must be >= 1")
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"rank ({self.tp_rank}, {self.pp_rank}) outside ({self.tp_size}, {self.pp_size})")

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, pp_size: int) -> Shard:
        return cls(rank % tp_size, tp_size, rank // tp_size, pp_size)

    def layers(self, num_layers: int) -> range:
        """This stage's run of layers (stages differ by at most one layer; earlier stages get the extra)."""
        start, stop = split(num_layers, self.pp_size)[self.pp_rank]
        return range(start, stop)


def split(n: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[0, n) cut into `parts` contiguous ranges of whole `unit`s, sizes differing by at most one unit."""
    units, rest = divmod(n // unit, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + (units + (i < rest)) * unit
        bounds.append((start, stop))
        start = stop
    return bounds


def feature_unit(n: int, parts: int) -> int:
    """The unit an input-feature split keeps whole: quantized weights' groups (256 for k-quants,
    32 for the rest) where `n` allows it, so a row-parallel matrix's codes split without requantizing."""
    return next((u for u in (256, 32) if n % u == 0 and n // u >= parts), 1)


@dataclass(frozen=True)
class HeadShard:
    q: tuple[int, int]  # query heads [start, stop)
    kv: tuple[int, int]  # K/V heads [start, stop)


def head_shards(num_heads: int, num_kv_heads: int, tp: int) -> tuple[HeadShard, ...]:
    """Heads per rank. K/V heads >= ranks: the K/V heads are split (unevenly where they do not divide:
    3 over 2 ranks is 2 + 1) and each rank takes their query groups whole. Fewer K/V heads than ranks
    (MQA): query heads are split evenly and each rank holds a copy of the one K/V head its queries read,
    as vLLM does."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp:
        return tuple(HeadShard((a * group, b * group), (a, b)) for a, b in split(num_kv_heads, tp))
    if tp % num_kv_heads or num_heads % tp:
        raise ValueError(f"tensor parallel size {tp} with {num_kv_heads} K/V heads (fewer than ranks) needs "
                         f"tp a multiple of the K/V heads and {num_heads} query heads a multiple of tp")
    return tuple(HeadShard((a, b), (a // group, a // group + 1)) for a, b in split(num_heads, tp))


def check(cfg: ModelConfig, shard: Shard) -> None:
    """Refuse what cannot be sharded, with the reason, before anything loads."""
    if shard.pp_size > cfg.num_layers:
        raise ValueError(f"pipeline parallel size {shard.pp_size} exceeds the model's {cfg.num_layers} layers")
    if shard.tp_size == 1:
        return
    head_shards(cfg.num_heads, cfg.num_kv_heads, shard.tp_size)
    if shard.tp_size > cfg.num_heads or shard.tp_size > cfg.intermediate_size or shard.tp_size > cfg.vocab_size:
        raise ValueError(f"tensor parallel size {shard.tp_size} exceeds the model's heads or features")
    if cfg.qk_norm == "all":
        raise ValueError("tensor parallelism of a model whose QK-norm spans every head (OLMo 2) is not supported: "
                         "each rank would need every head's sum of squares")


def shard_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The config a rank's modules are built from: its heads and MLP features (layers stay numbered
    as in the whole model; the vocabulary stays whole, since logits are gathered)."""
    check(cfg, shard)
    if shard.tp_size == 1:
        return cfg
    heads = head_shards(cfg.num_heads, cfg.num_kv_heads, shard.tp_size)[shard.tp_rank]
    a, b = split(cfg.intermediate_size, shard.tp_size, feature_unit(cfg.intermediate_size, shard.tp_size))[shard.tp_rank]
    return dataclasses.replace(cfg, num_heads=heads.q[1] - heads.q[0], num_kv_heads=heads.kv[1] - heads.kv[0],
                               intermediate_size=b - a)


def _rows(t, ranges: list[tuple[int, int]]):
    if isinstance(t, RowStack):  # NOTE: a fused matrix of mixed types stays a stack: QuantLinear runs it in parts
        return RowStack([piece for a, b in ranges for piece in t.pieces(a, b)])
    index = torch.cat([torch.arange(a, b) for a, b in ranges])
    if isinstance(t, QuantizedTensor):
        return t.select_rows(index)
    return t[index].clone()


def _cols(t, a: int, b: int):
    """Input features [a, b): a quantized matrix keeps its codes where the cut falls on its groups."""

    if isinstance(t, QuantizedTensor):
        g = t.group_size
        if a % g or b % g:  # NOTE: a cut inside a quantization group: that matrix is served dequantized
            return t.dequantize()[:, a:b].contiguous()
        offset = None if t.offset is None else t.offset[:, a // g:b // g].contiguous()
        return dataclasses.replace(t, q=t.q[:, a:b].contiguous(), scale=t.scale[:, a // g:b // g].contiguous(),
                                   offset=offset)
    return t[:, a:b].contiguous()


def shard_tensor(cfg: ModelConfig, shard: Shard, name: str, t):
    """This rank's part of internal tensor `name` (models/weights.py names), or None when it holds none."""
    layers = shard.layers(cfg.num_layers)
    if name.startswith("layers."):
        if int(name.split(".")[1]) not in layers:
            return None
    elif name.startswith(("embed.", "pos_embed.")) and layers.start != 0:
        return None  # NOTE: a tied table reaches the last stage as lm_head.weight, its own copy there
    elif name.startswith(("final_norm.", "lm_head.")) and layers.stop != cfg.num_layers:
        return None
    tp, r = shard.tp_size, shard.tp_rank
    if tp == 1:
        return t
    d, h, hkv, inter = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    heads = head_shards(h, hkv, tp)[r]
    (q0, q1), (k0, k1) = heads.q, heads.kv
    i0, i1 = split(inter, tp, feature_unit(inter, tp))[r]
    part = name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]
    if name in ("embed.weight", "lm_head.weight"):
        return _rows(t, [split(cfg.vocab_size, tp)[r]])
    if part.startswith("qkv_proj."):
        return _rows(t, [(q0 * d, q1 * d), ((h + k0) * d, (h + k1) * d), ((h + hkv + k0) * d, (h + hkv + k1) * d)])
    if part.startswith("gate_up_proj."):
        return _rows(t, [(i0, i1), (inter + i0, inter + i1)])
    if part.startswith("up_proj."):
        return _rows(t, [(i0, i1)])
    if name.endswith("attn.sinks"):
        return t[q0:q1].clone()
    if part in ("o_proj.weight", "down_proj.weight"):
        return _cols(t, q0 * d, q1 * d) if part == "o_proj.weight" else _cols(t, i0, i1)
    if part in ("o_proj.bias", "down_proj.bias"):
        return t if r == 0 else torch.zeros_like(t)  # NOTE: added once, by rank 0, before the all-reduce sums
    return t  # norms, positions: every rank holds them whole


class TensorParallelGroup:
    """The collectives of one tensor-parallel group: gloo on CPU, NCCL on GPU, or shared memory
    (models/shm_comm.py) where `shm` is given: all ranks on one machine, ~1.3 ms less per call."""

    def __init__(self, group: dist.ProcessGroup, size: int, rank: int, shm: ShmCommunicator | None = None) -> None:
        self.group, self.size, self.rank, self.shm = group, size, rank, shm

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shm is not None:
            return self.shm.all_reduce(x)  # NOTE: a new tensor: callers use the result, never x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Last-dim slices of `sizes` from every rank, concatenated (uneven slices padded for the transfer)."""
        width = max(sizes)
        if x.shape[-1] < width:
            x = nn.functional.pad(x, (0, width - x.shape[-1]))
        if self.shm is not None:
            parts = self.shm.all_gather(x).split(width, dim=-1)  # (..., size * width) -> size x (..., width)
            return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


class RowParallel(nn.Module):
    """A linear holding a slice of the input features: partial sums, then one all-reduce."""

    def __init__(self, inner: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner, self.tp = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the table: other ids read as zeros, and the all-reduce fills them in."""

    def __init__(self, inner: nn.Module, start: int, stop: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner, self.start, self.stop, self.tp = inner, start, stop, group

    @property
    def weight(self):
        return self.inner.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        local = torch.where(outside, 0, ids - self.start)
        x = self.inner(local).masked_fill(outside.unsqueeze(-1), 0)  # (T, C)
        return self.tp.all_reduce(x)


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered into the whole vocabulary on every rank."""

    def __init__(self, inner: nn.Module, sizes: list[int], group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner, self.sizes, self.tp = inner, sizes, group

    @property
    def weight(self):
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(self.inner(x), self.sizes)  # (N, V)


def parallelize(model: nn.Module, shard: Shard, group: TensorParallelGroup) -> None:
    """Join a loaded shard's modules with collectives (after its linears are packed)."""
    if shard.tp_size == 1:
        return
    cfg = model.config
    for layer in model.layers:
        layer.attn.o_proj = RowParallel(layer.attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    vocab = split(cfg.vocab_size, shard.tp_size)
    if model.embed is not None:
        model.embed = VocabParallelEmbedding(model.embed, *vocab[shard.tp_rank], group)
    if model.lm_head is not None:
        model.lm_head = ParallelLMHead(model.lm_head, [b - a for a, b in vocab], group)
