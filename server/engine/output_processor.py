"""A step's sampled tokens -> the requests' outputs: stop checks, detokenization, and finals, which
free the request's blocks. Detokenization stays in the engine process so that a stop string ends its
sequence in the step that produced it."""
from __future__ import annotations

import logging
import time
from typing import Any

from server.engine.request import Request, RequestStatus
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.wire import RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.scheduler, self.eos_token_ids, self.max_model_len = scheduler, eos_token_ids, max_model_len
        self.groups: dict[str, list[Request]] = {}  # a request's samples, until every one has finished
        self.num_generated_tokens = 0

    def process(self, samplers, token_ids, logprobs) -> list[RequestOutput]:
        """One finished step's tokens (per sequence that sampled) -> outputs."""
        now = time.monotonic()
        # NOTE: a request aborted while its step was in flight gets no tokens (its blocks are already free)
        outputs = [self._on_tokens(s.request, t, lp, now) for s, t, lp in zip(samplers, token_ids, logprobs)
                   if not s.request.is_finished]
        return [o for o in outputs if o is not None]

    @staticmethod
    def add_prompt_logprobs(scored) -> None:
        """A step's prompt logprobs (`StepResult.prompt_logprobs`) onto their requests' lists."""
        for req, first, values in scored:
            # NOTE: an aborted request's are dropped; a group's samples share one list, which one of them fills
            if not req.is_finished and first == len(req.prompt_logprobs):
                req.prompt_logprobs.extend(values)

    def pool(self, seqs, rows) -> list[RequestOutput]:
        """One step's embedding requests (`seqs`) and the hidden-state rows each pools (`rows`): added to its
        pooling; a request whose prompt this step finished ends with its embedding (freeing its blocks at once)."""
        outputs = []
        for s, r in zip(seqs, rows):
            req = s.request
            if req.is_finished:  # NOTE: aborted while its step was in flight
                continue
            req.embedding.add(r, s.num_computed_tokens)
            if s.ends:
                outputs.append(self.final(req, "stop", (), embedding=req.embedding.vector()))
        return outputs

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Every unfinished sample of a request, finished; unknown / finished ids are a no-op."""
        return [self.final(req, "abort", ()) for req in self.groups.pop(request_id, []) if not req.is_finished]

    def fail(self, out: SchedulerOutput, e: Exception) -> list[RequestOutput]:
        """A step that raised fails its requests, never the engine."""
        logger.exception("model step failed")
        return [self.final(s.request, "error", (), error=f"{type(e).__name__}: {e}")
                for s in out.seqs if not s.request.is_finished]

    def _on_tokens(self, req: Request, tokens: tuple[int, ...], logprobs: tuple[TokenLogprob | None, ...],
                   now: float) -> RequestOutput | None:
        """Append a step's tokens (one, or accepted drafts and one) until one of them ends the sequence."""
        grammar, p, reason = req.grammar, req.params, None
        if p.max_tokens == 0:  # NOTE: only the prompt was asked for (echo): its step's token is not the answer's
            return self.final(req, "length", ())
        new: list[int] = []
        for token in tokens:
            # NOTE: a reasoning model's grammar applies to its answer, after the thinking (server/engine/thinking.py)
            answer = req.thinking is None or req.thinking.take(token)
            if grammar is not None and answer and not grammar.accept(token):
                # NOTE: the mask left the model no token (a grammar with no way on): the sequence ends
                # where it stands, and its text never leaves the grammar
                reason = "stop"
                break
            req.append_token(token, now)
            new.append(token)
            self.num_generated_tokens += 1
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                reason = "stop"  # the stop token itself adds no text
            elif req.detokenizer is not None and req.detokenizer.append(token) is not None:
                reason = "stop"
            elif grammar is not None and answer and grammar.is_terminated:
                reason = "stop"
            elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                break
        lps = tuple(lp for lp in logprobs[:len(new)] if lp is not None)
        req.logprobs.extend(lps)
        if reason is None:
            text = req.detokenizer.flush(False) if req.detokenizer else ""
            if req.final_only:
                req.text_parts.append(text)
                return None
            return RequestOutput(req.group_id, req.index, tuple(new), text, False, None, lps,
                                 prompt_logprobs=self._prompt_logprobs(req))
        return self.final(req, reason, tuple(new), lps)

    def final(self, req: Request, reason: str, tokens: tuple[int, ...], lps: tuple = (),
              error: str | None = None, embedding: Any = None) -> RequestOutput:
        """Finish `req` (freeing its blocks) and build its last output."""
        if req.status != RequestStatus.FINISHED:
            self.scheduler.finish(req, reason)
        text = req.detokenizer.flush(True) if req.detokenizer else ""
        if req.final_only:  # everything the sample made, as one output
            tokens, lps = tuple(req.output_token_ids), tuple(req.logprobs)
            text = "".join(req.text_parts) + text
        group = self.groups.get(req.group_id)
        if group is not None and all(r.is_finished for r in group):
            del self.groups[req.group_id]
        return RequestOutput(req.group_id, req.index, tokens, text, True, reason, lps, req.stats, error,
                             req.detokenizer.matched if req.detokenizer else None,
                             prompt_logprobs=self._prompt_logprobs(req), embedding=embedding)

    @staticmethod
    def _prompt_logprobs(req: Request) -> tuple[TokenLogprob, ...] | None:
        """The prompt's logprobs, once, on the sample's first output (None: not asked for, sent, or never
        complete: a request that ended before its prefill did)."""
        if req.prompt_logprobs is None or req.prompt_logprobs_sent or req.needs_prompt_logprobs:
            return None
        req.prompt_logprobs_sent = True
        return tuple(req.prompt_logprobs)
