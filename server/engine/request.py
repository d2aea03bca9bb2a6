"""One sequence being generated (engine-side state); its accounting is a `wire.RequestStats`."""
from __future__ import annotations

import enum
import time

import torch

from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.grammar import SequenceGrammar
from server.engine.pooling import PooledPrompt
from server.engine.sampling_params import SamplingParams
from server.engine.thinking import Thinking
from server.wire import LoraRef, RequestStats, TokenLogprob


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer | None,
                 index: int = 0, group_id: str | None = None, arrival_time: float | None = None,
                 final_only: bool = False, prompt_logprobs: list[TokenLogprob] | None = None) -> None:
        self.request_id = request_id
        self.group_id = group_id or request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.detokenizer = detokenizer
        self.final_only = final_only  # one output when finished, none per step (non-streaming callers)
        self.text_parts: list[str] = []  # final_only: the text so far
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] = []
        # prompt_logprobs: per prompt token after the first, as the prefill's chunks compute them; one list
        # shared by a group's samples (the first computes it, its siblings then need none: prefix hits)
        self.prompt_logprobs = prompt_logprobs
        self.prompt_logprobs_sent = False  # on the sample's first output
        self.stats = RequestStats(arrival_time if arrival_time is not None else time.monotonic(), len(prompt_token_ids),
                                  n=params.n, max_tokens=params.max_tokens)
        self.grammar: SequenceGrammar | None = None  # constrained decoding (set by the engine)
        self.embedding: PooledPrompt | None = None  # an embedding request's pooling so far (set by the engine)
        self.thinking = Thinking(params.reasoning) if params.reasoning is not None else None  # a reasoning model's
        self.draft_token_ids: list[int] = []  # speculative decoding: proposed to follow, verified next step
        self.draft_acceptance = 1.0  # moving average of the fraction of drafts accepted (adaptive k)
        self.lora: LoraRef | None = None  # its LoRA adapter (set by the engine); None: the base model
        self.lora_slot: int | None = None  # the adapter's slot while it holds one (server/engine/lora_manager.py)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed((params.seed + index) % 2**63)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def priority(self) -> int:
        """Lower is served first under the priority policy (server/engine/scheduler.py)."""
        return self.params.priority

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_new_tokens(self) -> int:
        """Tokens whose K/V is not computed yet (1 while decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Some of its prompt's logprobs are still to compute: no prefix-cache hit may skip their positions."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_ready(self) -> bool:
        """False while its grammar compiles, or while its LoRA adapter waits for a slot: the scheduler
        passes over it meanwhile."""
        return (self.grammar is None or not self.grammar.is_pending) and (self.lora is None or self.lora_slot is not None)

    @property
    def cache_salt(self) -> bytes | None:
        """What roots its blocks' prefix-cache hashes: its adapter's salt; None for the base model."""
        return self.lora.salt if self.lora is not None else None

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int, now: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        s = self.stats
        if s.first_token_time is None:
            s.first_token_time = now
        else:
            s.inter_token_latencies.append(now - s.last_token_time)
        s.last_token_time = now
        s.num_output_tokens = len(self.output_token_ids)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, computed={self.num_computed_tokens}/{self.num_tokens}, {self.status.value})"
