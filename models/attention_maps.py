"""Attention weights of one prompt, per layer: softmax(Q K^T / sqrt(d_k) + M), from the
written-out formula (`reference_attention`), for heatmaps. Slow on purpose: it is the oracle."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from models.attention import AttentionVariant, reference_attention
from models.transformer import DecoderLM

MAX_WEIGHTS = 2**24  # layers x heads x T^2 per call (64 MiB of fp32): all 30 layers of a 9-head model to ~250 tokens


@dataclass
class CaptureWeights:
    """An AttentionFn for one causal sequence that keeps the weights of the chosen layers."""

    layers: frozenset[int]
    weights: dict[int, torch.Tensor] = field(default_factory=dict)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 variant: AttentionVariant | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        qh = q.transpose(0, 1).float()  # (H, T, D)
        kh, vh = k.transpose(0, 1).float(), v.transpose(0, 1).float()  # (Hkv, T, D)
        # (H, T, D), (H, T, T): query head j reads K/V head j // group; windows and sinks applied
        out, w = reference_attention(qh, kh, vh, variant=variant, sinks=sinks)
        if layer_idx in self.layers:
            self.weights[layer_idx] = w
        return out.transpose(0, 1).to(q.dtype)  # (T, H, D)


@torch.inference_mode()
def attention_weights(model: DecoderLM, token_ids: Sequence[int],
                      layers: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
    """Layer -> (heads, T, T) fp32 weights (rows sum to 1, zero above the diagonal)."""
    num_layers = model.config.num_layers
    chosen = list(range(num_layers)) if layers is None else list(layers)
    bad = [i for i in chosen if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layer indices {bad} out of range: the model has {num_layers} layers")
    if not token_ids:
        raise ValueError("the prompt has no tokens")
    size = len(chosen) * model.config.num_heads * len(token_ids) ** 2
    if size > MAX_WEIGHTS:  # NOTE: checked before computing: the answer must fit in memory and in JSON
        raise ValueError(f"{len(chosen)} layers x {model.config.num_heads} heads x {len(token_ids)}^2 tokens is "
                         f"{size} weights, over {MAX_WEIGHTS}: ask for fewer layers or a shorter prompt")
    capture = CaptureWeights(frozenset(chosen))
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)  # (T,)
    model(ids, torch.arange(ids.numel(), device=model.device), capture)
    return {i: capture.weights[i] for i in chosen}
