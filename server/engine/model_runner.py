"""Turns a SchedulerOutput into tensors, runs the model over the paged cache, samples."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvcache.paged_attention import AttentionMetadata, PagedAttention, warm_up_steps
from kvcache.storage import KVCacheSpec, PagedKVCache
from models.lora import LoraMetadata, LoraSlots, LoraStep
from models.transformer import DecoderLM
from server.engine.grammar import apply_bitmask, fill_bitmask
from server.engine.rejection_sampler import verify
from server.engine.request import Request
from server.engine.sampler import SamplingBatch, prompt_logprobs, sample, score_prompt_rows
from server.engine.scheduler import SchedulerOutput
from server.engine.shard_worker import StepInputs
from server.engine.step import choose_step
from server.engine.thinking import constraint
from server.wire import TokenLogprob

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptRows:
    """A step's prompt positions whose next token's logprob their request asked for (prompt_logprobs):
    their logits rows follow the sampling rows in `Batch.logits_indices`."""

    targets: tuple[int, ...]  # (M,) the prompt token each row predicts
    ks: tuple[int, ...]  # (M,) alternatives per row
    seqs: tuple[tuple[Request, int, int], ...]  # (request, index of its first prompt logprob here, rows)


@dataclass(frozen=True)
class Batch:
    """One step's model inputs, packed: decodes first, then prefill chunks."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # (R,) the rows that sample: each sampling sequence's last token and drafts
    sampling: SamplingBatch  # one entry per logits row
    grammar_masks: tuple[torch.Tensor, list[int]] | None = None  # (R, V/32) allowed-token bits, their rows
    draft_token_ids: tuple[tuple[int, ...], ...] | None = None  # per sampling sequence, when any has drafts
    prompt_rows: PromptRows | None = None  # rows after the sampling ones: prompt positions to score
    pooling_rows: torch.Tensor | None = None  # (P,) the rows embedding requests pool (server/engine/pooling.py)
    pooling_counts: tuple[int, ...] = ()  # per embedding sequence of the step, in order: its rows among them
    lora: LoraMetadata | None = None  # the rows that have a LoRA adapter, by slot; None: no row has one
    # (T,) bool: the rows that are prompt tokens, where the runner takes them on a prompt kernel (`prompt_tiles`)
    # and the step has any; None: every row on the int8-activation kernel
    prompt_tokens: torch.Tensor | None = None

    @property
    def num_sampling_rows(self) -> int:
        return len(self.logits_indices) - (len(self.prompt_rows.targets) if self.prompt_rows is not None else 0)


@dataclass(frozen=True)
class StepResult:
    """Per sequence of SchedulerOutput that samples: its new tokens (accepted drafts, then one
    sampled token) and their logprobs (None where not asked for)."""

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[TokenLogprob | None, ...], ...]
    # per request scored (prompt_logprobs): (request, index of its first prompt logprob here, them)
    prompt_logprobs: tuple[tuple[Request, int, tuple[TokenLogprob, ...]], ...] = ()


@dataclass(frozen=True)
class Pending:
    """A step `submit` started: its sampling rows' logits (r, V) or None, its pooled rows (P, C) fp32 or
    None, and its prompt rows' scores (`Batch.prompt_rows`, in order) or None."""

    logits: torch.Tensor | None
    pooled: torch.Tensor | None
    prompt_scores: list[TokenLogprob] | None = None


class ModelRunner:
    """Runs steps through the native decoder where it covers the model, else the compiled model
    (the eager one with `compile=False`). `step` names which: native, compiled or eager. With
    `lora_slots`, the rows of requests that hold a slot (`Request.lora_slot`) get its adapter's deltas."""

    def __init__(self, model: DecoderLM, cache: PagedKVCache, compile: bool = True, native: bool = True,
                 lora_slots: LoraSlots | None = None) -> None:
        self.model = model
        self.cache = cache
        self.lora_slots = lora_slots
        self.spec, self.vocab_size = cache.spec, model.config.vocab_size
        self.device = model.device
        self.depth = 1  # steps in flight at once (pipeline stages keep several)
        step = choose_step(model, cache, compile, native, self._warm_up, "model", lora_slots)
        self.forward, self.step, self.compile_seconds = step.forward, step.kind, step.seconds
        # NOTE: only the native decoder passes a step's prompt rows to the linears: elsewhere every row takes the
        # int8 kernel, and the model's path says so
        self.prompt_tiles = bool(model.cpu_path is not None and model.cpu_path.prompt_activations)
        if self.prompt_tiles and self.step != "native":
            logger.info("attnserve: prompt tokens take the %s kernel too: the %s step passes no prompt rows",
                        model.cpu_path.activations, self.step)
            model.cpu_path = dataclasses.replace(model.cpu_path, prompt_activations="")
            self.prompt_tiles = False

    def _warm_up(self, forward) -> None:
        """Compile (or load from the disk cache) before serving: a prefill step, then a decode.

        Inputs are made as `prepare` makes them (outside inference mode), so the guards that
        compiling records are the ones real steps pass (kvcache.paged_attention.warm_up_steps).
        With LoRA slots each step runs again with every row on slot 0: the graph with the deltas
        compiles here too (their output, like the dummy K/V, is never read).
        """
        for ids, positions, meta in warm_up_steps(self.spec, self.device):
            with torch.inference_mode():
                forward(ids, positions, PagedAttention(self.cache, meta))
            if self.lora_slots is not None:
                lora = LoraStep(self.lora_slots, _on(LoraMetadata.of([0] * len(ids)), self.device))
                with torch.inference_mode():
                    forward(ids, positions, PagedAttention(self.cache, meta), lora=lora)

    def prepare(self, out: SchedulerOutput) -> Batch:
        ids: list[int] = []
        positions: list[np.ndarray] = []
        logits_rows: list[int] = []
        rows: list[tuple] = []  # per logits row: (request, output tokens so far, grammar)
        scored: tuple[list[int], list[int], list[int], list[tuple]] = ([], [], [], [])  # PromptRows' + their rows
        pool_rows: list[int] = []
        pool_counts: list[int] = []
        prompt_tokens: list[np.ndarray] = []  # per sequence, which of its rows are prompt tokens
        row_slots: list[int | None] = []  # per row its LoRA slot (drafts' too: verification uses the adapter)
        for s in out.seqs:
            c, n, req, drafts = s.num_computed_tokens, s.num_new_tokens, s.request, s.draft_token_ids
            row_slots.extend([req.lora_slot] * s.query_len)
            if req.needs_prompt_logprobs:
                _score_prompt(req, c, n, len(ids), *scored)
            ids.extend(req.all_token_ids[c:c + n])
            ids.extend(drafts)
            positions.append(np.arange(c, c + s.query_len))
            if self.prompt_tiles:  # NOTE: by position, so a preempted request's recomputed output tokens stay output tokens
                prompt_tokens.append(positions[-1] < req.num_prompt_tokens)
            if req.embedding is not None:
                chosen = req.embedding.rows(c, n, req.num_tokens)
                pool_rows.extend(len(ids) - n + i for i in chosen)
                pool_counts.append(len(chosen))
            if s.samples:
                first = len(ids) - 1 - len(drafts)
                logits_rows.extend(range(first, len(ids)))
                rows.append((req, req.output_token_ids, constraint(req.thinking, req.grammar)))
                # NOTE: row i of a sequence with drafts follows drafts[:i]: its penalties count them as output
                # (a constrained request, or one whose next token is forced, gets no drafts: masks stay one
                # row per sequence; drafts stop short of a thinking budget: server/engine/thinking.py)
                rows.extend((req, req.output_token_ids + list(drafts[:i + 1]) if req.params.has_penalties else
                             req.output_token_ids, None) for i in range(len(drafts)))
        attn = AttentionMetadata.build_groups(
            [s.query_len for s in out.seqs], [s.num_computed_tokens for s in out.seqs],
            list(zip(*(s.block_ids for s in out.seqs))), self.spec.block_size, self.device,
        )
        # NOTE: a matcher's state is its sequence's tokens so far, so the masks are filled before the step
        masks = fill_bitmask([g for _, _, g in rows], self.vocab_size)
        drafts = tuple(s.draft_token_ids for s in out.seqs if s.samples)
        targets, ks, prompt_rows, seqs = scored
        logits_rows.extend(prompt_rows)
        # NOTE: a runner without slots (a draft model's) runs every row on its base model
        lora = None
        if self.lora_slots is not None and any(slot is not None for slot in row_slots):
            lora = _on(LoraMetadata.of(row_slots), self.device)
        return Batch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.from_numpy(np.concatenate(positions)).to(self.device),
            attn=attn,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=self.device),
            sampling=SamplingBatch(
                params=tuple(r.params for r, _, _ in rows),
                generators=tuple(r.generator for r, _, _ in rows),
                prompt_token_ids=tuple(r.prompt_token_ids for r, _, _ in rows),
                output_token_ids=tuple(o for _, o, _ in rows),
            ),
            grammar_masks=masks,
            draft_token_ids=drafts if any(drafts) else None,
            prompt_rows=PromptRows(tuple(targets), tuple(ks), tuple(seqs)) if seqs else None,
            pooling_rows=torch.tensor(pool_rows, dtype=torch.long, device=self.device) if pool_counts else None,
            pooling_counts=tuple(pool_counts),
            lora=lora,
            prompt_tokens=_prompt_tokens(prompt_tokens, self.device),
        )

    def execute(self, batch: Batch) -> StepResult:
        return self.finish(batch, self.submit(batch))

    @torch.inference_mode()
    def submit(self, batch: Batch) -> Pending:
        """Start the step: here the model runs at once. NOTE: a step with no adapter row calls the model
        without `lora`, so it runs no LoRA code (and the compiled graph without it)."""
        attention = PagedAttention(self.cache, batch.attn)
        rows = {} if batch.prompt_tokens is None else {"prompt_tokens": batch.prompt_tokens}
        if batch.lora is None:
            hidden = self.forward(batch.input_ids, batch.positions, attention, **rows)  # (T, C)
        else:
            hidden = self.forward(batch.input_ids, batch.positions, attention, lora=LoraStep(self.lora_slots, batch.lora),
                                  **rows)
        pooled = hidden[batch.pooling_rows].float() if batch.pooling_rows is not None else None  # (P, C)
        if not len(batch.logits_indices):
            return Pending(None, pooled)
        rows, r = hidden[batch.logits_indices], batch.num_sampling_rows  # (R, C)
        logits = self.model.logits(rows[:r]) if r else None  # (r, V) in the model's dtype
        if batch.prompt_rows is None:
            return Pending(logits, pooled)
        scores = score_prompt_rows(self.model.logits, rows[r:], batch.prompt_rows.targets, batch.prompt_rows.ks)
        return Pending(logits, pooled, scores)

    @torch.inference_mode()
    def finish(self, batch: Batch, pending) -> StepResult:
        """The step's tokens, sampled from its logits (`pending`: what `submit` returned)."""
        logits = self.logits_of(pending)
        scored: list[tuple[Request, int, tuple[TokenLogprob, ...]]] = []
        if batch.prompt_rows is not None:  # NOTE: from the raw logits, before any mask or sampling field
            values, at = self.prompt_scores(batch, pending, logits), 0
            for req, first, m in batch.prompt_rows.seqs:
                scored.append((req, first, tuple(values[at:at + m])))
                at += m
        r = batch.num_sampling_rows
        if not r:
            return StepResult((), (), tuple(scored))
        logits = logits[:r]
        if batch.grammar_masks is not None:
            apply_bitmask(logits, batch.grammar_masks)  # every sampling field then applies inside the mask
        if batch.draft_token_ids is not None:
            tokens, logprobs = verify(logits, batch.sampling, batch.draft_token_ids)
            return StepResult(tuple(map(tuple, tokens)), tuple(map(tuple, logprobs)), tuple(scored))
        tokens, logprobs = sample(logits, batch.sampling)
        return StepResult(tuple((t,) for t in tokens), tuple((lp,) for lp in logprobs), tuple(scored))

    def logits_of(self, pending):
        return pending.logits

    def prompt_scores(self, batch: Batch, pending, logits) -> list[TokenLogprob]:
        return pending.prompt_scores

    def pooled(self, batch: Batch, pending) -> tuple[torch.Tensor, ...]:
        """Per embedding sequence of the step, in order: the (k, C) fp32 hidden-state rows its pooling reads."""
        if pending.pooled is None:
            return ()
        return torch.split(pending.pooled, list(batch.pooling_counts))


def _prompt_tokens(per_seq: list[np.ndarray], device: torch.device) -> torch.Tensor | None:
    """The step's (T,) prompt-token rows, or None where it has none (a decode step runs as it would without)."""
    if not per_seq or not any(rows.any() for rows in per_seq):
        return None
    return torch.from_numpy(np.concatenate(per_seq)).to(device)


def _on(meta: LoraMetadata, device: torch.device) -> LoraMetadata:
    """The step's LoRA rows on the model's device (LoraMetadata.of builds them on the CPU)."""
    if device.type == "cpu":
        return meta
    return LoraMetadata(meta.rows.to(device), meta.seg_start.to(device), meta.seg_slot.to(device))


def _score_prompt(req: Request, c: int, n: int, offset: int, targets: list[int], ks: list[int], rows: list[int],
                  seqs: list[tuple]) -> None:
    """The rows of this chunk (`n` tokens from position `c`, packed from `offset`) whose logits give the
    prompt logprobs `req` still lacks: position p's row predicts prompt token p + 1.

    NOTE: a chunk never starts past the first missing one (no prefix hit skips it: the scheduler), and a
    preempted request recomputes from 0 the positions it already has, which are not scored twice."""
    have = len(req.prompt_logprobs)
    lo, hi = max(c, have), min(c + n, req.num_prompt_tokens - 1)
    if lo >= hi:
        return
    targets.extend(req.prompt_token_ids[lo + 1:hi + 1])
    ks.extend([req.params.prompt_logprobs] * (hi - lo))
    rows.extend(range(offset + lo - c, offset + hi - c))
    seqs.append((req, lo, hi - lo))


class DistributedRunner(ModelRunner):
    """The same steps over a model sharded across Ray workers (server/engine/executor.py): the
    batch is packed and sampled here, the layers run on the ranks; with pipeline stages, as many
    steps as stages are in flight."""

    def __init__(self, executor, spec: KVCacheSpec, vocab_size: int, num_blocks: int) -> None:
        self.executor, self.spec, self.vocab_size = executor, spec, vocab_size
        self.model, self.cache, self.device = None, None, torch.device("cpu")
        self.lora_slots = None  # NOTE: EngineConfig refuses LoRA with tensor or pipeline parallelism
        self.prompt_tiles = False  # NOTE: the ranks' steps take no prompt rows: every row on the int8 kernel
        start = time.perf_counter()
        self.step = executor.init_cache(num_blocks)
        self.compile_seconds = time.perf_counter() - start
        self.depth = executor.pipeline_parallel_size

    def submit(self, batch: Batch):
        return self.executor.submit(StepInputs(batch.input_ids, batch.positions, batch.attn, batch.logits_indices))

    def logits_of(self, pending):
        return self.executor.result(pending)

    def prompt_scores(self, batch: Batch, pending, logits) -> list[TokenLogprob]:
        """The last stage returns every logits row, the prompt rows' after the sampling ones."""
        rows = batch.prompt_rows
        return prompt_logprobs(logits[batch.num_sampling_rows:], rows.targets, rows.ks)

    def pooled(self, batch: Batch, pending) -> tuple[torch.Tensor, ...]:
        return ()  # NOTE: no embedding requests here: EngineConfig refuses task embed with tensor or pipeline parallelism
