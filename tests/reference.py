"""Greedy decoding oracles: HF transformers, and our model with no cache at all."""
from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    """HF forward with its own KV cache, greedy, exactly `num_tokens` new tokens (EOS does not stop it)."""
    return hf_greedy_logprobs(hf_model, prompt, num_tokens)[0]


@torch.no_grad()
def hf_greedy_logprobs(hf_model, prompt: list[int], num_tokens: int, top: int = 5):
    """hf_greedy, plus each step's `top` (token id -> logprob) alternatives."""
    out, tops, past, step = [], [], None, torch.tensor([prompt])
    for _ in range(num_tokens):
        res = hf_model(input_ids=step, cache=past, use_cache=True)
        past = res.cache
        logprobs = res.logits[0, -1].float().log_softmax(-1)
        values, ids = logprobs.topk(top)
        tops.append(dict(zip(ids.tolist(), values.tolist())))
        out.append(int(logprobs.argmax()))
        step = torch.tensor([[out[-1]]])
    return out, tops


# bf16 logprobs of two correct implementations differ by a few tenths on these tiny random models
# (HF's own bf16 logits are up to 0.2 off its fp32 ones), more after a long bf16 KV history, so
# their greedy picks may differ where the top two are that close.
NEAR_TIE = 0.6


def assert_greedy_close(ours: list[int], our_tops: list[dict[int, float]], theirs: list[int],
                        their_tops: list[dict[int, float]], what: str = "") -> None:
    """Equal tokens up to the first difference, which must be a near-tie for both sides (the
    sequences go their own ways after it). The check vLLM's tests make for reduced precision."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        assert a in their_tops[i] and b in our_tops[i], f"{what}: token {i} ({a} vs {b}) is not a near-tie"
        assert their_tops[i][b] - their_tops[i][a] <= NEAR_TIE and our_tops[i][a] - our_tops[i][b] <= NEAR_TIE, (
            f"{what}: token {i}: ours {a}, HF {b}; HF logprobs {their_tops[i]}, ours {our_tops[i]}")
        return


def first_divergences(refs, gots) -> tuple[list[int], list[float]]:
    """Per pair of greedy outputs (with logprobs): how many leading tokens agree, and at each first
    divergence the reference's logprob gap between its token and the other's, which must be one of the
    reference's top candidates (a near-tie flipped, not a broken path)."""
    leading, gaps = [], []
    for ref, got in zip(refs, gots, strict=True):
        i = next((i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b), None)
        leading.append(len(ref.token_ids) if i is None else i)
        if i is not None:
            top = dict(ref.logprobs[i].top)
            assert got.token_ids[i] in top, (i, top)  # a candidate the reference weighed
            gaps.append(top[ref.token_ids[i]] - top[got.token_ids[i]])
    return leading, gaps


@torch.no_grad()
def dense_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Our model re-run over the whole sequence each step: no cache, nothing to get wrong."""
    ids = list(prompt)
    for _ in range(num_tokens):
        hidden = model(torch.tensor(ids), torch.arange(len(ids)))
        ids.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return ids[len(prompt):]


def load_hf(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def memoised_greedy(hf, num_tokens: int):
    """prompt -> HF's greedy continuation and top logprobs (hf_greedy_logprobs), each prompt run once."""
    memo = {}

    def expected(prompt):
        key = tuple(prompt)
        if key not in memo:
            memo[key] = hf_greedy_logprobs(hf, list(prompt), num_tokens)
        return memo[key]
    return expected


def tiny_oracle(checkpoints, num_tokens: int):
    """(arch, dtype) -> (our model, tokenizer, memoised HF greedy continuation and top logprobs in that
    dtype), each loaded once: the oracle engine parity tests share."""
    from models import load_model, load_tokenizer

    cache = {}

    def get(arch, dtype="float32"):
        if (arch, dtype) not in cache:
            path = checkpoints[arch]
            expected = memoised_greedy(load_hf(path, dtype=getattr(torch, dtype)), num_tokens)
            cache[(arch, dtype)] = (load_model(path, dtype), load_tokenizer(path), expected)
        return cache[(arch, dtype)]
    return get


def generate_and_check(engine, prompts, params, expected):
    """Run `prompts` through `engine` and compare with HF's greedy tokens (`expected(prompt)` ->
    tokens, top logprobs): fp32 exactly, bf16 up to a first difference that is a near-tie. Every
    block is back and nothing is left running afterwards. Returns the results."""
    results = engine.generate(prompts, params)
    for prompt, group in zip(prompts, results):
        theirs, their_tops = expected(prompt)
        ours = list(group[0].token_ids)
        if engine.config.dtype == "float32":
            assert ours == theirs, f"prompt of {len(prompt)} tokens diverged"
        else:
            our_tops = [dict(lp.top) for lp in group[0].logprobs]
            assert_greedy_close(ours, our_tops, theirs, their_tops, f"prompt of {len(prompt)} tokens")
        assert group[0].finish_reason == "length"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # every block back after every request
    assert not engine.scheduler.running and not engine.scheduler.waiting
    return results
