"""The attention-variant model types (Qwen3, Gemma 2/3, Phi-3, OLMo 2, Mistral and Qwen2 with
their windows) against HF transformers, dense and through the paged engine; and the windowed
KV cache: blocks out of a window go back to the pool, and what the pool holds is measured."""
import pytest
import torch

from kvcache.storage import KVCacheSpec
from models import load_model, load_tokenizer
from models.attention import DenseAttention
from server.engine import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import ORACLE_TOKENS
from tests.reference import dense_greedy, generate_and_check, hf_greedy, load_hf
from tests.tiny import CORPUS, VARIANT_ARCHS, WINDOW, mixed_prompts

NUM_TOKENS = ORACLE_TOKENS  # the session oracle's length (tests/conftest.py)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
# below, at and past the window (WINDOW = 24): with 24 generated tokens every prompt ends past it
PROMPT_LENGTHS = (5, WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW + 3, 4 * WINDOW)


def corpus_ids(tok, n: int, start: int = 0) -> list[int]:
    ids = tok(CORPUS * 4)["input_ids"]
    return ids[start:start + n]


@pytest.mark.parametrize("arch", VARIANT_ARCHS)
def test_config_names_the_variants(arch, variant_checkpoints):
    cfg = load_model(variant_checkpoints[arch]).config
    expected = {"qwen3": {"sliding_window", "qk_norm"},
                "gemma2": {"sliding_window", "logit_softcap", "query_pre_scale"},
                "gemma3_text": {"sliding_window", "qk_norm", "query_pre_scale"},
                "phi3": set(), "olmo2": {"qk_norm"},
                "mistral-window": {"sliding_window"}, "qwen2-window": {"sliding_window"},
                "granite_swa": {"sliding_window", "query_pre_scale", "sinks"}}[arch]
    assert set(cfg.attention_variants) == expected
    assert cfg.max_position_embeddings == 512  # a window no longer caps the context


@pytest.mark.isa  # make test-isa: one pass per model type under the AVX2 cap
@pytest.mark.parametrize("arch", VARIANT_ARCHS)
def test_logits_match_hf_on_a_packed_batch_past_the_window(arch, variant_checkpoints):
    path = variant_checkpoints[arch]
    ours, hf, tok = load_model(path), load_hf(path), load_tokenizer(path)
    prompts = [corpus_ids(tok, n, start=7 * n) for n in PROMPT_LENGTHS]
    lens = tuple(len(p) for p in prompts)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, positions, DenseAttention(lens)))  # (T, V)
        expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert (logits - expected).abs().max() <= 1e-4
    assert logits.std() > 0.1


@pytest.mark.parametrize("arch", VARIANT_ARCHS)
def test_dense_greedy_matches_hf(arch, variant_checkpoints):
    path = variant_checkpoints[arch]
    ours, hf, tok = load_model(path), load_hf(path), load_tokenizer(path)
    ids = corpus_ids(tok, 2 * WINDOW)
    expected = hf_greedy(hf, ids, 32)
    assert dense_greedy(ours, ids, 32) == expected
    assert len(set(expected)) > 1


def make_engine(model, tok, dtype="float32", eager=True, **kw):
    cfg = dict(model="tiny", dtype=dtype, num_blocks=256, block_size=4, max_num_batched_tokens=512,
               max_num_seqs=32, enforce_eager=eager)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), model=model, tokenizer=tok)


def run_and_check(engine, prompts, expected):
    return generate_and_check(engine, prompts, GREEDY, expected)


@pytest.mark.isa  # make test-isa: one pass per model type under the AVX2 cap
@pytest.mark.parametrize("arch", VARIANT_ARCHS)
def test_engine_alone_and_batched(arch, variant_oracle):
    model, tok, expected = variant_oracle(arch)
    engine = make_engine(model, tok)
    for n in PROMPT_LENGTHS:
        run_and_check(engine, [corpus_ids(tok, n, start=3 * n)], expected)
    prompts = mixed_prompts(tok, 16, seed=2)
    run_and_check(engine, prompts, expected)
    assert engine.num_steps < 6 * NUM_TOKENS + 16 * NUM_TOKENS / 4  # they really ran together


@pytest.mark.parametrize("arch", VARIANT_ARCHS)
def test_engine_preemption_and_chunked_prefill(arch, variant_oracle):
    model, tok, expected = variant_oracle(arch)
    # room for the longest sequence and a bit more: a few at a time
    longest = KVCacheSpec.of(model.config, torch.float32, 4).blocks_for(80 + NUM_TOKENS)
    engine = make_engine(model, tok, num_blocks=longest + 12, enable_prefix_caching=False)
    run_and_check(engine, mixed_prompts(tok, 12, seed=3, min_len=20, max_len=80), expected)
    assert engine.scheduler.num_preemptions > 0
    engine = make_engine(model, tok, max_num_batched_tokens=16, max_num_seqs=8)
    run_and_check(engine, mixed_prompts(tok, 6, seed=4, min_len=30, max_len=90), expected)
    assert engine.scheduler.num_partial_prefills > 0


@pytest.mark.parametrize("arch", VARIANT_ARCHS)
def test_engine_prefix_hits_past_the_window(arch, variant_oracle):
    """A shared prefix longer than the window: a windowed group hits only the blocks its window
    still sees, which must be cached; tokens equal HF's (a hit gives a miss's tokens)."""
    model, tok, expected = variant_oracle(arch)
    engine = make_engine(model, tok)
    system = corpus_ids(tok, 3 * WINDOW + 1)
    prompts = [system + tail for tail in mixed_prompts(tok, 5, seed=5, min_len=2, max_len=12)]
    run_and_check(engine, prompts[:1], expected)
    before = engine.scheduler.num_prefix_hits
    run_and_check(engine, prompts[1:], expected)
    assert engine.scheduler.num_prefix_hits - before >= 4 * 3 * WINDOW  # every later prompt hit its prefix


@pytest.mark.parametrize("arch", VARIANT_ARCHS)
def test_bfloat16_batched_near_ties_only(arch, variant_oracle):
    """bf16 against HF in bf16: equal tokens up to a first difference that is a near-tie for both."""
    model, tok, expected = variant_oracle(arch, "bfloat16")
    engine = make_engine(model, tok, dtype="bfloat16")
    run_and_check(engine, [corpus_ids(tok, n, start=3 * n) for n in PROMPT_LENGTHS] + mixed_prompts(tok, 8, seed=9),
                  expected)


# bf16: gemma2 (soft-caps and sliding / global groups) in CI; the other two are exhaustive, their
# compiled graphs and groups run in fp32 above and their bf16 numerics in test_bfloat16_batched_near_ties_only
COMPILED = [pytest.param(dtype, arch, marks=[pytest.mark.exhaustive] if dtype == "bfloat16" and arch != "gemma2" else [])
            for dtype in ("float32", "bfloat16") for arch in ("gemma2", "qwen3", "mistral-window")]


@pytest.mark.parametrize("dtype,arch", COMPILED)
def test_compiled_step(arch, dtype, variant_oracle):
    """The compiled step over the grouped pool (layers of two kinds share its tensors)."""
    model, tok, expected = variant_oracle(arch, dtype)
    engine = make_engine(model, tok, dtype=dtype, eager=False, max_num_batched_tokens=32)
    assert engine.runner.step == "compiled"
    prompts = mixed_prompts(tok, 8, seed=6, min_len=10, max_len=90)
    run_and_check(engine, prompts, expected)


def windowed_blocks_held(engine) -> int:
    """Blocks the pool holds for each windowed group of the one running sequence: used blocks, less
    the global groups' (every block of the sequence), per windowed group."""
    spec, kv = engine.kv_spec, engine.kv
    req = engine.scheduler.running[0]
    num_global = sum(w is None for w in spec.group_windows)
    num_windowed = len(spec.group_windows) - num_global
    windowed_blocks = kv.pool.num_used_blocks - num_global * -(-req.num_computed_tokens // spec.block_size)
    assert windowed_blocks % num_windowed == 0
    return windowed_blocks // num_windowed


@pytest.mark.parametrize("arch,block_size", [("mistral-window", 4), ("mistral-window", 8), ("gemma2", 16),
                                             ("gemma3_text", 8), ("granite_swa", 16)])
def test_a_windowed_layer_holds_at_most_window_plus_one_block(arch, block_size, variant_oracle):
    """Up to 4x the window, measured from the pool after every step: per windowed layer, the KV it
    stores (from its first held block to the sequence's end) is at most window + one block - 1
    tokens, in at most cdiv(window - 1, block) + 1 blocks; the global layers hold every token."""
    model, tok, _ = variant_oracle(arch)
    engine = make_engine(model, tok, block_size=block_size, enable_prefix_caching=False)
    engine.add_request("a", corpus_ids(tok, 10), SamplingParams(max_tokens=4 * WINDOW, temperature=0,
                                                                 ignore_eos=True))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        if not engine.scheduler.running:
            continue
        computed = engine.scheduler.running[0].num_computed_tokens
        blocks = windowed_blocks_held(engine)
        stored = computed - (-(-computed // block_size) - blocks) * block_size  # from its first block on
        assert blocks <= -(-(WINDOW - 1) // block_size) + 1
        assert stored <= WINDOW + block_size - 1
        peak = max(peak, stored)
    assert peak >= WINDOW  # it did fill the window (and blocks past it were freed: bounded above)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_no_block_held_after_windows_preemption_and_aborts(variant_oracle):
    model, tok, _ = variant_oracle("gemma2")
    engine = make_engine(model, tok, num_blocks=48, max_num_batched_tokens=24, max_num_seqs=10)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [corpus_ids(tok, 30) + t for t in mixed_prompts(tok, 10, seed=7, min_len=5, max_len=60)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps in (5, 12, 20):
            engine.abort(f"r{steps % 10}")
    s = engine.scheduler
    assert s.num_preemptions > 0 and s.num_partial_prefills > 0 and s.num_prefix_hits > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.kv.req_blocks


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("arch", ["gemma2", "mistral-window"])
def test_speculative_decoding_on_a_windowed_model(arch, method, variant_oracle, variant_checkpoints):
    """Drafts verified over windowed layers, rejected drafts trimmed from every group (the draft
    model, the target itself here, has windowed groups of its own): still HF's tokens, no block held."""
    model, tok, expected = variant_oracle(arch)
    spec = {"method": method, "num_speculative_tokens": 3, "auto_disable": False}
    spec.update({"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram"
                else {"model": str(variant_checkpoints[arch])})
    engine = make_engine(model, tok, speculative_config=spec, num_blocks=80)
    prompts = [corpus_ids(tok, n, start=5 * n) for n in (5, WINDOW, 3 * WINDOW)] + mixed_prompts(tok, 6, seed=8)
    results = run_and_check(engine, prompts, expected)
    drafted = sum(g[0].stats.num_draft_tokens for g in results)
    accepted = sum(g[0].stats.num_accepted_tokens for g in results)
    assert drafted > 0 and (accepted == drafted if method == "draft_model" else accepted > 0)
    draft = getattr(engine.proposer, "kv", None)
    if draft is not None:
        assert draft.num_free_blocks == draft.num_blocks and not engine.proposer.num_computed


def test_a_sequence_longer_than_the_pool_on_an_all_windowed_model(variant_oracle):
    """Every layer windowed: a sequence of 84 tokens needs 7 blocks of 4 at a time, so 10 blocks serve
    it (a global model would need 21). The prompt does not fit in one chunk; the scheduler halves the
    chunk until it does, and admission counts what the windows hold."""
    from server.engine.admission import validate_request

    model, tok, expected = variant_oracle("mistral-window")
    engine = make_engine(model, tok, num_blocks=10, enable_prefix_caching=False)
    prompt = corpus_ids(tok, 60, start=11)
    validate_request(engine.info, prompt, GREEDY)  # not refused: 7 blocks at most
    run_and_check(engine, [prompt], expected)
    assert engine.scheduler.num_partial_prefills > 0 and engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3_text", "mistral-window"])
def test_kv_head_expansion_keeps_the_outputs(arch, variant_checkpoints, tmp_path):
    """`attnserve convert --kv-heads 4` (GQA 4/2 -> MHA) on a model type with variants: the same logits;
    phi3 (k and v fused with q) and olmo2 (k normalised over all heads) are refused."""
    from models.kv_heads import convert

    path = variant_checkpoints[arch]
    mha = load_model(convert(path, 4, tmp_path / "mha", progress=False))
    gqa = load_model(path)
    assert (mha.config.num_kv_heads, gqa.config.num_kv_heads) == (4, 2)
    ids = torch.arange(3 * WINDOW) % 300 + 5
    with torch.no_grad():
        a = gqa.compute_logits(gqa(ids, torch.arange(len(ids))))
        b = mha.compute_logits(mha(ids, torch.arange(len(ids))))
    assert (a - b).abs().max() <= 1e-4


@pytest.mark.parametrize("arch", ["phi3", "olmo2"])
def test_kv_head_conversion_refused_where_it_would_change_the_model(arch, variant_checkpoints, tmp_path):
    from models.kv_heads import convert

    with pytest.raises(ValueError, match=f"converting kv heads of {arch} is not supported"):
        convert(variant_checkpoints[arch], 4, tmp_path / "out", progress=False)
