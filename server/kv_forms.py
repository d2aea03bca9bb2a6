"""What a served model's KV cache costs: bytes one sequence holds against its length, and what the
model would cost as MHA, GQA or MQA (the "what-if" rows). No torch: the API layer imports it.

With sliding-window layers (models.config.ModelConfig.layer_windows) KV bytes per token is no
longer one number: a windowed layer keeps at most the blocks covering its window, so past the
window a sequence's bytes grow with its global layers only. `kv_bytes_at` is that curve, block
granular, equal to kvcache.storage.KVCacheSpec.bytes_for.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from kvcache.manager import cdiv, layer_blocks

REFERENCE_SEQ_LEN = 1024  # tokens per request in "admitted requests"
KV_CURVE_LENGTHS = (1024, 8192, 32768)  # where /v1/models, the metrics and `attnserve eval` give bytes per token


def kv_bytes_at(kv_bytes_per_token: int, layer_windows: Sequence[int | None], block_size: int,
                num_tokens: int) -> int:
    """KV bytes the pool holds for one sequence of `num_tokens` (between steps, block granular).

    `kv_bytes_per_token` is a token of every layer (ModelInfo.kv_bytes_per_token); `layer_windows`
    per layer a window in tokens or None (global), () for every layer global.
    """
    if num_tokens < 0 or block_size <= 0:
        raise ValueError("num_tokens must be >= 0 and block_size positive")
    if not layer_windows:
        return kv_bytes_per_token * block_size * cdiv(num_tokens, block_size)
    blocks = sum(layer_blocks(w, block_size, num_tokens) for w in layer_windows)  # layer-blocks
    return kv_bytes_per_token * block_size * blocks // len(layer_windows)


def kv_bytes_per_token_at(kv_bytes_per_token: int, layer_windows: Sequence[int | None], block_size: int,
                          num_tokens: int) -> float:
    """KV bytes per token of a sequence of `num_tokens`: kv_bytes_at / num_tokens. Flat for a global
    model (at multiples of the block size); past a window, windowed layers add less and less."""
    if num_tokens <= 0:
        raise ValueError("num_tokens must be positive")
    return kv_bytes_at(kv_bytes_per_token, layer_windows, block_size, num_tokens) / num_tokens


def kv_curve(kv_bytes_per_token: int, layer_windows: Sequence[int | None], block_size: int,
             lengths: Iterable[int] = KV_CURVE_LENGTHS) -> dict[str, float]:
    """{"1024": bytes per token at 1024 tokens, ...}: the JSON shape of `kv_bytes_per_token_at`."""
    return {str(n): kv_bytes_per_token_at(kv_bytes_per_token, layer_windows, block_size, n) for n in lengths}


def curve_lengths(block_size: int, max_len: int, per_octave: int = 4) -> list[int]:
    """Lengths to draw the curve at: multiples of the block size about 1/per_octave octave apart (so a
    global model's line is flat), every power of two from 16, and max_len."""
    out = {max_len}
    k = 0
    while (n := block_size * round(2 ** (k / per_octave))) <= max_len:
        out.add(n)
        k += 1
    p = 16
    while p <= max_len:
        out.add(p)
        p *= 2
    return sorted(out)


def _gqa_heads(num_heads: int) -> int | None:
    """A GQA form for a model served as MHA or MQA: the largest group count below num_heads / 2."""
    return next((d for d in range(num_heads // 2, 1, -1) if num_heads % d == 0), None)


def kv_forms(num_heads: int, num_kv_heads: int, kv_bytes_per_token: int, pool_bytes: int, block_size: int,
             seq_len: int = REFERENCE_SEQ_LEN, layer_windows: Sequence[int | None] = ()) -> list[dict]:
    """One row per form (mha, gqa, mqa); `what_if` unless it is the form served.

    Each row: `kv_bytes_per_token` (a token of every layer), `kv_bytes_per_token_at` (per token of a
    sequence of 1k / 8k / 32k tokens, block granular), `admitted_requests` (sequences of `seq_len`
    the pool admits at once) and `sliding_window` (whether the model's windows apply). A model with
    sliding-window layers keeps them in every form, and gets one more what-if row: its served heads
    with every layer global, what the windows save.
    """
    per_head = kv_bytes_per_token // num_kv_heads  # K and V of one head, all layers
    gqa = num_kv_heads if 1 < num_kv_heads < num_heads else _gqa_heads(num_heads)
    windowed = any(w is not None for w in layer_windows)
    forms = [(attention, heads, tuple(layer_windows) if windowed else ())
             for attention, heads in (("mha", num_heads), ("gqa", gqa), ("mqa", 1)) if heads is not None]
    if windowed:
        served = next(a for a, h, _ in forms if h == num_kv_heads)
        forms.append((served, num_kv_heads, ()))
    rows = []
    for attention, heads, windows in forms:
        bytes_per_token = per_head * heads
        # pool // (blocks one request holds x block bytes): a windowed layer's blocks cost as many
        # pool bytes as a global one's, so this is (pool blocks) // (blocks per request) for every layout
        per_request = kv_bytes_at(bytes_per_token, windows, block_size, seq_len)
        rows.append({"attention": attention, "kv_heads": heads, "kv_bytes_per_token": bytes_per_token,
                     "admitted_requests": pool_bytes // per_request,
                     "what_if": heads != num_kv_heads or bool(windowed and not windows),
                     "sliding_window": bool(windows),
                     "kv_bytes_per_token_at": kv_curve(bytes_per_token, windows, block_size)})
    return rows
