"""The synchronous engine core: one step at a time, outputs per sequence, stats as values.

No Ray and no asyncio here: the engine process (`server/engine/core.py`) drives this for a
replica, the CLI and the benchmarks drive it directly.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from kvcache.manager import KVCacheManager
from kvcache.quant import dtype_name, kv_cache_dtype, scales_for
from kvcache.storage import KVCacheSpec, PagedKVCache
from models.cpu_path import detect, prepare
from models.loader import load_for_serving, load_tokenizer, parse_dtype, read_model_config
from models.registry import resolve_model
from models.transformer import DecoderLM
from server.engine.admission import validate_request
from server.engine.config import EngineConfig, format_size
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.errors import InvalidRequestError
from server.engine.executor import WorkerDiedError
from server.engine.grammar import GrammarCache, SequenceGrammar
from server.engine.model_runner import Batch, DistributedRunner, ModelRunner
from server.engine.proposers import DraftModelProposer, NgramProposer, Proposer, check_vocabulary
from server.engine.request import Request, RequestStatus
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.spec_gate import SpeculationGate
from server.metrics import resident_memory_bytes
from server.wire import EngineStats, ModelInfo, RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)
CACHED_FREE_EVERY_S = 0.25  # counting cached free blocks walks the prefix map: not every step


@dataclass(frozen=True)
class CompletionResult:
    """A finished sequence, for offline use (CLI, tests)."""

    request_id: str
    index: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...]
    stats: Any


class LLMEngine:
    def __init__(self, config: EngineConfig, model: DecoderLM | None = None, tokenizer: Any = None) -> None:
        self.config = config
        self.executor = None
        if config.world_size > 1:
            tokenizer, draft = self._init_parallel(config, tokenizer)
        else:
            tokenizer, draft = self._init_local(config, model, tokenizer)
        logger.info("attnserve step: %s", self.runner.step)
        self.proposer: Proposer | None = None
        if self.spec is not None:
            self.proposer = NgramProposer(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max) if draft is None \
                else DraftModelProposer(ModelRunner(draft, PagedKVCache(self.draft_spec, self.num_blocks, draft.device),
                                                    compile=not config.enforce_eager, native=config.native_decoder),
                                        self.num_blocks, self.draft_spec)
            logger.info("attnserve speculative decoding: %s", self.spec)
        cfg, num_blocks = self.model_config, self.num_blocks
        self.gate = SpeculationGate() if self.spec is not None and self.spec.auto_disable else None
        self._drafting = False  # this step verifies drafts the last one proposed
        self._propose_s = 0.0  # what proposing them took
        self._catch_up = 0  # and the longest run of tokens the proposer first had to feed a request
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   self.kv_spec.bytes_per_block,
                                   on_free=(lambda r: self.proposer.release(r.request_id)) if self.proposer else None)
        eos = set(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.grammars = GrammarCache(tokenizer, cfg.vocab_size, self.eos_token_ids)
        self.compiling: list[Request] = []  # constrained requests whose grammar is not ready yet
        self.last_step_empty = False  # nothing could run (e.g. every request waits for its grammar)
        self.info = ModelInfo(self.max_model_len, cfg.attention_kind, cfg.num_kv_heads, self.kv_spec.bytes_per_token,
                              cfg.vocab_size, config.block_size, num_blocks, cfg.num_heads,
                              dtype_name(self.kv_spec.dtype), self.cpu_path, self.cpu_path.quantization,
                              self.weight_bytes, self.spec.method if self.spec is not None else None,
                              cfg.layer_windows, self.kv_spec.bytes_per_block, cfg.attention_variants,
                              config.tensor_parallel_size, config.pipeline_parallel_size,
                              self.executor.info if self.executor is not None else ())
        self.in_flight: deque[tuple[SchedulerOutput, Batch, Any]] = deque()  # steps submitted, not finished
        self.groups: dict[str, list[Request]] = {}
        self.num_steps = 0
        self.num_step_errors = 0
        self.num_generated_tokens = 0
        self.num_adds_received = 0
        self._cached_free = (0.0, 0)  # (when counted, count)

    def _init_local(self, config: EngineConfig, model: DecoderLM | None, tokenizer: Any):
        """The model in this process: loaded here, or one the caller loaded (its dtype is the one asked for)."""
        if model is None:
            path = resolve_model(config.model)
            model = load_for_serving(path, config.dtype, config.device, quantization=config.quantization)
            tokenizer = tokenizer or load_tokenizer(path)
        else:
            dtype = dtype_name(model.dtype)
            prepare(model, detect(config.device), dtype, dtype, config.device)
        self._describe_path(model.cpu_path)
        self.model, self.tokenizer = model, tokenizer
        draft = self._init_common(config, model.config, kv_cache_dtype(config.kv_cache_dtype, model.dtype))
        # NOTE: weight_bytes is what the weights take as served (quantized, packed): with kv_cache_memory
        # auto the pool is memory_budget minus that, so every byte quantization saves becomes KV blocks
        self.weight_bytes = model.weight_bytes()
        # NOTE: a draft model's weights and its KV (as many blocks as the target's, fewer bytes each) come
        # out of the same budget
        draft_bytes = draft.weight_bytes() if draft is not None else 0
        draft_block = self.draft_spec.bytes_per_block if draft is not None else 0
        if config.num_blocks:
            num_blocks = config.num_blocks
        else:
            budget = config.kv_budget(self.weight_bytes + draft_bytes, model.quantization)
            num_blocks = self._blocks_in(budget * self.kv_spec.bytes_per_block // (self.kv_spec.bytes_per_block + draft_block),
                                         self.kv_spec.bytes_per_block, self.weight_bytes)
        self._init_pool(num_blocks)
        scales = scales_for(model, self.kv_spec.dtype, tokenizer)
        self.cache = PagedKVCache(self.kv_spec, num_blocks, model.device, scales)
        self.runner = ModelRunner(model, self.cache, compile=not config.enforce_eager, native=config.native_decoder)
        return tokenizer, draft

    def _init_parallel(self, config: EngineConfig, tokenizer: Any):
        """The model sharded over Ray workers (server/engine/executor.py); scheduling and sampling stay here.
        Each rank's pool gets what its budget leaves after its weights: the group has the fewest blocks any
        rank fits."""
        from server.engine.executor import RayExecutor

        path = resolve_model(config.model)
        self.executor = RayExecutor(config)
        self._describe_path(self.executor.cpu_path)
        self.model, self.tokenizer = None, tokenizer or load_tokenizer(path)
        cfg = read_model_config(path)
        draft = self._init_common(config, cfg, kv_cache_dtype(config.kv_cache_dtype, parse_dtype(self.cpu_path.dtype)))
        self.weight_bytes = sum(w.weight_bytes for w in self.executor.info)
        num_blocks = config.num_blocks or min(
            self._blocks_in(config.kv_budget(w.weight_bytes, self.cpu_path.quantization), w.kv_bytes_per_block,
                            w.weight_bytes) for w in self.executor.info)
        self._init_pool(num_blocks)
        self.cache = None
        self.runner = DistributedRunner(self.executor, self.kv_spec, cfg.vocab_size, num_blocks)
        return self.tokenizer, draft

    def _describe_path(self, path) -> None:
        self.cpu_path = path
        # NOTE: one line says what this machine runs; at warning level when a slower choice was asked for
        logger.log(logging.WARNING if path.note else logging.INFO, "attnserve engine: %s", path.describe())

    def _init_common(self, config: EngineConfig, cfg, kv_dtype) -> DecoderLM | None:
        self.spec = config.speculative_config
        draft = self._load_draft() if self.spec is not None and self.spec.method == "draft_model" else None
        self.draft_spec = DraftModelProposer.kv_spec(draft, config.block_size) if draft is not None else None
        self.model_config = cfg
        self.max_model_len = min(cfg.max_position_embeddings, config.max_model_len or cfg.max_position_embeddings)
        self.kv_spec = KVCacheSpec.of(cfg, kv_dtype, config.block_size)
        return draft

    def _blocks_in(self, budget: int, block_bytes: int, weight_bytes: int) -> int:
        config = self.config
        if budget < block_bytes:
            raise ValueError(f"KV budget of {budget} bytes is below one block ({block_bytes} bytes); weights "
                             f"{format_size(weight_bytes)}, memory_budget {format_size(config.memory_budget)}, "
                             f"kv_cache_memory {config.kv_cache_memory}: raise memory_budget or kv_cache_memory, "
                             "or give num_blocks")
        return budget // block_bytes

    def _init_pool(self, num_blocks: int) -> None:
        config = self.config
        self.num_blocks = num_blocks
        logger.info("attnserve memory: weights %s (%s), KV pool %d blocks of %d tokens (%s)",
                    format_size(self.weight_bytes), self.cpu_path.quantization, num_blocks, config.block_size,
                    format_size(num_blocks * self.kv_spec.bytes_per_block))
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, self.kv_spec.group_windows)

    # ---- admission -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    arrival_time: float | None = None, final_only: bool = False) -> None:
        """Validate, then queue. Raises InvalidRequestError for anything that could never be served."""
        validate_request(self.info, prompt_token_ids, params)
        self.add_validated(request_id, prompt_token_ids, params, arrival_time, final_only)

    def add_validated(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      arrival_time: float | None = None, final_only: bool = False) -> None:
        """Queue a request its replica already validated (requests are validated once).

        With `final_only`, each sample yields one output, when it finishes, holding all its tokens,
        text and logprobs: a non-streaming caller gets no message per step."""
        self.num_adds_received += 1
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = [
            Request(
                request_id if params.n == 1 else f"{request_id}#{i}", list(prompt_token_ids), params,
                self._detokenizer(prompt_token_ids, params), index=i,
                group_id=request_id, arrival_time=arrival, final_only=final_only,
            )
            for i in range(params.n)
        ]
        if params.structured is not None:
            compiled, cache_hit = self.grammars.get(params.structured)
            for req in group:
                req.grammar = SequenceGrammar(params.structured, compiled, cache_hit)
                req.stats.structured = params.structured.label
            self.compiling.extend(group)
        self.groups[request_id] = group
        self.scheduler.add(group)

    def _load_draft(self) -> DecoderLM:
        path = resolve_model(self.spec.model)
        draft = load_for_serving(path, self.config.dtype, self.config.device, quantization=self.spec.quantization)
        check_vocabulary(self.model, self.tokenizer, draft, load_tokenizer(path), self.spec.model)
        logger.info("attnserve draft model %s: %s, weights %s", self.spec.model, draft.quantization,
                    format_size(draft.weight_bytes()))
        return draft

    def _detokenizer(self, prompt: Sequence[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt, params.stop, params.skip_special_tokens)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Abort every sample of a request; frees its blocks. Unknown / finished ids are a no-op."""
        outputs = []
        for req in self.groups.pop(request_id, []):
            if not req.is_finished:
                outputs.append(self._final(req, "abort", ()))
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.groups) or bool(self.in_flight)

    def stats(self) -> EngineStats:
        sch, kv, now = self.scheduler, self.kv, time.time()
        if now - self._cached_free[0] >= CACHED_FREE_EVERY_S:
            self._cached_free = (now, kv.pool.num_cached_free_blocks)
        return EngineStats(
            time=now, num_running=len(sch.running), num_waiting=len(sch.waiting), num_blocks=kv.num_blocks,
            num_used_blocks=kv.num_used_blocks, num_cached_free_blocks=self._cached_free[1],
            num_unfinished_groups=len(self.groups), num_prompt_tokens=sch.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens, num_prefix_queries=sch.num_prefix_queries,
            num_prefix_hits=sch.num_prefix_hits, num_preemptions=sch.num_preemptions, num_steps=self.num_steps,
            num_step_errors=self.num_step_errors, num_adds_received=self.num_adds_received,
            resident_memory_bytes=resident_memory_bytes())

    # ---- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and start steps until `runner.depth` are in flight (one, unless pipeline stages keep
        several), then finish the oldest: its tokens, as outputs."""
        start = time.perf_counter()
        failed = self._start_grammars() if self.compiling else []
        # NOTE: with speculation each step's drafts come from the last step's tokens: one at a time
        depth = 1 if self.spec is not None else self.runner.depth
        while len(self.in_flight) < depth:
            # NOTE: a request in a step in flight sits the next ones out: its next token is not known yet
            out = self.scheduler.schedule(busy={s.request.request_id for o, _, _ in self.in_flight for s in o.seqs})
            if out.is_empty:
                break
            self.num_steps += 1
            try:
                batch = self.runner.prepare(out)
                self.in_flight.append((out, batch, self.runner.submit(batch)))
            except WorkerDiedError:
                raise
            except Exception as e:  # a failed step fails its requests, never the engine
                failed += self._fail_step(out, e)
        self.last_step_empty = not self.in_flight
        if not self.in_flight:
            return failed
        out, batch, pending = self.in_flight.popleft()
        try:
            result = self.runner.finish(batch, pending)
        except WorkerDiedError:
            raise
        except Exception as e:
            return failed + self._fail_step(out, e)
        now = time.monotonic()
        samplers = [s for s in out.seqs if s.samples]
        # NOTE: a request aborted while its step was in flight gets no tokens (its blocks are already free)
        outputs = [self._on_tokens(s.request, t, lp, now) for s, t, lp in zip(samplers, result.token_ids, result.logprobs)
                   if not s.request.is_finished]
        # NOTE: after the tokens are appended: accepted drafts become computed tokens, hashed into full blocks
        accepted = {s.request.request_id: len(t) - 1 for s, t in zip(samplers, result.token_ids) if s.draft_token_ids}
        self.scheduler.advance(out, accepted)
        if self.proposer is not None:
            # NOTE: the gate compares steady steps: no prefill chunk, and no draft model catching up on a
            # prompt (or on the tokens made while drafts were off), a cost paid once, not per step
            if self.gate is not None and all(s.num_new_tokens == 1 for s in out.seqs) and \
                    self._catch_up <= self.spec.num_speculative_tokens + 1:
                self.gate.record(len(out.seqs), self._drafting, sum(map(len, result.token_ids)),
                                 time.perf_counter() - start + self._propose_s)
            self._speculate(samplers, accepted)
        return failed + [o for o in outputs if o is not None]

    def _fail_step(self, out: SchedulerOutput, e: Exception) -> list[RequestOutput]:
        logger.exception("model step failed")
        self.num_step_errors += 1
        return [self._final(s.request, "error", (), error=f"{type(e).__name__}: {e}")
                for s in out.seqs if not s.request.is_finished]

    def _speculate(self, samplers, accepted: dict[str, int]) -> None:
        """Account for this step's drafts, then propose the next step's (if they pay at this batch size)."""
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
            # NOTE: positions after the first rejection were never tested: the rate is j of min(j + 1, k) trials
            req.draft_acceptance = 0.7 * req.draft_acceptance + 0.3 * j / min(j + 1, k)
            if not req.is_finished:
                self.proposer.rollback(req, req.num_computed_tokens)
        running = [r for r in self.scheduler.running if r.num_new_tokens == 1 and r.grammar is None]
        limit, batch = self.spec.disable_by_batch_size, len(self.scheduler.running)
        self._drafting, self._propose_s, self._catch_up = False, 0.0, 0
        if not running or (limit is not None and batch > limit) or (self.gate is not None and not self.gate.use(batch)):
            return
        self._drafting, start = True, time.perf_counter()
        caps = [min(self.spec.num_drafts(r.draft_acceptance), r.params.max_tokens - len(r.output_token_ids) - 1,
                    self.max_model_len - r.num_tokens - 1) for r in running]
        # NOTE: k drafts may emit k + 1 tokens: never more than max_tokens or the context allows
        chosen = [(r, c) for r, c in zip(running, caps) if c > 0]
        if chosen:
            drafts = self.proposer.propose([r for r, _ in chosen], [c for _, c in chosen])
            for (r, _), d in zip(chosen, drafts):
                r.draft_token_ids = d
            self._catch_up = self.proposer.max_catch_up
        self._propose_s = time.perf_counter() - start

    def _start_grammars(self) -> list[RequestOutput]:
        """Give each request whose grammar finished compiling its matcher; fail those that did not compile."""
        failed, pending = [], []
        for req in self.compiling:
            if req.is_finished:
                continue
            if not req.grammar.compiled.done():
                pending.append(req)
                continue
            error = req.grammar.start()
            req.stats.grammar_wait_s = time.monotonic() - req.stats.arrival_time
            req.stats.grammar_cache_hit = req.grammar.cache_hit
            if error is not None:
                failed.append(self._final(req, "error", (), error=error))
        self.compiling = pending
        return failed

    def _on_tokens(self, req: Request, tokens: tuple[int, ...], logprobs: tuple[TokenLogprob | None, ...],
                   now: float) -> RequestOutput | None:
        """Append a step's tokens (one, or accepted drafts and one) until one of them ends the sequence."""
        grammar, p, reason = req.grammar, req.params, None
        new: list[int] = []
        for token in tokens:
            if grammar is not None and not grammar.accept(token):
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
            elif grammar is not None and grammar.is_terminated:
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
            return RequestOutput(req.group_id, req.index, tuple(new), text, False, None, lps)
        return self._final(req, reason, tuple(new), lps)

    def _final(self, req: Request, reason: str, tokens: tuple[int, ...], lps: tuple = (), error: str | None = None) -> RequestOutput:
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
        return RequestOutput(req.group_id, req.index, tokens, text, True, reason, lps, req.stats, error)

    # ---- offline helper --------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[list[CompletionResult]]:
        """Run prompts to completion; results per prompt (one per sample), in input order."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [f"gen-{self.num_steps}-{i}" for i in range(len(prompts))]
        tokens: dict[tuple[str, int], list[int]] = {}
        texts: dict[tuple[str, int], list[str]] = {}
        logprobs: dict[tuple[str, int], list[TokenLogprob]] = {}
        finals: dict[tuple[str, int], RequestOutput] = {}
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, list(prompt), p)
        while self.has_unfinished():
            for o in self.step():
                key = (o.request_id, o.index)
                tokens.setdefault(key, []).extend(o.new_token_ids)
                texts.setdefault(key, []).append(o.new_text)
                logprobs.setdefault(key, []).extend(o.new_logprobs)
                if o.finished:
                    finals[key] = o
        results = []
        for rid, prompt, p in zip(ids, prompts, params_list):
            group = []
            for i in range(p.n):
                f, key = finals[(rid, i)], (rid, i)
                group.append(CompletionResult(rid, i, tuple(prompt), tuple(tokens.get(key, [])),
                                              "".join(texts.get(key, [])), f.finish_reason,
                                              tuple(logprobs.get(key, [])), f.stats))
            results.append(group)
        return results

