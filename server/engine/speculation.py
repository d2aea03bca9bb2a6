"""Speculative decoding's bookkeeping between steps: what each request's drafts earned, the gate's
measurements, rolling the proposer back to what verification kept, and the next step's drafts."""
from __future__ import annotations

import time

from server.engine.proposers import Proposer
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.spec_config import SpeculativeConfig
from server.engine.spec_gate import SpeculationGate


class Speculation:
    def __init__(self, spec: SpeculativeConfig, proposer: Proposer, scheduler: Scheduler, max_model_len: int) -> None:
        self.spec, self.proposer, self.scheduler, self.max_model_len = spec, proposer, scheduler, max_model_len
        self.gate = SpeculationGate() if spec.auto_disable else None
        self.drafting = False  # this step verifies drafts the last one proposed
        self.propose_s = 0.0  # what proposing them took
        self.catch_up = 0  # and the longest run of tokens the proposer first had to feed a request

    def after_step(self, out: SchedulerOutput, samplers, token_ids, accepted: dict[str, int], step_s: float) -> None:
        """Record the step for the gate, account for its drafts, then propose the next step's."""
        # the gate compares steady steps: no prefill chunk, and no draft model catching up on a
        # prompt (or on the tokens made while drafts were off), a cost paid once, not per step
        if self.gate is not None and all(s.num_new_tokens == 1 for s in out.seqs) and \
                self.catch_up <= self.spec.num_speculative_tokens + 1:
            self.gate.record(len(out.seqs), self.drafting, sum(map(len, token_ids)), step_s + self.propose_s)
        self._account(samplers, accepted)
        self._propose()

    def _account(self, samplers, accepted: dict[str, int]) -> None:
        for s in samplers:
            req, k = s.request, len(s.draft_token_ids)
            if not k:
                continue
            j, st = accepted[req.request_id], req.stats
            st.spec_drafted.extend([0] * (k - len(st.spec_drafted)))
            st.spec_accepted.extend([0] * (k - len(st.spec_accepted)))
            for i in range(k):
                st.spec_drafted[i] += 1
                st.spec_accepted[i] += i < j
            # positions after the first rejection were never tested: the rate is j of min(j + 1, k) trials
            req.draft_acceptance = 0.7 * req.draft_acceptance + 0.3 * j / min(j + 1, k)
            if not req.is_finished:
                self.proposer.rollback(req, req.num_computed_tokens)

    def _propose(self) -> None:
        """Drafts for the next step, if they pay at this batch size."""
        # NOTE: an embedding request's last prompt token is no decode: it gets no drafts
        running = [r for r in self.scheduler.running
                   if r.num_new_tokens == 1 and r.grammar is None and r.embedding is None]
        limit, batch = self.spec.disable_by_batch_size, len(self.scheduler.running)
        self.drafting, self.propose_s, self.catch_up = False, 0.0, 0
        if not running or (limit is not None and batch > limit) or (self.gate is not None and not self.gate.use(batch)):
            return
        self.drafting, start = True, time.perf_counter()
        caps = [min(self.spec.num_drafts(r.draft_acceptance), r.params.max_tokens - len(r.output_token_ids) - 1,
                    self.max_model_len - r.num_tokens - 1, _thinking_cap(r, self.max_model_len)) for r in running]
        # NOTE: k drafts may emit k + 1 tokens: never more than max_tokens, the context or a thinking budget allows
        chosen = [(r, c) for r, c in zip(running, caps) if c > 0]
        if chosen:
            drafts = self.proposer.propose([r for r, _ in chosen], [c for _, c in chosen])
            for (r, _), d in zip(chosen, drafts):
                r.draft_token_ids = d
            self.catch_up = self.proposer.max_catch_up
        self.propose_s = time.perf_counter() - start


def _thinking_cap(req, max_model_len: int) -> int:
    """Drafts a reasoning model's thinking leaves room for (server/engine/thinking.py); no fewer than the
    context would, where it sets no bound."""
    cap = req.thinking.max_drafts() if req.thinking is not None else None
    return max_model_len if cap is None else cap
