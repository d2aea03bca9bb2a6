"""The synchronous engine core: one step at a time, outputs per sequence, stats as values.

No Ray and no asyncio here: the engine process (`server/engine/core.py`) drives this for a
replica, the CLI and the benchmarks drive it directly. A step is schedule -> run -> postprocess:
the scheduler picks the step, the runner runs it (server/engine/model_runner.py), the output
processor turns its tokens into outputs, and speculation proposes the next step's drafts.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Sequence

from models.lora_format import AdapterError
from models.native.memory import resident_bytes
from models.transformer import DecoderLM
from server.engine.admission import validate_request
from server.engine.assembly import assemble
from server.engine.config import EngineConfig
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.errors import InvalidRequestError
from server.engine.executor import WorkerDiedError
from server.engine.grammar import GrammarCache, SequenceGrammar, start_ready
from server.engine.lora_manager import LoraManager
from server.engine.model_runner import Batch
from server.engine.offline import CompletionResult, embed, generate
from server.engine.output_processor import OutputProcessor
from server.engine.pooling import PooledPrompt
from server.engine.request import Request
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.speculation import Speculation
from server.wire import EngineStats, LoraAnswer, LoraRef, RequestOutput

CACHED_FREE_EVERY_S = 0.25  # counting cached free blocks walks the prefix map: not every step


class LLMEngine:
    def __init__(self, config: EngineConfig, model: DecoderLM | None = None, tokenizer: Any = None) -> None:
        self.config = config
        self.parts = p = assemble(config, model, tokenizer)
        self.model, self.tokenizer, self.model_config, self.info = p.model, p.tokenizer, p.model_config, p.info
        self.runner, self.cache, self.executor, self.kv, self.kv_spec = p.runner, p.cache, p.executor, p.kv, p.kv_spec
        self.spec, self.proposer, self.cpu_path, self.weight_bytes = p.spec, p.proposer, p.cpu_path, p.weight_bytes
        self.pooling = p.pooling  # an embedding model's (server/engine/pooling.py); None: generation only
        self.eos_token_ids, self.max_model_len, self.num_blocks = p.eos_token_ids, p.max_model_len, p.num_blocks
        # the LoRA adapters in the runner's slots; None: LoRA is off (max_loras 0)
        self.loras = LoraManager(p.lora_slots) if p.lora_slots is not None else None
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   self.kv_spec.bytes_per_block,
                                   on_free=(lambda r: self.proposer.release(r.request_id)) if self.proposer else None,
                                   policy=config.scheduling_policy,
                                   on_finish=self._release_lora if self.loras is not None else None,
                                   cache_output_blocks=not self.runner.prompt_tiles)
        self.outputs = OutputProcessor(self.scheduler, p.eos_token_ids, p.max_model_len)
        self.groups = self.outputs.groups  # NOTE: the one dict of unfinished requests, the processor's
        self.speculation = Speculation(p.spec, p.proposer, self.scheduler, p.max_model_len) if p.spec else None
        self.gate = self.speculation.gate if self.speculation is not None else None
        self.grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size, p.eos_token_ids)
        self.compiling: list[Request] = []  # constrained requests whose grammar is not ready yet
        self.last_step_empty = False  # nothing could run (e.g. every request waits for its grammar)
        self.in_flight: deque[tuple[SchedulerOutput, Batch, Any]] = deque()  # steps submitted, not finished
        self.num_steps = self.num_step_errors = self.num_adds_received = 0
        self._cached_free = (0.0, 0)  # (when counted, count)

    # ---- admission -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    arrival_time: float | None = None, final_only: bool = False, lora: LoraRef | None = None) -> None:
        """Validate, then queue. Raises InvalidRequestError for anything that could never be served (and
        models.lora_format.AdapterError for a LoRA adapter that cannot be)."""
        validate_request(self.info, prompt_token_ids, params)
        self.add_validated(request_id, prompt_token_ids, params, arrival_time, final_only, lora=lora)

    def add_validated(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      arrival_time: float | None = None, final_only: bool = False, embed: bool = False,
                      lora: LoraRef | None = None) -> None:
        """Queue a request its replica already validated (requests are validated once).

        With `final_only`, each sample yields one output, when it finishes, holding all its tokens,
        text and logprobs: a non-streaming caller gets no message per step. With `embed`, the prompt is
        prefilled (in the same steps as generation) and pooled, and its one output carries its embedding.
        With `lora`, it runs with that LoRA adapter, loaded now if it is not resident."""
        self.num_adds_received += 1
        if request_id in self.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if embed and (self.pooling is None or params.n != 1):
            raise InvalidRequestError("this model does not serve embeddings (its task is generate)"
                                      if self.pooling is None else "an embedding request has one sample", "model")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        prompt_logprobs = [] if params.prompt_logprobs is not None else None  # NOTE: the samples share one
        group = [Request(request_id if params.n == 1 else f"{request_id}#{i}", list(prompt_token_ids), params,
                         None if embed else self._detokenizer(prompt_token_ids, params), index=i, group_id=request_id,
                         arrival_time=arrival, final_only=final_only, prompt_logprobs=prompt_logprobs)
                 for i in range(params.n)]
        if lora is not None:  # NOTE: before anything else holds the group: a bad adapter leaves nothing behind
            if self.loras is None:
                raise InvalidRequestError("this engine serves no LoRA adapters (max_loras is 0)", "model")
            self.loras.acquire(lora, group)
        if params.structured is not None:
            compiled, cache_hit = self.grammars.get(params.structured)
            for req in group:
                req.grammar = SequenceGrammar(params.structured, compiled, cache_hit)
                req.stats.structured = params.structured.label
            self.compiling.extend(group)
        if embed:
            group[0].embedding = PooledPrompt(self.pooling)
        self.groups[request_id] = group
        self.scheduler.add(group)

    def _detokenizer(self, prompt: Sequence[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt, params.stop, params.skip_special_tokens)

    def load_lora(self, ref: LoraRef, request_id: str = "") -> LoraAnswer:
        """Make an adapter resident (in a slot, or waiting for one while every slot is pinned)."""
        if self.loras is None:
            return LoraAnswer(request_id, "this engine serves no LoRA adapters (max_loras is 0)", 400)
        try:
            return LoraAnswer(request_id, seconds=self.loras.load(ref))
        except AdapterError as e:
            return LoraAnswer(request_id, str(e), e.status)

    def unload_lora(self, name: str, request_id: str = "") -> LoraAnswer:
        """Drain an adapter: new requests for it are refused, those in flight finish, then its slot is cleared."""
        if self.loras is None or not self.loras.unload(name):
            return LoraAnswer(request_id, f"no LoRA adapter named {name!r} is loaded", 404)
        return LoraAnswer(request_id)

    def _release_lora(self, req: Request) -> None:
        if req.lora is not None:
            self.loras.release(req)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Abort every sample of a request; frees its blocks. Unknown / finished ids are a no-op."""
        return self.outputs.abort(request_id)

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
            num_generated_tokens=self.outputs.num_generated_tokens, num_prefix_queries=sch.num_prefix_queries,
            num_prefix_hits=sch.num_prefix_hits, num_preemptions=sch.num_preemptions, num_steps=self.num_steps,
            num_step_errors=self.num_step_errors, num_adds_received=self.num_adds_received,
            resident_memory_bytes=resident_bytes()[0], preemptions_by_priority=dict(sch.preemptions_by_priority),
            **self._lora_stats())

    def _lora_stats(self) -> dict[str, Any]:
        if self.loras is None:
            return {}
        return dict(num_lora_loads=self.loras.num_loads, num_lora_evictions=self.loras.num_evictions,
                    lora_load_seconds=self.loras.load_seconds, resident_loras=self.loras.resident(),
                    running_loras=_adapters(self.scheduler.running), waiting_loras=_adapters(self.scheduler.waiting))

    # ---- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and start steps until `runner.depth` are in flight (one, unless pipeline stages keep
        several), then finish the oldest: its tokens, as outputs."""
        start = time.perf_counter()
        failed = self._start_grammars() if self.compiling else []
        failed += self._schedule_and_submit()
        self.last_step_empty = not self.in_flight
        if not self.in_flight:
            return failed
        out, batch, pending = self.in_flight.popleft()
        try:
            result = self.runner.finish(batch, pending)
            pooled = self.runner.pooled(batch, pending)  # per embedding request of the step: its rows
        except WorkerDiedError:
            raise
        except Exception as e:
            return failed + self._fail(out, e)
        # NOTE: which sequences sampled is read before `advance`, which moves them on
        samplers = [s for s in out.seqs if s.samples]
        self.outputs.add_prompt_logprobs(result.prompt_logprobs)  # NOTE: before the first output carries them
        outputs = self.outputs.process(samplers, result.token_ids, result.logprobs)
        # NOTE: before `advance`: an embedding request ends in the step that finishes its prompt, and its
        # blocks are freed at once, never cached
        outputs += self.outputs.pool([s for s in out.seqs if s.request.embedding is not None], pooled)
        # NOTE: after the tokens are appended: accepted drafts become computed tokens, hashed into full blocks
        accepted = {s.request.request_id: len(t) - 1 for s, t in zip(samplers, result.token_ids) if s.draft_token_ids}
        self.scheduler.advance(out, accepted)
        if self.speculation is not None:
            self.speculation.after_step(out, samplers, result.token_ids, accepted, time.perf_counter() - start)
        return failed + outputs

    def _schedule_and_submit(self) -> list[RequestOutput]:
        failed: list[RequestOutput] = []
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
                failed += self._fail(out, e)
        return failed

    def _fail(self, out: SchedulerOutput, e: Exception) -> list[RequestOutput]:
        self.num_step_errors += 1
        return self.outputs.fail(out, e)

    def _start_grammars(self) -> list[RequestOutput]:
        """Matchers for the requests whose grammar finished compiling; errors for those that did not compile."""
        failed, self.compiling = start_ready(self.compiling)
        return [self.outputs.final(req, "error", (), error=error) for req, error in failed]

    # ---- offline ---------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 lora: LoraRef | Sequence[LoraRef | None] | None = None) -> list[list[CompletionResult]]:
        """Run prompts to completion; results per prompt (one per sample), in input order. `lora`: one
        adapter for every prompt, or one (or None: the base model) per prompt."""
        return generate(self, prompts, params, lora)

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[Any]:
        """Each prompt's embedding (an embedding model's engine), in input order: (hidden,) float32 numpy."""
        return embed(self, prompts)


def _adapters(requests) -> tuple[str, ...]:
    """The LoRA adapters of `requests`, by name, each once."""
    return tuple(dict.fromkeys(r.lora.name for r in requests if r.lora is not None))
