"""Speculative decoding changes no output: greedy tokens equal HF's with n-gram and draft-model
proposers under batching, preemption, chunked prefill and prefix hits (MHA / GQA / MQA); sampled
tokens are distributed as the target's; rejected drafts leave no block and no cached hash behind."""
import json
import math
from collections import Counter

import pytest
import torch

from kvcache.block_pool import hash_block_tokens
from kvcache.manager import KVCacheManager
from models import load_model
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.proposers import ngram_lookup
from server.engine.rejection_sampler import verify
from server.engine.sampler import SamplingBatch, apply_filters
from server.engine.spec_config import SpeculativeConfig
from tests.conftest import ORACLE_TOKENS
from tests.reference import assert_greedy_close
from tests.tiny import hf_config, make_checkpoint, mixed_prompts, train_tokenizer

ARCHS = ["llama", "mistral", "gpt2"]  # GQA, MQA, MHA
NUM_TOKENS = ORACLE_TOKENS  # the session oracle's length (tests/conftest.py)
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
# NOTE: auto_disable off: these tests need drafts in every step that can have them, fast or not
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "auto_disable": False}


@pytest.fixture(scope="module")
def other_seed(tiny_checkpoints, tmp_path_factory):
    """Per arch: the same architecture and tokenizer with other random weights: a draft mostly rejected."""
    root = tmp_path_factory.mktemp("draft")
    return {arch: make_checkpoint(root / arch, arch, seed=1) for arch in ARCHS}


def proposers(arch, tiny_checkpoints, other_seed):
    draft = {"method": "draft_model", "num_speculative_tokens": 3, "auto_disable": False}
    return {"ngram": NGRAM, "draft_same": {**draft, "model": str(tiny_checkpoints[arch])},
            "draft_other": {**draft, "model": str(other_seed[arch])}}


SCENARIOS = {  # engine settings, and the statistic that shows the scenario happened
    "batch": ({}, None),
    "preemption": ({"num_blocks": 60}, lambda e: e.scheduler.num_preemptions),
    "chunked_prefill": ({"max_num_batched_tokens": 24, "max_num_seqs": 8}, lambda e: e.scheduler.num_partial_prefills),
    "prefix_hits": ({}, lambda e: e.scheduler.num_prefix_hits),
}


def engine_for(model, tok, spec, dtype="float32", eager=True, **kw):
    cfg = dict(model="tiny", dtype=dtype, num_blocks=256, block_size=4, max_num_batched_tokens=512, max_num_seqs=32,
               enforce_eager=eager, speculative_config=spec)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), model=model, tokenizer=tok)


def assert_nothing_held(engine):
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    draft = getattr(engine.proposer, "kv", None)
    if draft is not None:  # the draft model's own pool
        assert draft.num_free_blocks == draft.num_blocks and not engine.proposer.num_computed


PROPOSERS = ["ngram", "draft_same", "draft_other"]


def spec_cases() -> list:
    """arch x proposer x scenario. CI: the GQA model through every pair; the other archs through
    every proposer in a batch and every scenario with n-grams (their attention over drafted rows and
    over cached keys); the rest is `exhaustive` (make test-all): which proposer drafted does not
    change how a scenario trims blocks, the GQA cases run each pair."""
    out = []
    for arch in ARCHS:
        for proposer in PROPOSERS:
            for scenario in SCENARIOS:
                kept = arch == "llama" or scenario == "batch" or proposer == "ngram"
                out.append(pytest.param(arch, proposer, scenario, id=f"{arch}-{proposer}-{scenario}",
                                        marks=[] if kept else [pytest.mark.exhaustive]))
    return out


@pytest.mark.parametrize("arch,proposer,scenario", spec_cases())
def test_greedy_equals_hf(arch, proposer, scenario, oracle, tiny_checkpoints, other_seed):
    model, tok, expected = oracle(arch)
    settings, happened = SCENARIOS[scenario]
    engine = engine_for(model, tok, proposers(arch, tiny_checkpoints, other_seed)[proposer], **settings)
    prompts = mixed_prompts(tok, 12, seed=4)
    runs = 2 if scenario == "prefix_hits" else 1  # the second run finds the first's blocks
    for _ in range(runs):
        results = engine.generate(prompts, GREEDY)
        for prompt, group in zip(prompts, results):
            assert list(group[0].token_ids) == expected(prompt)[0], f"prompt of {len(prompt)} tokens diverged"
            assert [lp.token_id for lp in group[0].logprobs] == list(group[0].token_ids)
    assert_nothing_held(engine)
    if happened is not None:
        assert happened(engine) > 0
    drafted = sum(g[0].stats.num_draft_tokens for g in results)
    accepted = sum(g[0].stats.num_accepted_tokens for g in results)
    assert drafted > 0
    if proposer == "draft_same":  # a draft equal to the target is always right
        assert accepted == drafted
    if proposer == "draft_other":
        assert accepted < drafted / 2


def test_bf16_compiled_greedy_near_hf(oracle):
    """bf16: verifying 4 rows at once rounds as a batch does, so a near-tie may flip (the rule batching has)."""
    model, tok, expected = oracle("llama", "bfloat16")
    engine = engine_for(model, tok, NGRAM, dtype="bfloat16", eager=False)
    prompts = mixed_prompts(tok, 8, seed=5)
    for prompt, group in zip(prompts, engine.generate(prompts, GREEDY)):
        theirs, their_tops = expected(prompt)
        assert_greedy_close(list(group[0].token_ids), [dict(lp.top) for lp in group[0].logprobs], theirs, their_tops,
                            f"prompt of {len(prompt)} tokens")
    assert sum(g[0].stats.num_draft_tokens for g in engine.generate(prompts[:2], GREEDY)) > 0
    assert_nothing_held(engine)


def chain_hashes(token_ids, block_size):
    hashes = []
    for i in range(len(token_ids) // block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


def test_rejected_drafts_leave_no_block_and_no_hash(oracle, other_seed):
    """Many rejections (a draft with other weights), preemption and aborts: afterwards no block is held,
    in either pool, and every cached block hashes a run of tokens some sequence really had."""
    model, tok, _ = oracle("llama")
    spec = {"method": "draft_model", "model": str(other_seed["llama"]), "num_speculative_tokens": 4,
            "auto_disable": False}
    engine = engine_for(model, tok, spec, num_blocks=80)
    prompts = mixed_prompts(tok, 10, seed=6)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    finished, sequences = {}, {}
    for step in range(10_000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            finished.setdefault(o.request_id, []).extend(o.new_token_ids)
        if step == 6:  # two aborted mid-flight, holding drafts' blocks
            engine.abort("r0"), engine.abort("r1")
    for i, p in enumerate(prompts):
        sequences[f"r{i}"] = list(p) + finished.get(f"r{i}", [])
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert_nothing_held(engine)
    real = {h for seq in sequences.values() for h in chain_hashes(seq, 4)}
    cached = set(engine.kv.pool.cached)
    assert cached and cached <= real  # NOTE: a block hashed with a rejected draft would hash no real run


def test_trim_returns_exact_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 5) == (0, 1)
    assert kv.allocate_slots("a", 13) == (2, 3)  # the step's drafts need two more blocks
    kv.cache_full_blocks("a", list(range(13)), 4)  # one full computed block: cached
    kv.trim("a", 6)  # verification kept 6 tokens
    assert kv.block_ids("a") == [0, 1] and kv.num_free_blocks == 6
    assert kv.pool.free_queue.block_ids()[-2:] == [3, 2]  # tail first, as a free does
    with pytest.raises(ValueError, match="cached"):
        kv.trim("a", 0)


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 4, 1, 2], 2, 1, 3) == [3, 4]
    assert ngram_lookup([1, 2, 3, 9, 2, 3, 5, 2, 3], 3, 2, 2) == [5, 2, 3]  # the latest earlier match
    assert ngram_lookup([1, 2, 3, 4, 2, 3], 2, 1, 3) == [4, 2]  # longest suffix first: [2, 3]
    assert ngram_lookup([1, 2, 3], 2, 2, 3) == []
    assert ngram_lookup([5], 2, 1, 3) == []


def test_adaptive_k_and_config():
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "min_draft_acceptance": 0.2}')
    assert [spec.num_drafts(a) for a in (1.0, 0.8, 0.5, 0.1)] == [5, 5, 2, 1]
    assert SpeculativeConfig.parse({"method": "ngram"}).num_speculative_tokens == 3
    for bad, match in [('{"method": "eagle"}', "method"), ('{"method": "ngram", "model": "x"}', "draft_model"),
                       ('{"method": "draft_model"}', "needs a model"), ('{"method": "ngram", "k": 2}', "unknown"),
                       ("[1]", "JSON object"), ("{", "not JSON"),
                       ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(speculative_config=bad)


def test_draft_with_another_vocabulary_is_refused(oracle, tmp_path):
    from transformers import AutoModelForCausalLM

    tok = train_tokenizer(320)
    eos, bos = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    AutoModelForCausalLM.from_config(hf_config("llama", len(tok), eos, bos)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, target_tok, _ = oracle("llama")
    with pytest.raises(ValueError, match=r"vocabulary has \d+ tokens, the target's \d+; a draft model must share"):
        engine_for(model, target_tok, {"method": "draft_model", "model": str(tmp_path)})


# ---- sampling: the rejection rule keeps the target's distribution ---------------------------------
def chi_square_ok(counts: Counter, probs: dict[int, float], n: int) -> tuple[float, float]:
    """(statistic, critical value at p = 0.001), cells with expected count < 5 pooled."""
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for k, p in probs.items():
        if n * p >= 5:
            cells.append((counts.get(k, 0), n * p))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts.get(k, 0), pooled_exp + n * p
    assert sum(c for k, c in counts.items() if probs.get(k, 0) == 0) == 0, "a token the target cannot draw"
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    crit = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty, z(0.999) = 3.09
    return stat, crit


def test_verify_keeps_the_target_distribution():
    """Synthetic logits, two drafts: the first emitted token follows p0, the second (given the first
    draft was kept) follows p1, with temperature, top-p and a presence penalty applied first."""
    torch.manual_seed(0)
    logits = torch.randn(3, 8) * 1.5  # rows: after the last token, after draft 0, after draft 1
    params = SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.5)

    def target(row, seen):  # the non-speculative sampler's distribution after `seen` output tokens
        penalty = 0.5 * torch.isin(torch.arange(8), torch.tensor(seen, dtype=torch.long))
        return apply_filters(logits[row:row + 1] - penalty, [params]).softmax(-1)[0]

    p0 = target(0, [])
    d0 = int(p0.argmax())
    p1 = target(1, [d0])
    drafts = [d0, int(p1.argmax())]
    outputs = ([], [d0], drafts)  # row i follows drafts[:i]: the penalty counts them
    probs = [p0, p1]
    n, first, second = 6000, Counter(), Counter()
    for seed in range(n):
        g = torch.Generator().manual_seed(seed)
        batch = SamplingBatch((params,) * 3, (g,) * 3, ((),) * 3, outputs)
        tokens = verify(logits.clone(), batch, [drafts])[0][0]
        first[tokens[0]] += 1
        if tokens[0] == d0:
            second[tokens[1]] += 1
    for counts, p in ((first, probs[0]), (second, probs[1])):
        total = sum(counts.values())
        assert total > 1500
        stat, crit = chi_square_ok(counts, dict(enumerate(p.tolist())), total)
        assert stat < crit, (stat, crit, counts)
    assert 0.2 < p0[d0] < 0.8 and 0.2 < p1[drafts[1]] < 0.8  # both the accept and the reject path ran


def test_engine_samples_as_the_target(tmp_path):
    """A Llama over 8 tokens, n-gram drafts verified at the second output position: the joint
    distribution of the first two tokens over thousands of seeds matches the model's own."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.15, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path)
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 3, 1]  # every token occurs: every first token finds a 1-gram draft
    params = dict(temperature=0.9, top_p=0.95, max_tokens=3, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 1,
            "auto_disable": False, "min_draft_acceptance": 0}
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_blocks=2048, block_size=4, enforce_eager=True,
                                    max_num_seqs=256, max_num_batched_tokens=4096, speculative_config=spec),
                       model=load_model(tmp_path), tokenizer=None)
    n = 4000
    results = engine.generate([prompt] * n, [SamplingParams(seed=s, **params) for s in range(n)])
    pairs = Counter(tuple(g[0].token_ids[:2]) for g in results)
    assert sum(g[0].stats.num_draft_tokens for g in results) == n  # every second token was a verified draft
    assert 0 < sum(g[0].stats.num_accepted_tokens for g in results) < n
    with torch.no_grad():
        sp = SamplingParams(**params)
        p0 = apply_filters(hf(torch.tensor([prompt])).logits[0, -1:].float(), [sp]).softmax(-1)[0]
        nxt = hf(torch.tensor([[*prompt, t] for t in range(8)])).logits[:, -1].float()  # (8, V): after each first token
        p1 = apply_filters(nxt, [sp] * 8).softmax(-1)
    joint = {(a, b): float(p0[a] * p1[a, b]) for a in range(8) for b in range(8)}
    stat, crit = chi_square_ok(pairs, joint, n)
    assert stat < crit, (stat, crit)
    assert_nothing_held(engine)


def test_structured_requests_run_without_drafts(oracle):
    model, tok, _ = oracle("llama")
    engine = engine_for(model, tok, NGRAM)
    from server.engine.sampling_params import StructuredOutput

    params = SamplingParams(max_tokens=30, temperature=0, structured=StructuredOutput("choice", json.dumps(["yes", "no"])))
    plain = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    prompts = mixed_prompts(tok, 2, seed=7)
    results = engine.generate(prompts, [params, plain])
    assert results[0][0].text in ("yes", "no") and results[0][0].stats.num_draft_tokens == 0
    assert results[1][0].stats.num_draft_tokens > 0
    assert_nothing_held(engine)


def test_readme_generate_command_speculates():
    """The README's `attnserve generate --speculative-config` line, run as a user would."""
    import subprocess

    from loadtests.servers import BIN
    from tests.test_cli_serve import env, readme_block

    line = next(x for x in readme_block("bash", "--speculative-config").splitlines() if " generate " in x)
    out = subprocess.run(["bash", "-c", line.replace(".venv/bin/", f"{BIN}/")], capture_output=True, text=True,
                         timeout=300, env=env(), check=True).stdout
    result = json.loads(out.splitlines()[-1])
    assert "quick brown fox" in result["text"]
    assert 0 < result["speculative"]["accepted"] <= result["speculative"]["drafted"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_native_decoder_unchanged(default_model_dir, dtype):
    """The shipped Q4_1 model in the native decoder with default settings (8-bit activations for its 4-bit
    codes), fp32 and bf16: verifying 4 rows gives, bit for bit, the tokens 1-row steps give, on copy
    prompts where drafts are kept and rejected (batch-invariant kernels: attention, and the linears up to
    their code-tile rows; under `make test-isa` too)."""
    from models.corpus import corpus_words

    words = corpus_words()
    prompts = [f"Copy the following passage exactly, changing only every 'the' to 'THE':\n\n{' '.join(words[i:i + 60])}"
               for i in (900, 2100, 3300, 4500)]
    outs = []
    for spec in (None, NGRAM):
        engine = LLMEngine(EngineConfig(model=str(default_model_dir), dtype=dtype, kv_cache_memory=None,
                                        num_blocks=128, speculative_config=spec))
        assert engine.runner.step == "native"
        tok = engine.tokenizer
        done = []
        for prompt in prompts:
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                     tokenize=False), add_special_tokens=False)
            done.append(engine.generate([ids], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))[0][0])
        assert_nothing_held(engine)
        outs.append(done)
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    accepted = sum(o.stats.num_accepted_tokens for o in outs[1])
    assert 0 < accepted < sum(o.stats.num_draft_tokens for o in outs[1])  # kept and rejected drafts


def test_gate_runs_the_faster_mode_and_notices_a_change():
    from server.engine.spec_gate import EXPLORE_EVERY, MAX_EXPLORE_EVERY, SpeculationGate

    def run(gate, steps, on_rate, off_rate, batch=1):
        modes = []
        for _ in range(steps):
            on = gate.use(batch)
            modes.append(on)
            gate.record(batch, on, on_rate if on else off_rate, 1.0)
        return modes

    gate = SpeculationGate()
    modes = run(gate, 200, on_rate=20, off_rate=10)
    assert modes[:3] == [True] * 3 and modes[3] is False  # an early look at the other mode
    explored = [i for i, m in enumerate(modes) if not m]
    assert explored == [3, 3 + 2 * EXPLORE_EVERY, 3 + 6 * EXPLORE_EVERY]  # backing off while drafts keep winning
    assert gate.summary() == {1: pytest.approx(2.0)}
    modes = run(gate, MAX_EXPLORE_EVERY + 2 * EXPLORE_EVERY, on_rate=6, off_rate=10)  # drafts stop paying
    assert sum(modes[-EXPLORE_EVERY:]) <= 1 and gate.summary()[1] < 1  # off, but for a look now and then
    modes = run(gate, 2 * MAX_EXPLORE_EVERY, on_rate=30, off_rate=10)  # and pay again
    assert sum(modes[-EXPLORE_EVERY:]) >= EXPLORE_EVERY - 1
    assert run(gate, 4, 30, 10, batch=16) == [False, False, False, True]  # big batches start off, then look
    assert set(gate.summary()) == {1, 16}


def test_draft_weights_and_blocks_come_out_of_the_memory_budget(oracle, tiny_checkpoints):
    model, tok, _ = oracle("llama")
    budget = 8 * 2**20

    def engine(spec):
        return engine_for(model, tok, spec, num_blocks=None, kv_cache_memory="auto", memory_budget=budget)

    alone = engine(None)
    drafted = engine({"method": "draft_model", "model": str(tiny_checkpoints["llama"])})
    draft_model = drafted.proposer.runner.model
    per_block = alone.kv_spec.bytes_per_block + drafted.proposer.runner.cache.spec.bytes_per_block
    assert alone.kv.num_blocks == (budget - model.weight_bytes()) // alone.kv_spec.bytes_per_block
    assert drafted.kv.num_blocks == (budget - model.weight_bytes() - draft_model.weight_bytes()) // per_block
    assert drafted.proposer.kv.num_blocks == drafted.kv.num_blocks  # the draft never runs out first
