"""Turns a SchedulerOutput into tensors, runs the model over the paged cache, samples."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcache.paged_attention import AttentionMetadata, PagedAttention
from kvcache.storage import PagedKVCache
from models.transformer import DecoderLM
from server.engine.request import TokenLogprob
from server.engine.sampler import SamplingBatch, sample
from server.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class Batch:
    """One step's model inputs, packed: decodes first, then prefill chunks."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # (S,) row of the last token of each sampling sequence
    sampling: SamplingBatch


@dataclass(frozen=True)
class StepResult:
    """Sampled tokens, aligned with the sequences of SchedulerOutput that sample."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob | None, ...]


class ModelRunner:
    def __init__(self, model: DecoderLM, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device

    def prepare(self, out: SchedulerOutput) -> Batch:
        ids: list[int] = []
        positions: list[np.ndarray] = []
        logits_rows: list[int] = []
        sampling = [s.request for s in out.seqs if s.samples]
        for s in out.seqs:
            c, n = s.num_computed_tokens, s.num_new_tokens
            ids.extend(s.request.all_token_ids[c:c + n])
            positions.append(np.arange(c, c + n))
            if s.samples:
                logits_rows.append(len(ids) - 1)
        attn = AttentionMetadata.build(
            [s.num_new_tokens for s in out.seqs], [s.num_computed_tokens for s in out.seqs],
            [s.block_ids for s in out.seqs], self.cache.spec.block_size, out.num_decodes, self.device,
            self.cache.spec.dtype,
        )
        return Batch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.from_numpy(np.concatenate(positions)).to(self.device),
            attn=attn,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=self.device),
            sampling=SamplingBatch(
                params=tuple(r.params for r in sampling),
                generators=tuple(r.generator for r in sampling),
                prompt_token_ids=tuple(r.prompt_token_ids for r in sampling),
                output_token_ids=tuple(r.output_token_ids for r in sampling),
            ),
        )

    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepResult:
        hidden = self.model(batch.input_ids, batch.positions, PagedAttention(self.cache, batch.attn))  # (T, C)
        if not len(batch.logits_indices):
            return StepResult((), ())
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # (S, V) fp32
        tokens, logprobs = sample(logits, batch.sampling)
        return StepResult(tuple(tokens), tuple(logprobs))
