"""Perplexity of a text under a model, over a sliding window (the transformers recipe)."""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from models.attention import AttentionFn
from models.transformer import DecoderLM

LOGIT_ROWS = 256  # rows of (rows, vocab) fp32 logits at a time: bounded memory for long windows


@torch.inference_mode()
def perplexity(model: DecoderLM, token_ids: Sequence[int], window: int = 1024, stride: int = 512,
               attention: Callable[[int], AttentionFn] | None = None) -> float:
    """exp(mean NLL) over every token but the first. Windows of `window` tokens start `stride`
    apart; each scores only the tokens the previous one did not, with the rest as context.
    `attention(n)` gives the AttentionFn for a window of n tokens (default: dense, no cache)."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs a text of at least 2 tokens")
    if not 0 < stride <= window:
        raise ValueError("need 0 < stride <= window")
    window = min(window, model.config.max_position_embeddings)  # NOTE: never past the positions it learned
    stride = min(stride, window)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)
    n, begin, scored = ids.numel(), 0, 1  # token 0 is never predicted
    total, count = 0.0, 0
    while scored < n:
        end = min(begin + window, n)
        chunk = ids[begin:end]  # (L,)
        hidden = model(chunk, torch.arange(end - begin, device=model.device),
                       attention(end - begin) if attention else None)  # (L, C)
        # NOTE: the hidden state at row r predicts token r + 1
        for r0 in range(scored - begin, end - begin, LOGIT_ROWS):
            r1 = min(r0 + LOGIT_ROWS, end - begin)
            logits = model.compute_logits(hidden[r0 - 1:r1 - 1])  # (k, V) fp32
            total += F.cross_entropy(logits, chunk[r0:r1], reduction="sum").item()
            count += r1 - r0
        scored, begin = end, begin + stride
    return math.exp(total / count)
