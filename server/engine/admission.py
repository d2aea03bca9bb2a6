"""Whether a request can ever be served, from the model's facts alone (no torch, no engine state).

The replica runs this once per request, before streaming anything, so bad input is a 400.
"""
from __future__ import annotations

from typing import Sequence

from kvcache.manager import cdiv
from server.engine.errors import InvalidRequestError
from server.engine.sampling_params import SamplingParams
from server.kv_forms import kv_bytes_at
from server.wire import ModelInfo


def validate_request(info: ModelInfo, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
    """Raise InvalidRequestError for anything that could never be served."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt must contain at least one token", "prompt")
    check_token_ids(info, prompt_token_ids, "prompt")
    # NOTE: as vLLM: a priority other than the default is refused unless the policy reads it
    if params.priority != 0 and info.scheduling_policy != "priority":
        raise InvalidRequestError(f"got priority {params.priority} but priority scheduling is not enabled "
                                  "(--scheduling-policy priority)", "priority")
    if n >= info.max_model_len:
        raise InvalidRequestError(f"prompt has {n} tokens but the model's context is {info.max_model_len} tokens",
                                  "prompt")
    if n + params.max_tokens > info.max_model_len:
        raise InvalidRequestError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} exceeds "
            f"the model's context of {info.max_model_len} tokens", "max_tokens")
    # NOTE: a windowed layer holds only its window's blocks: what the sequence needs at its longest
    block_bytes = info.kv_block_bytes or info.kv_bytes_per_token * info.block_size
    need = cdiv(kv_bytes_at(info.kv_bytes_per_token, info.layer_windows, info.block_size, n + params.max_tokens),
                block_bytes)
    if need > info.num_blocks:
        raise InvalidRequestError(
            f"prompt + max_tokens needs {need} KV blocks but the whole KV cache has {info.num_blocks}", "max_tokens")


def check_token_ids(info: ModelInfo, token_ids: Sequence[int], param: str) -> None:
    vocab = info.vocab_size
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
        raise InvalidRequestError(f"{param} token ids must be integers in [0, {vocab})", param)


def validate_embedding(info: ModelInfo, token_ids: Sequence[int]) -> None:
    """Raise InvalidRequestError for an embedding input that could never be served: it is only prefilled,
    so it may take the whole context."""
    n = len(token_ids)
    if n == 0:
        raise InvalidRequestError("each input must contain at least one token", "input")
    check_token_ids(info, token_ids, "input")
    if n > info.max_model_len:
        raise InvalidRequestError(f"an input has {n} tokens but the model's context is {info.max_model_len} tokens",
                                  "input")
    block_bytes = info.kv_block_bytes or info.kv_bytes_per_token * info.block_size
    need = cdiv(kv_bytes_at(info.kv_bytes_per_token, info.layer_windows, info.block_size, n), block_bytes)
    if need > info.num_blocks:
        raise InvalidRequestError(f"an input of {n} tokens needs {need} KV blocks but the whole KV cache has "
                                  f"{info.num_blocks}", "input")
