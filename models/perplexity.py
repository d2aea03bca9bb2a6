"""Perplexity of a text under a model, over a sliding window (the transformers recipe)."""
from __future__ import annotations

import math
from typing import Callable, Iterator, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from models.attention import AttentionFn
from models.transformer import DecoderLM

LOGIT_ROWS = 256  # rows of (rows, vocab) fp32 logits at a time: bounded memory for long windows


class Window(NamedTuple):
    """Tokens [begin, end) go through the model; tokens [first, end) are scored, each from all the
    tokens before it in the window (row r's hidden state predicts token r + 1)."""
    begin: int
    end: int
    first: int


def window_and_stride(window: int, stride: int, max_positions: int | None = None) -> tuple[int, int]:
    """The window and stride actually used. The window is capped at the model's positions (never past
    what it learned); the stride is capped at window - 1, so each window overlaps the previous one by at
    least one token and its first scored token has that as context. A stride >= window (given, or left
    after the window was capped, e.g. a 512-position model under the default 1024 / 512) would otherwise
    start a window exactly at the first unscored token (no context) or past it (tokens never scored)."""
    if window < 2 or stride < 1:
        raise ValueError(f"need window >= 2 and stride >= 1 (got window {window}, stride {stride})")
    if max_positions is not None:
        window = min(window, max_positions)
        if window < 2:
            raise ValueError(f"a model of {max_positions} positions cannot score a token with context")
    return window, min(stride, window - 1)


def windows(n: int, window: int, stride: int) -> Iterator[Window]:
    """The transformers perplexity recipe's windows over n tokens, with `window` and `stride` as
    window_and_stride gives them (stride < window): windows begin 0, stride, 2 * stride, ..., each
    `window` tokens (the last cut at the text's end), and each scores the tokens past the previous
    window's end. So every token but the first is scored exactly once; in every window but the first,
    the first scored token has window - stride tokens of context and the next ones one more each, up to
    window - 1 (as much as the window allows at this stride). Stops at the window that reaches the end."""
    if not 0 < stride < window:
        raise ValueError("need 0 < stride < window (see window_and_stride)")
    begin, scored = 0, 1  # token 0 is never predicted
    while scored < n:
        end = min(begin + window, n)
        yield Window(begin, end, scored)
        scored, begin = end, begin + stride


@torch.inference_mode()
def negative_log_likelihood(model: DecoderLM, token_ids: Sequence[int], window: int = 1024, stride: int = 512,
                            attention: Callable[[int], AttentionFn] | None = None) -> tuple[float, int]:
    """(summed NLL in nats, tokens scored) over every token but the first: n - 1 tokens for a text of n.
    Windows as `windows` lays them out after `window_and_stride(window, stride, max_position_embeddings)`.
    `attention(n)` gives the AttentionFn for a window of n tokens (default: dense, no cache)."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs a text of at least 2 tokens")
    window, stride = window_and_stride(window, stride, model.config.max_position_embeddings)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)
    total, count = 0.0, 0
    for w in windows(ids.numel(), window, stride):
        chunk = ids[w.begin:w.end]  # (L,)
        length = w.end - w.begin
        hidden = model(chunk, torch.arange(length, device=model.device),
                       attention(length) if attention else None)  # (L, C)
        # NOTE: the hidden state at row r predicts token r + 1; first > begin, so r0 >= 1
        for r0 in range(w.first - w.begin, length, LOGIT_ROWS):
            r1 = min(r0 + LOGIT_ROWS, length)
            logits = model.compute_logits(hidden[r0 - 1:r1 - 1])  # (k, V) fp32
            total += F.cross_entropy(logits, chunk[r0:r1], reduction="sum").item()
            count += r1 - r0
    assert count == ids.numel() - 1, (count, ids.numel())
    return total, count


def perplexity(model: DecoderLM, token_ids: Sequence[int], window: int = 1024, stride: int = 512,
               attention: Callable[[int], AttentionFn] | None = None) -> float:
    """exp(mean NLL) over every token but the first, each scored exactly once. Windows of `window`
    tokens (at most the model's max_position_embeddings) start `stride` apart (at most window - 1: see
    window_and_stride); each scores only the tokens the previous one did not, with the rest as context.
    `attention(n)` gives the AttentionFn for a window of n tokens (default: dense, no cache)."""
    total, count = negative_log_likelihood(model, token_ids, window, stride, attention)
    return math.exp(total / count)
