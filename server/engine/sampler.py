"""Sampling as pure functions over a (B, V) logits batch: penalties, filters, draws, logprobs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from models.native.libraries import available, load, native_enabled
from server.engine.sampling_params import SamplingParams
from server.wire import TokenLogprob


@dataclass(frozen=True)
class SamplingBatch:
    """The sampling side of one step: one row per request that samples."""

    params: tuple[SamplingParams, ...]
    generators: tuple[torch.Generator | None, ...]
    prompt_token_ids: tuple[Sequence[int], ...]
    output_token_ids: tuple[Sequence[int], ...]


def _counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(B, V) occurrence counts of each token id per row."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    for i, ids in enumerate(token_lists):
        if ids:
            idx = torch.tensor(ids, device=device)
            counts[i].index_add_(0, idx, torch.ones(len(ids), device=device))
    return counts


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (CTRL: divide positive, multiply negative logits of seen tokens, prompt included),
    then frequency (minus count in output) and presence (minus once if in output) penalties."""
    if not any(p.has_penalties for p in batch.params):
        return logits
    vocab, dev = logits.shape[1], logits.device
    out_counts = _counts(batch.output_token_ids, vocab, dev)
    rep = torch.tensor([p.repetition_penalty for p in batch.params], device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in batch.params], device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in batch.params], device=dev)[:, None]
    seen = (_counts(batch.prompt_token_ids, vocab, dev) + out_counts) > 0
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - freq * out_counts - pres * (out_counts > 0).float()


def apply_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks (rows of greedy requests untouched)."""
    if all(p.greedy for p in params):
        return logits  # argmax needs neither temperature nor filters
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device)
    logits = logits / temps[:, None]
    if not any(p.has_filters for p in params):
        return logits
    vocab = logits.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    min_p = torch.tensor([p.min_p for p in params], device=logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]  # keep the smallest set reaching top_p
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def draw(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One token per row: argmax for greedy rows, else an inverse-CDF draw.

    Each row needs one uniform number; a seeded request takes it from its own generator,
    so its samples do not depend on batch neighbours. (An exponential race draws a random
    number and a log per vocabulary entry: 2.4x the cost, 11% of a serving step at 16 users.)
    """
    greedy = torch.tensor([p.greedy for p in batch.params], device=logits.device)
    if bool(greedy.all()):
        return logits.argmax(-1)
    cdf = logits.softmax(-1).cumsum(-1)  # (B, V)
    uniform = torch.rand(len(batch.params))
    for i, g in enumerate(batch.generators):
        if g is not None and not batch.params[i].greedy:
            uniform[i] = torch.rand((), generator=g)
    total = cdf[:, -1:]  # (B, 1)
    # NOTE: target < total strictly, so the first cdf entry above it is a token with mass:
    # a filtered (zero-probability) token never rises above its predecessor
    target = torch.minimum(uniform.to(logits.device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(1)  # (B,)
    # NOTE: a row with no mass (every token masked: a grammar with no way on) has a NaN cdf, and
    # searchsorted then answers V, a token the model does not have: such a row takes its argmax instead,
    # which the grammar rejects, ending the sequence (OutputProcessor) rather than failing the step
    fallback = greedy | ~(total.squeeze(1) > 0)
    if not bool(fallback.any()):
        return sampled
    return torch.where(fallback, logits.argmax(-1), sampled)


def token_logprobs(raw_logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]) -> list[TokenLogprob | None]:
    """Log-probabilities under the model's own distribution (before penalties and temperature)."""
    want = [p.logprobs is not None for p in params]
    if not any(want):
        return [None] * len(params)
    logprobs = raw_logits.log_softmax(-1)
    k = max(p.logprobs or 0 for p in params)
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    out: list[TokenLogprob | None] = []
    for i, p in enumerate(params):
        if not want[i]:
            out.append(None)
            continue
        top = tuple(zip(top_ids[i, :p.logprobs].tolist(), top_vals[i, :p.logprobs].tolist())) if p.logprobs else ()
        out.append(TokenLogprob(int(tokens[i]), chosen[i], top))
    return out


PROMPT_ROWS_AT_ONCE = 256  # rows held in fp32 at once by torch's way: a long prefill's copy stays bounded


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], ks: Sequence[int],
                    fused: bool | None = None) -> list[TokenLogprob]:
    """Raw logits rows (M, V) of prompt positions -> per row the logprob of `targets[i]` (the prompt's next
    token), its rank (the tokens at least as likely, itself included, as vLLM counts) and the `ks[i]` best.

    `fused` (default: where it is built and takes the dtype): one C++ read of each row
    (models/csrc/logit_scores.cpp), 13x faster than torch's four passes over the fp32 rows here."""
    if fused is None:
        fused = _native_rows(logits)
    k = max(ks, default=0)
    ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
    if fused:
        load("logit_scores")
        mine, ranks, top_vals, top_ids = torch.ops.attnserve.logit_scores(logits, ids, k)
        scores = [(mine.tolist(), ranks.tolist(), top_vals.tolist(), top_ids.tolist())]
    else:
        scores = [_torch_scores(logits[s:s + PROMPT_ROWS_AT_ONCE], ids[s:s + PROMPT_ROWS_AT_ONCE], k)
                  for s in range(0, len(targets), PROMPT_ROWS_AT_ONCE)]
    rows = [row for score in scores for row in zip(*score)]
    return [TokenLogprob(token, value, tuple(zip(best_ids[:k_i], best_vals[:k_i])), rank)
            for token, k_i, (value, rank, best_vals, best_ids) in zip(targets, ks, rows)]


PROMPT_HEAD_ROWS = 128  # prompt rows through the LM head at once


def score_prompt_rows(head, hidden: torch.Tensor, targets: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """Prompt positions' hidden states (M, C) -> `prompt_logprobs` of `head`'s logits (the LM head), a slice of
    rows at a time. NOTE: slices, because 511 rows of a 49,152-word vocabulary are 50 MB of bf16 logits, out
    of the caches, and a fresh mapping (page faults) per step: 128 at a time cut the LM head and the
    scoring of a 512-token prompt from 139 to 92 ms here."""
    out: list[TokenLogprob] = []
    for start in range(0, len(targets), PROMPT_HEAD_ROWS):
        end = start + PROMPT_HEAD_ROWS
        out.extend(prompt_logprobs(head(hidden[start:end]), targets[start:end], ks[start:end]))
    return out


def _torch_scores(logits: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[list, list, list, list]:
    """Where the fused kernel is not: the same four lists (logprob, rank, k best values, their ids) per row."""
    logprobs = logits.float().log_softmax(-1)  # (b, V)
    mine = logprobs.gather(1, ids[:, None])  # (b, 1)
    # NOTE: int32 counts: an int64 sum costs this pass half again (measured: the rows are 10^7+ values)
    ranks = (logprobs >= mine).sum(-1, dtype=torch.int32)
    top_vals, top_ids = logprobs.topk(k, dim=-1)  # (b, k)
    return mine.squeeze(1).tolist(), ranks.tolist(), top_vals.tolist(), top_ids.tolist()


def _native_rows(logits: torch.Tensor) -> bool:
    """Whether models/csrc/logit_scores.cpp takes these logits (and is built: then it is loaded)."""
    return logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and native_enabled() \
        and available("logit_scores")


def greedy(logits: torch.Tensor) -> list[int]:
    """Each row's first maximum of raw logits (B, V) in the model's dtype: the token fp32 would give (the
    conversion is exact and keeps ties), without a (B, V) fp32 copy. One C++ pass per row where it is built
    (`greedy_tokens`: 32 x 49,152 bf16 in ~0.1 ms against torch's `max(dim)` 0.67 ms here; CPU `argmax` has no
    vectorised bf16 kernel at all: 2.5 ms)."""
    if logits.dim() == 2 and logits.shape[1] > 0 and _native_rows(logits):
        return torch.ops.attnserve.greedy_tokens(logits).tolist()
    return logits.max(-1).indices.tolist()


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], list[TokenLogprob | None]]:
    """Raw logits (B, V), in the model's dtype -> sampled token ids and, where asked, their logprobs.
    NOTE: a batch of plain greedy rows takes `greedy` of the raw logits."""
    params = batch.params
    if all(p.greedy and not p.has_penalties and p.logprobs is None for p in params):
        return greedy(logits), [None] * len(params)
    logits = logits.float()
    processed = apply_filters(apply_penalties(logits, batch), batch.params)
    tokens = draw(processed, batch)
    return tokens.tolist(), token_logprobs(logits, tokens, batch.params)
