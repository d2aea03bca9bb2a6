"""Iteration-level scheduling: which requests run this step, and with how many tokens.

Order of service each step: running decodes, then running prefill chunks, then (if nothing
was preempted) waiting requests. Prompts longer than the remaining token budget are prefilled
in chunks. When blocks run out a running request is preempted: its blocks are freed and it is
recomputed later from the front of the waiting queue.

Two policies, as vLLM's `--scheduling-policy`: `fcfs` admits in arrival order and preempts the
newest running request; `priority` orders by each request's `priority` (lower first): the best
waiting request is admitted first, the worst running one preempted first, and running prefill
chunks take the token budget best first. Among equal priorities it does exactly what fcfs does
(queue order, newest preempted first), so all-equal priorities give fcfs's schedule step for step.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from kvcache.manager import NO_HIT, KVCacheManager, PrefixHit
from server.engine.config import SCHEDULING_POLICIES
from server.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int
    num_computed_tokens: int  # before this step
    block_ids: tuple[tuple[int, ...], ...]  # per KV group: its block table (kvcache/manager.py)
    draft_token_ids: tuple[int, ...] = ()  # speculative decoding: verified after the request's last token

    @property
    def query_len(self) -> int:
        return self.num_new_tokens + len(self.draft_token_ids)

    @property
    def ends(self) -> bool:
        """True when this step computes the request's last known token."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens

    @property
    def samples(self) -> bool:
        """True when this step yields the request's logits: it ends, and the request generates (an embedding
        request's last prefill chunk yields its pooled vector instead: server/engine/pooling.py)."""
        return self.ends and self.request.embedding is None


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: tuple[ScheduledSeq, ...]
    preempted: tuple[str, ...] = ()  # request ids preempted while this step was scheduled, in order

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int, bytes_per_block: int,
                 on_free: Callable[[Request], None] | None = None, policy: str = "fcfs",
                 on_finish: Callable[[Request], None] | None = None, cache_output_blocks: bool = True) -> None:
        """`cache_output_blocks`: False where a prompt token's KV is computed by another kernel than an output
        token's (server/engine/model_runner.py `prompt_tiles`): then only blocks of prompt tokens are shared."""
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, not {policy!r}")
        self.kv = kv
        self.by_priority = policy == "priority"
        self.on_free = on_free  # a request's blocks were freed (finish or preemption): e.g. a draft model's KV too
        self.on_finish = on_finish  # a request finished (not preempted): e.g. its LoRA adapter's pin goes
        self.cache_output_blocks = cache_output_blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.bytes_per_block = bytes_per_block
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, list[Request]] = {}  # n > 1: samples waiting for their first sibling's prefill
        self.num_preemptions = 0
        self.preemptions_by_priority: dict[int, int] = {}  # the preempted request's priority -> count
        self.num_prompt_tokens = 0  # prompt tokens of admitted requests (first admission only)
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0
        self.num_partial_prefills = 0  # prefill chunks that stopped short of the prompt's end

    def add(self, requests: list[Request]) -> None:
        """Queue a group: the first sample now, its siblings once its prompt is cached."""
        self.waiting.append(requests[0])
        if len(requests) > 1:
            self.held[requests[0].request_id] = requests[1:]

    def schedule(self, busy: frozenset[str] | set[str] = frozenset()) -> SchedulerOutput:
        """`busy`: requests in a step still in flight (pipeline stages): they sit this one out and are
        never preempted (their blocks are being written)."""
        budget = self.max_num_batched_tokens
        chosen: dict[str, tuple[Request, int, int, tuple[int, ...]]] = {}
        preempted: list[Request] = []
        free = [r for r in self.running if r.request_id not in busy]
        # NOTE: drafts take only what is left once every running request has its one token
        spare = budget - len(free)
        for req in sorted(free, key=self._service_order):
            if req.status != RequestStatus.RUNNING or budget == 0:
                continue
            n = min(req.num_new_tokens, budget)
            drafts = tuple(req.draft_token_ids[:max(spare, 0)]) if n == req.num_new_tokens else ()
            req.draft_token_ids = []
            while (fitted := self._allocate(req, req.num_computed_tokens, n, len(drafts))) is None:
                victims = [r for r in self.running if r.request_id not in busy]
                if not victims:  # NOTE: only requests in flight hold blocks: wait for them
                    break
                victim = self._victim(victims)
                self._preempt(victim)
                preempted.append(victim)
                if victim.request_id in chosen:
                    _, vn, _, vdrafts = chosen.pop(victim.request_id)
                    budget += vn + len(vdrafts)
                    spare += len(vdrafts)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING or fitted is None:
                continue
            n = fitted
            chosen[req.request_id] = (req, n, req.num_computed_tokens, drafts)
            budget -= n + len(drafts)
            spare -= len(drafts)
            self._track_peak(req)
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self._next_waiting()
            if req is None:
                break
            first = req.stats.first_scheduled_time is None
            # NOTE: a request that asks for its prompt's logprobs computes every position it still needs them
            # for: no prefix-cache hit for it (its blocks still fill the cache)
            # NOTE: an embedding request neither reads nor fills the prefix cache: it pools every position's
            # hidden state, and keeps no KV after its prefill
            lookup = not req.needs_prompt_logprobs and req.embedding is None
            # NOTE: a LoRA adapter's requests look up (and fill) blocks under its salt: never another's KV
            hit = self.kv.find_prefix(req.request_id, req.all_token_ids, req.cache_salt) if lookup else NO_HIT
            n = self._allocate(req, hit.num_tokens, min(req.num_tokens - hit.num_tokens, budget), prefix=hit)
            if n is None:
                break
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = hit.num_tokens
            if first:
                req.stats.first_scheduled_time = time.monotonic()
                req.stats.num_cached_tokens = hit.num_tokens
                self.num_prompt_tokens += req.num_prompt_tokens
                self.num_prefix_queries += req.num_prompt_tokens if self.kv.pool.enable_caching and lookup else 0
                self.num_prefix_hits += hit.num_tokens
            chosen[req.request_id] = (req, n, hit.num_tokens, ())
            budget -= n
            self._track_peak(req)
        seqs = [ScheduledSeq(r, n, c, self.kv.block_tables(r.request_id), d) for r, n, c, d in chosen.values()]
        self.num_partial_prefills += sum(not s.ends for s in seqs)
        return SchedulerOutput(tuple(seqs), tuple(r.request_id for r in preempted))

    def _service_order(self, req: Request) -> tuple[bool, int]:
        """Sort key of the running requests (a stable sort: admission order among equals): decodes
        first, then prefill chunks; by priority within each under the priority policy."""
        return req.num_new_tokens > 1, req.priority if self.by_priority else 0

    def _victim(self, running: list[Request]) -> Request:
        """fcfs: the newest admitted; priority: the worst priority, the newest admitted among equals.
        NOTE: max keeps the first of equals: over the reversed list, the one fcfs picks."""
        if not self.by_priority:
            return running[-1]
        return max(reversed(running), key=lambda r: r.priority)

    def _next_waiting(self) -> Request | None:
        """The first ready request in queue order (fcfs), or the first ready one of the best priority.
        NOTE: a request whose grammar still compiles keeps its place; the ones behind it go ahead.
        min keeps the first of equals: with equal priorities, the one fcfs picks."""
        ready = (r for r in self.waiting if r.is_ready)
        if self.by_priority:
            return min(ready, key=lambda r: r.priority, default=None)
        return next(ready, None)

    def _allocate(self, req: Request, num_computed: int, n: int, num_drafts: int = 0,
                  prefix: PrefixHit = NO_HIT) -> int | None:
        """Blocks for `n` new tokens (and drafts) after `num_computed`: returns n, or None if they do not fit.

        NOTE: with windowed layers a prefill chunk that does not fit is halved until it does: a windowed
        group needs blocks for the window and the chunk at once, so a whole prompt may never fit at once
        while the sequence, chunk by chunk, does (admission checks that)."""
        while self.kv.allocate_slots(req.request_id, num_computed + n + num_drafts, prefix, num_computed) is None:
            if not self.kv.has_windows or n == 1 or num_drafts:
                return None
            n = (n + 1) // 2
        return n

    def _track_peak(self, req: Request) -> None:
        blocks = self.kv.num_request_blocks(req.request_id)
        if blocks > req.stats.peak_blocks:
            req.stats.peak_blocks = blocks
            req.stats.peak_kv_bytes = blocks * self.bytes_per_block

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        if self.on_free is not None:
            self.on_free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_priority[req.priority] = self.preemptions_by_priority.get(req.priority, 0) + 1
        self.waiting.appendleft(req)  # the priority policy: the front of its priority

    def advance(self, out: SchedulerOutput, num_accepted: dict[str, int] | None = None) -> None:
        """Mark this step's tokens computed (and the drafts verification accepted, which the request
        already holds), return the blocks of rejected drafts, cache newly full blocks, release held siblings."""
        for seq in out.seqs:
            req = seq.request
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens = seq.num_computed_tokens + seq.num_new_tokens
            if seq.draft_token_ids:
                req.num_computed_tokens += (num_accepted or {}).get(req.request_id, 0)
                self.kv.trim(req.request_id, req.num_computed_tokens)
            if req.embedding is None:
                # NOTE: a later prompt holding these output tokens computes them as prompt tokens: where those take
                # another kernel, a hit on this request's blocks would give it other KV than a miss, and another output
                cached = req.num_computed_tokens if self.cache_output_blocks else min(req.num_computed_tokens,
                                                                                      req.num_prompt_tokens)
                self.kv.cache_full_blocks(req.request_id, req.all_token_ids, cached, req.cache_salt)
            self.kv.free_unseen(req.request_id, req.num_computed_tokens)  # NOTE: after caching: freed, still a prefix
            if req.num_computed_tokens >= req.num_prompt_tokens and req.request_id in self.held:
                self.waiting.extendleft(reversed(self.held.pop(req.request_id)))

    def finish(self, req: Request, reason: str) -> None:
        """Finish (stop, length, abort, error) from any state; frees the request's blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.request_id)
        if self.on_free is not None:
            self.on_free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stats.finished_time = time.monotonic()
        if self.on_finish is not None:
            self.on_finish(req)
        siblings = self.held.pop(req.request_id, None)
        if siblings:  # first sample ended before its prompt was cached: let them compute it themselves
            self.waiting.extendleft(reversed(siblings))
