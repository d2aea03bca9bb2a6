"""Sampling: seeds, filters, penalties, stop strings, logprobs, n > 1."""
import math

import pytest
import torch

from models import load_model, load_tokenizer
from server.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from server.engine.sampler import SamplingBatch, apply_filters, apply_penalties, greedy, sample


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    path = tiny_checkpoints["qwen2"]
    return LLMEngine(EngineConfig(model="tiny", dtype="float32", num_blocks=256, block_size=4),
                     model=load_model(path), tokenizer=load_tokenizer(path))


def prompt(engine, text="The capital of France is"):
    return engine.tokenizer(text)["input_ids"]


def one(engine, p, **kw):
    return engine.generate([p], SamplingParams(**kw))[0]


def batch_of(params, prompts=None, outputs=None):
    n = len(params)
    return SamplingBatch(tuple(params), (None,) * n, tuple(prompts or [[]] * n), tuple(outputs or [[]] * n))


def test_seed_reproducible_and_batch_independent(engine):
    p = prompt(engine)
    a = one(engine, p, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)[0].token_ids
    b = one(engine, p, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)[0].token_ids
    c = one(engine, p, max_tokens=16, temperature=1.0, seed=8, ignore_eos=True)[0].token_ids
    assert a == b and a != c
    others = [prompt(engine, t) for t in ["Simple is better", "0 1 2 3 4", "Readability counts."]]
    mixed = engine.generate([p, *others], [SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)]
                            + [SamplingParams(max_tokens=16, temperature=1.3, ignore_eos=True)] * 3)
    assert mixed[0][0].token_ids == a  # neighbours in the batch do not change a seeded sample


def test_top_k_1_equals_greedy(engine):
    p = prompt(engine)
    greedy = one(engine, p, max_tokens=20, temperature=0, ignore_eos=True)[0].token_ids
    topk1 = one(engine, p, max_tokens=20, temperature=1.5, top_k=1, ignore_eos=True)[0].token_ids
    assert greedy == topk1


def test_stop_strings_are_trimmed(engine):
    p = prompt(engine)
    full = one(engine, p, max_tokens=30, temperature=0, ignore_eos=True)[0]
    stop = full.text[10:14]
    assert len(stop) == 4 and full.text.find(stop) >= 1
    cut = one(engine, p, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop, "\u2603never"])[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert stop not in cut.text and len(cut.token_ids) < len(full.token_ids)


def test_stop_token_ids_and_max_tokens(engine):
    p = prompt(engine)
    full = one(engine, p, max_tokens=12, temperature=0, ignore_eos=True)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stopper = full.token_ids[5]
    cut = one(engine, p, max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stopper])[0]
    assert cut.finish_reason == "stop" and cut.token_ids == full.token_ids[: full.token_ids.index(stopper) + 1]


def test_penalties_change_logits_as_specified():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = [SamplingParams(repetition_penalty=2.0)]
    out = apply_penalties(logits, batch_of(params, prompts=[[0]], outputs=[[1]]))
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]  # seen positive / 2, seen negative * 2
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)]
    out = apply_penalties(logits, batch_of(params, prompts=[[3]], outputs=[[2, 2, 0]]))
    # token 2 seen twice: 1 - 0.5*2 - 0.25; token 0 once: 2 - 0.5 - 0.25; prompt tokens untouched
    assert out.tolist() == [[1.25, -2.0, -0.25, 0.5]]
    same = apply_penalties(logits, batch_of([SamplingParams()], outputs=[[0, 1]]))
    assert torch.equal(same, logits)


def test_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda p: torch.isfinite(apply_filters(logits, [p])).tolist()[0]  # noqa: E731
    assert kept(SamplingParams(top_k=2)) == [True, True, False, False]
    assert kept(SamplingParams(top_p=0.7)) == [True, True, False, False]
    assert kept(SamplingParams(top_p=0.5)) == [True, False, False, False]
    assert kept(SamplingParams(min_p=0.25)) == [True, True, True, False]
    assert kept(SamplingParams(top_p=1e-9)) == [True, False, False, False]


def test_a_row_with_no_mass_or_a_tiny_temperature_still_gets_a_token_of_the_vocabulary():
    """A tiny temperature once made +-inf logits (NaN softmax) and an all-masked row a NaN cdf:
    searchsorted then answered V, and the next step's embedding lookup failed the whole batch."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5], [float("-inf")] * 4, [0.1, 0.2, 0.9, 0.3]])
    params = [SamplingParams(temperature=1e-40), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=1.0, logprobs=1, seed=2)]
    tokens, logprobs = sample(logits, batch_of(params))
    assert tokens[0] == 1 and tokens[1] == 0 and 0 <= tokens[2] < 4
    assert logprobs[2] is not None and logprobs[2].token_id == tokens[2]


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    tokens, _ = sample(logits, batch_of([SamplingParams(temperature=1.0)] * 4000))
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_logprobs_with_alternatives(engine):
    p = prompt(engine)
    r = one(engine, p, max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)[0]
    assert len(r.logprobs) == 8
    for tok_id, lp in zip(r.token_ids, r.logprobs):
        assert lp.token_id == tok_id and lp.logprob <= 0
        assert len(lp.top) == 5 and lp.top[0][0] == tok_id  # greedy picks the top alternative
        assert sum(math.exp(v) for _, v in lp.top) <= 1 + 1e-6
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_n_samples_share_the_prompt_blocks(engine):
    p = prompt(engine, "Beautiful is better than ugly. Explicit is better than implicit. Simple")
    before = engine.scheduler.num_prefix_hits
    group = one(engine, p, max_tokens=10, temperature=1.0, seed=3, n=3, ignore_eos=True)
    assert [r.index for r in group] == [0, 1, 2]
    assert len({r.token_ids for r in group}) == 3  # distinct samples
    full_blocks = (len(p) - 1) // 4
    assert engine.scheduler.num_prefix_hits - before >= 2 * full_blocks * 4  # siblings reuse the prompt
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("kw,param", [
    ({"temperature": -1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 1.5}, "top_p"), ({"top_p": 0}, "top_p"), ({"max_tokens": -1}, "max_tokens"), ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"), ({"stop": ["x"] * 40}, "stop"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"top_k": -5}, "top_k"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_invalid_params_name_the_field(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_greedy_rows_take_the_argmax_of_bf16_logits_as_fp32_would():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits[0, 5] = logits[0, 7] = logits[0].max() + 1  # a tie: the first index wins, as in fp32
    tokens, logprobs = sample(logits, batch_of([SamplingParams(temperature=0)] * 8))
    assert tokens == logits.float().argmax(-1).tolist() and tokens[0] == 5 and logprobs == [None] * 8
    mixed = [SamplingParams(temperature=0, logprobs=2)] + [SamplingParams(temperature=0)] * 7
    tokens, logprobs = sample(logits, batch_of(mixed))  # logprobs asked: the fp32 path, same tokens
    assert tokens == logits.float().argmax(-1).tolist() and {t for t, _ in logprobs[0].top} == {5, 7}


@pytest.mark.kernel  # make test-isa runs it again under the AVX2 cap and on the portable build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 1003, 49152])  # under, at and past one vector; a scalar tail
def test_greedy_tokens_kernel_takes_the_first_maximum_as_torch_does(dtype, vocab):
    """logit_scores.cpp's greedy_tokens against torch's max(dim).indices: ties (the first wins, in another
    lane or the tail), a NaN (it wins, the first of them), a row of -inf (index 0), the maximum last."""
    g = torch.Generator().manual_seed(vocab)
    greedy(torch.zeros(1, 2, dtype=dtype))  # loads the library where it is built
    for trial in range(12):
        logits = torch.randint(-3, 4, (6, vocab), generator=g).to(dtype)  # a few values: ties everywhere
        logits[1, int(torch.randint(0, vocab, (1,), generator=g))] = float("nan")
        logits[2, -1] = logits[2, 0] = float("nan")
        logits[3] = float("-inf")
        logits[4, -1] = 100.0
        logits[5, vocab // 2:] = logits[5].max()  # the maximum from the middle on: its first index
        want = logits.max(-1).indices.tolist()
        assert torch.ops.attnserve.greedy_tokens(logits).tolist() == want, trial
        assert greedy(logits) == want


def test_greedy_on_a_batch_of_served_logits_is_the_fp32_argmax():
    logits = torch.randn(32, 49152, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    logits[7, 100] = logits[7, 40000] = logits[7].max() + 1
    assert greedy(logits) == logits.float().argmax(-1).tolist()
    assert greedy(logits)[7] == 100
