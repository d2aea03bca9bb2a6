"""Draft tokens for speculative decoding: n-gram prompt lookup, or a small model on its own paged KV.

A proposer only guesses; the target model's step verifies (server/engine/verify.py), so a bad
guess costs time, never correctness. Both propose one token per position (a point mass), which
the verification rule accepts with the target's own probability of that token.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np
import torch

from kvcache.manager import KVCacheManager
from kvcache.paged_attention import AttentionMetadata, PagedAttention
from kvcache.storage import KVCacheSpec
from models.transformer import DecoderLM
from server.engine.request import Request
from server.engine.sampler import greedy


class Proposer(Protocol):
    max_catch_up: int  # tokens the last proposal fed one request before its first draft (1-2 in steady state)

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        """Up to num_drafts[i] tokens to follow requests[i]'s tokens so far."""

    def rollback(self, request: Request, num_valid_tokens: int) -> None:
        """After verification: the request's first `num_valid_tokens` tokens are final."""

    def release(self, request_id: str) -> None:
        """The request finished or was preempted: drop its state."""


def ngram_lookup(token_ids: Sequence[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the sequence's last n tokens,
    for the longest n in [min_n, max_n] that occurs; [] when none does."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # (L - n, n): every earlier n-gram
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + num_drafts].tolist()
    return []


class NgramProposer:
    max_catch_up = 0  # no state to bring up to date: every proposal costs the same

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        return [ngram_lookup(r.all_token_ids, k, self.min_n, self.max_n) for r, k in zip(requests, num_drafts)]

    def rollback(self, request: Request, num_valid_tokens: int) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass


def check_vocabulary(target: DecoderLM, target_tokenizer: Any, draft: DecoderLM, draft_tokenizer: Any, name: str) -> None:
    """A draft's token ids mean nothing to the target unless both share one vocabulary."""
    ours, theirs = target.config.vocab_size, draft.config.vocab_size
    if ours != theirs:
        raise ValueError(f"speculative_config.model {name!r}: its vocabulary has {theirs} tokens, the target's {ours}; "
                         "a draft model must share the target's tokenizer")
    if target_tokenizer is not None and draft_tokenizer is not None \
            and target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(f"speculative_config.model {name!r}: its tokenizer maps tokens to other ids than the "
                         "target's; a draft model must share the target's tokenizer")


class DraftModelProposer:
    """A small model run greedily over its own paged KV cache, as many blocks as the target's pool
    (fewer bytes each), so it never runs out where the target did not. No prefix caching: its blocks
    go with their request (finish, abort, preemption).

    NOTE: a request's draft KV holds `num_computed[id]` tokens that equal the request's; each
    `propose` first feeds the tokens it lacks (the prompt, then what verification accepted), then
    one token per further draft; `rollback` forgets the drafts verification did not keep.
    """

    def __init__(self, runner: Any, num_blocks: int, spec: KVCacheSpec) -> None:
        self.runner = runner  # a ModelRunner over the draft model and `runner.cache`
        self.kv = KVCacheManager(num_blocks, spec.block_size, enable_caching=False, group_windows=spec.group_windows)
        self.block_size = spec.block_size
        self.num_computed: dict[str, int] = {}
        self.max_catch_up = 0  # the last proposal's longest first feed: a prompt, or tokens since drafts were off

    @staticmethod
    def kv_spec(model: DecoderLM, block_size: int) -> KVCacheSpec:
        """The draft's KV: in its own dtype (its bytes count in the engine's memory budget)."""
        return KVCacheSpec.of(model.config, model.dtype, block_size)

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        # first pass: each request's missing tokens; later passes: its previous draft
        feeds = [r.all_token_ids[self.num_computed.get(r.request_id, 0):] for r in requests]
        self.max_catch_up = max(map(len, feeds), default=0)
        active = list(range(len(requests)))
        for step in range(max(num_drafts, default=0)):
            # a request whose feed finds no draft blocks proposes what it has so far; the rest go on
            active = [i for i in active if num_drafts[i] > step and self._allocate(requests[i].request_id, feeds[i])]
            if not active:
                break
            tokens = self._greedy([requests[i].request_id for i in active], [feeds[i] for i in active])
            for i, t in zip(active, tokens):
                drafts[i].append(t)
                feeds[i] = [t]
        return drafts

    def _allocate(self, request_id: str, feed: list[int]) -> bool:
        c = self.num_computed.get(request_id, 0)
        return self.kv.allocate_slots(request_id, c + len(feed), num_computed_tokens=c) is not None

    def _greedy(self, request_ids: list[str], feeds: list[list[int]]) -> list[int]:
        """One draft step over requests whose blocks are allocated: each one's greedy next token."""
        contexts = [self.num_computed.get(rid, 0) for rid in request_ids]
        bs, device = self.block_size, self.runner.device
        tables = [[self.kv.block_table(r, g) for r in request_ids] for g in range(self.kv.num_groups)]
        meta = AttentionMetadata.build_groups([len(f) for f in feeds], contexts, tables, bs, device)
        ids = torch.tensor([t for f in feeds for t in f], dtype=torch.long, device=device)  # (T,)
        positions = torch.from_numpy(np.concatenate([np.arange(c, c + len(f)) for c, f in zip(contexts, feeds)]))
        last = torch.from_numpy(np.cumsum([len(f) for f in feeds]) - 1).to(device)  # (B,) each feed's last row
        with torch.inference_mode():
            hidden = self.runner.forward(ids, positions.to(device), PagedAttention(self.runner.cache, meta))  # (T, C)
            logits = self.runner.model.logits(hidden[last])  # (B, V)
        for rid, c, feed in zip(request_ids, contexts, feeds):
            self.num_computed[rid] = c + len(feed)
        return greedy(logits)

    def rollback(self, request: Request, num_valid_tokens: int) -> None:
        rid = request.request_id
        if rid in self.num_computed:
            self.num_computed[rid] = min(self.num_computed[rid], num_valid_tokens)
            self.kv.trim(rid, self.num_computed[rid])

    def release(self, request_id: str) -> None:
        self.num_computed.pop(request_id, None)
        self.kv.free(request_id)

