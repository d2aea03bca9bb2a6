"""What a served model's KV cache would cost as MHA, GQA or MQA: bytes per token and how many
requests its pool admits. Computed from the model's head counts alone (the "what-if" rows)."""
from __future__ import annotations

REFERENCE_SEQ_LEN = 1024  # tokens per request in "admitted requests"


def _gqa_heads(num_heads: int) -> int | None:
    """A GQA form for a model served as MHA or MQA: the largest group count below num_heads / 2."""
    return next((d for d in range(num_heads // 2, 1, -1) if num_heads % d == 0), None)


def kv_forms(num_heads: int, num_kv_heads: int, kv_bytes_per_token: int, pool_bytes: int, block_size: int,
             seq_len: int = REFERENCE_SEQ_LEN) -> list[dict]:
    """One row per form (mha, gqa, mqa); `what_if` unless it is the form served."""
    per_head = kv_bytes_per_token // num_kv_heads  # K and V of one head, all layers
    gqa = num_kv_heads if 1 < num_kv_heads < num_heads else _gqa_heads(num_heads)
    blocks_per_request = -(-seq_len // block_size)
    rows = []
    for attention, heads in (("mha", num_heads), ("gqa", gqa), ("mqa", 1)):
        if heads is None:
            continue
        bytes_per_token = per_head * heads
        blocks = pool_bytes // (bytes_per_token * block_size)
        rows.append({"attention": attention, "kv_heads": heads, "kv_bytes_per_token": bytes_per_token,
                     "admitted_requests": blocks // blocks_per_request, "what_if": heads != num_kv_heads})
    return rows
