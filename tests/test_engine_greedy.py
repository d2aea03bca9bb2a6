"""Greedy outputs equal HF transformers token for token, whatever batching, paging,
preemption, chunking or prefix caching does: on the compiled step and the eager one, in fp32
and bf16 (HF in the same dtype)."""

import pytest

from server.engine import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import ORACLE_TOKENS
from tests.reference import generate_and_check
from tests.tiny import CORPUS, mixed_prompts

ARCHS = ["llama", "mistral", "gpt2"]  # GQA, MQA, MHA
NUM_TOKENS = ORACLE_TOKENS  # the session oracle's length (tests/conftest.py)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=5)


MODES = [("compiled", "float32"), ("eager", "float32"), ("compiled", "bfloat16"), ("eager", "bfloat16")]
SERVING = ("compiled", "float32")  # the step a tiny (non-GGUF) model serves on


def cases(every_mode: bool = False, isa: bool = False) -> list:
    """(mode, arch) over every mode x arch. CI keeps every arch in the serving mode (the features
    reach each arch's own attention over cached keys: RoPE scalings, learned positions) and, where
    `every_mode`, every mode (the step and the dtype's numerics); the rest of the product is
    `exhaustive` (make test-all): the scheduler does the same in every mode, and the feature's
    attention path is the one the serving mode ran. `isa`: the fp32 cases run again under the
    AVX2 cap (make test-isa), one pass per family through both steps."""
    out = []
    for mode in MODES:
        for arch in ARCHS:
            marks = [] if every_mode or mode == SERVING else [pytest.mark.exhaustive]
            if isa and mode[1] == "float32":
                marks.append(pytest.mark.isa)
            out.append(pytest.param(mode, arch, id=f"{'-'.join(mode)}-{arch}", marks=marks))
    return out


@pytest.fixture
def setup(oracle, mode):
    """(oracle for an arch in this mode's dtype, engine factory for its step)."""
    step, dtype = mode

    def engine_for(model, tok, **kw):
        cfg = dict(model="tiny", dtype=dtype, num_blocks=256, block_size=4, max_num_batched_tokens=512,
                   max_num_seqs=32, enforce_eager=step == "eager")
        cfg.update(kw)
        return LLMEngine(EngineConfig(**cfg), model=model, tokenizer=tok)
    return (lambda arch: oracle(arch, dtype)), engine_for


def run_and_check(engine, prompts, expected):
    return generate_and_check(engine, prompts, GREEDY, expected)


@pytest.mark.parametrize("mode,arch", cases())
def test_alone(arch, setup):
    oracle, engine_for = setup
    model, tok, expected = oracle(arch)
    engine = engine_for(model, tok)
    for prompt in mixed_prompts(tok, 3, seed=1):
        run_and_check(engine, [prompt], expected)


@pytest.mark.parametrize("mode,arch", cases(every_mode=True, isa=True))
def test_16_mixed_length_requests_at_once(arch, setup):
    oracle, engine_for = setup
    model, tok, expected = oracle(arch)
    engine = engine_for(model, tok)
    prompts = mixed_prompts(tok, 16, seed=2)
    assert len({len(p) for p in prompts}) > 8
    run_and_check(engine, prompts, expected)
    assert engine.num_steps < 16 * NUM_TOKENS / 4  # they really ran together


@pytest.mark.parametrize("mode,arch", cases())
def test_preemption_by_recompute(arch, setup):
    oracle, engine_for = setup
    model, tok, expected = oracle(arch)
    # 12 prompts need ~12 * (90 + 24) / 4 blocks together; 40 blocks hold only a few at a time
    engine = engine_for(model, tok, num_blocks=40, enable_prefix_caching=False)
    prompts = mixed_prompts(tok, 12, seed=3, min_len=20, max_len=80)
    run_and_check(engine, prompts, expected)
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("mode,arch", cases())
def test_chunked_prefill(arch, setup):
    oracle, engine_for = setup
    model, tok, expected = oracle(arch)
    engine = engine_for(model, tok, max_num_batched_tokens=16, max_num_seqs=8)
    prompts = mixed_prompts(tok, 6, seed=4, min_len=30, max_len=90)
    run_and_check(engine, prompts, expected)
    assert engine.scheduler.num_partial_prefills > 0


@pytest.mark.parametrize("mode,arch", cases())
def test_shared_prefix_from_prefix_cache(arch, setup):
    oracle, engine_for = setup
    model, tok, expected = oracle(arch)
    engine = engine_for(model, tok)
    system = tok(CORPUS)["input_ids"][:41]
    prompts = [system + tail for tail in mixed_prompts(tok, 6, seed=5, min_len=2, max_len=12)]
    run_and_check(engine, prompts[:1], expected)  # warm the cache
    run_and_check(engine, prompts[1:], expected)
    assert engine.scheduler.num_prefix_hits >= 5 * 40


@pytest.mark.parametrize("mode,arch", cases())
def test_identical_prompt_twice_hits_all_but_the_last_block(arch, setup):
    oracle, engine_for = setup
    model, tok, expected = oracle(arch)
    engine = engine_for(model, tok)
    prompt = tok(CORPUS)["input_ids"][:40]  # exactly 10 blocks of 4
    run_and_check(engine, [prompt], expected)
    before = engine.scheduler.num_prefix_hits
    run_and_check(engine, [prompt], expected)
    assert engine.scheduler.num_prefix_hits - before == 36  # the last block is recomputed for logits


@pytest.mark.parametrize("mode", MODES, ids=["-".join(m) for m in MODES])
def test_preemption_chunking_and_prefix_cache_together(setup):
    oracle, engine_for = setup
    model, tok, expected = oracle("llama")
    engine = engine_for(model, tok, num_blocks=48, max_num_batched_tokens=24, max_num_seqs=10)
    system = tok(CORPUS)["input_ids"][:30]
    prompts = [system + t for t in mixed_prompts(tok, 10, seed=6, min_len=5, max_len=60)]
    run_and_check(engine, prompts, expected)
    s = engine.scheduler
    assert s.num_preemptions > 0 and s.num_partial_prefills > 0 and s.num_prefix_hits > 0
