"""Verification of draft tokens: keep the longest prefix the target model would have produced.

Each sequence with k drafts has k + 1 logits rows: row i follows the sequence plus drafts[:i].
Proposers propose one token per position (a point mass q = 1 at the draft d), so the rule of
Leviathan et al. / Chen et al. (accept with min(1, p(d) / q(d)), else sample max(0, p - q)
renormalised) becomes: accept d with probability p(d), else sample p with d removed. Every
emitted token is then distributed exactly as the target's p, where p is the distribution the
non-speculative sampler draws from (penalties, temperature, top-k / top-p / min-p applied). A
greedy row accepts d iff d is its argmax, so greedy output never changes.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from server.engine.sampler import SamplingBatch, apply_filters, apply_penalties, draw, greedy, token_logprobs
from server.wire import TokenLogprob


def _rows(batch: SamplingBatch, rows: Sequence[int]) -> SamplingBatch:
    pick = lambda xs: tuple(xs[r] for r in rows)  # noqa: E731
    return replace(batch, params=pick(batch.params), generators=pick(batch.generators),
                   prompt_token_ids=pick(batch.prompt_token_ids), output_token_ids=pick(batch.output_token_ids))


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def verify(logits: torch.Tensor, batch: SamplingBatch, drafts: Sequence[Sequence[int]]
           ) -> tuple[list[list[int]], list[list[TokenLogprob | None]]]:
    """Logits (R, V) with len(drafts[s]) + 1 rows per sequence s, in order; `batch` has one entry per
    row. Returns each sequence's emitted tokens (the accepted drafts, then one token from the target)
    and their logprobs."""
    starts = np.concatenate([[0], np.cumsum([len(d) + 1 for d in drafts])]).tolist()
    params = batch.params
    if all(p.greedy and not p.has_penalties and p.logprobs is None for p in params):
        target = greedy(logits)  # first maximum: as `sample` takes it
        tokens = []
        for s, d in enumerate(drafts):
            t, j = target[starts[s]:starts[s + 1]], 0
            while j < len(d) and d[j] == t[j]:
                j += 1
            tokens.append(list(d[:j]) + [t[j]])
        return tokens, [[None] * len(t) for t in tokens]
    raw = logits.float()
    processed = apply_filters(apply_penalties(raw, batch), params)  # (R, V): what `draw` draws from
    probs = processed.softmax(-1)
    best = processed.argmax(-1).tolist()
    tokens, final_rows = [], []
    for s, d in enumerate(drafts):
        j = 0
        while j < len(d):
            row = starts[s] + j
            if params[row].greedy:
                ok = d[j] == best[row]
            else:  # NOTE: p(d) is exactly 1 when d is the only token left, so a rejection always leaves mass
                ok = _uniform(batch.generators[row]) < float(probs[row, d[j]])
            if not ok:
                processed[row, d[j]] = float("-inf")  # the residual p - q: p without the rejected draft
                break
            j += 1
        tokens.append(list(d[:j]))
        final_rows.append(starts[s] + j)
    last = draw(processed[final_rows], _rows(batch, final_rows)).tolist()
    for t, x in zip(tokens, last):
        t.append(x)
    emitted_rows = [starts[s] + i for s, t in enumerate(tokens) for i in range(len(t))]
    flat = torch.tensor([x for t in tokens for x in t], device=logits.device)
    lps = token_logprobs(raw[emitted_rows], flat, [params[r] for r in emitted_rows])
    out, i = [], 0
    for t in tokens:
        out.append(lps[i:i + len(t)])
        i += len(t)
    return tokens, out
