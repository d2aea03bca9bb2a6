"""LoRA in the engine: mixed batches of adapters and the base equal PEFT's greedy tokens (fp32) under
preemption, chunked prefill, prefix hits and speculation; slots evict the least recently used adapter and
make requests wait, never drop them; unload drains; the prefix cache keeps adapters apart; bad adapters
fail their request and hold nothing."""
import asyncio
import json
from dataclasses import replace

import pytest
import torch

from models.lora_format import AdapterError
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.core_client import EngineCoreClient
from server.engine.lora_manager import adapter_ref
from server.engine.sampling_params import StructuredOutput
from server.wire import LoraRef
from tests.conftest import ORACLE_TOKENS
from tests.lora_helpers import peft_model
from tests.reference import load_hf, memoised_greedy
from tests.tiny import mixed_prompts

GREEDY = SamplingParams(max_tokens=ORACLE_TOKENS, temperature=0, ignore_eos=True)
NAMES = ("all8", "attn4", "mlp16")  # tests/lora_helpers.py ADAPTERS


@pytest.fixture(scope="module")
def llama(oracle):
    """(our fp32 tiny llama, its tokenizer, HF's greedy tokens of the base)."""
    return oracle("llama")


@pytest.fixture(scope="module")
def refs(lora_adapters) -> dict[str, LoraRef]:
    return {name: adapter_ref(name, str(path), "tiny") for name, path in lora_adapters.items()}


@pytest.fixture(scope="module")
def expected(llama, tiny_checkpoints, lora_adapters):
    """(adapter name or None, prompt) -> PEFT's (HF's for the base) greedy tokens, fp32, memoised."""
    base = llama[2]
    peft = {name: memoised_greedy(peft_model(tiny_checkpoints["llama"], path), ORACLE_TOKENS)
            for name, path in lora_adapters.items()}
    return lambda name, prompt: (base if name is None else peft[name])(prompt)[0]


@pytest.fixture
def engine_for(llama):
    model, tok, _ = llama

    def make(**kw):
        cfg = dict(model="tiny", dtype="float32", num_blocks=256, block_size=4, max_num_batched_tokens=512,
                   max_num_seqs=32, enforce_eager=True, max_loras=3)
        cfg.update(kw)
        return LLMEngine(EngineConfig(**cfg), model=model, tokenizer=tok)
    return make


def check(engine, refs, expected, cases, params=GREEDY):
    """Run (adapter name or None, prompt) cases at once; each equals its oracle, and nothing is held after."""
    results = engine.generate([p for _, p in cases], params, [refs[n] if n else None for n, _ in cases])
    for (name, prompt), group in zip(cases, results):
        assert list(group[0].token_ids) == expected(name, prompt), f"{name} on a prompt of {len(prompt)} tokens"
        assert group[0].finish_reason == "length" and group[0].stats.lora == name
    assert_idle(engine)
    return results


def assert_idle(engine):
    assert engine.kv.num_used_blocks == 0 and not engine.groups  # no block leaks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert all(not a.requests for a in engine.loras.adapters.values())  # every pin released


def mixed(tok, count, seed):
    """`count` prompts for each of the base and the three adapters, interleaved."""
    prompts = mixed_prompts(tok, 4 * count, seed=seed, min_len=5, max_len=60)
    return [((None, *NAMES)[i % 4], p) for i, p in enumerate(prompts)]


def test_mixed_batch_of_base_and_three_adapters_equals_peft(engine_for, llama, refs, expected):
    engine = engine_for()  # eager: the compiled and native steps' deltas are tests/test_lora_model.py's
    cases = mixed(llama[1], 2, seed=3)
    for name in NAMES:  # each adapter changes the tokens: a step that dropped its delta would fail
        assert any(expected(name, p) != expected(None, p) for n, p in cases if n == name)
    check(engine, refs, expected, cases)
    assert engine.num_steps < len(cases) * ORACLE_TOKENS / 4  # they really ran together
    stats = engine.stats()
    assert stats.num_lora_loads == 3 and stats.num_lora_evictions == 0 and stats.lora_load_seconds > 0
    assert set(stats.resident_loras) == set(NAMES) and stats.running_loras == stats.waiting_loras == ()
    assert engine.info.lora == engine.parts.lora_slots.shapes and engine.info.lora.max_loras == 3
    assert engine.weight_bytes == llama[0].weight_bytes() + engine.parts.lora_slots.nbytes()


@pytest.mark.parametrize("pressure", ["preemption", "chunked"])
def test_mixed_batch_under_preemption_and_chunked_prefill(pressure, engine_for, llama, refs, expected):
    kw = (dict(num_blocks=40, enable_prefix_caching=False) if pressure == "preemption"
          else dict(max_num_batched_tokens=16, max_num_seqs=8))
    engine = engine_for(**kw)
    cases = mixed(llama[1], 2, seed=4)
    check(engine, refs, expected, cases)
    if pressure == "preemption":
        assert engine.scheduler.num_preemptions > 0
    else:
        assert engine.scheduler.num_partial_prefills > 0 and max(len(p) for _, p in cases) > 16


def test_prefix_cache_keeps_adapters_apart_and_hits_their_own(engine_for, llama, refs, expected):
    engine = engine_for()
    prompt = mixed_prompts(llama[1], 1, seed=5, min_len=40, max_len=40)[0]
    for name in (None, "all8", "attn4"):  # one after another: the same prompt, three KV owners
        (group,) = check(engine, refs, expected, [(name, prompt)])
        assert group[0].stats.num_cached_tokens == 0, name  # nobody else's blocks
    for name in (None, "all8", "attn4"):
        (group,) = check(engine, refs, expected, [(name, prompt)])
        assert group[0].stats.num_cached_tokens == 36, name  # its own 9 full blocks of 4 (never the last token)
    other = mixed_prompts(llama[1], 1, seed=12, min_len=30, max_len=30)[0]
    (samples,) = engine.generate([other], replace(GREEDY, n=2), refs["mlp16"])
    assert [list(s.token_ids) for s in samples] == [expected("mlp16", other)] * 2
    assert samples[0].stats.num_cached_tokens == 0 and samples[1].stats.num_cached_tokens == 28  # its sibling's
    assert_idle(engine)


def test_more_adapters_than_slots_wait_and_evict(engine_for, llama, refs, expected):
    engine = engine_for(max_loras=2)
    prompts = mixed_prompts(llama[1], 7, seed=6, min_len=5, max_len=40)
    cases = [(NAMES[i % 3] if i < 6 else None, p) for i, p in enumerate(prompts)]
    for i, (name, p) in enumerate(cases):
        engine.add_request(f"r{i}", p, GREEDY, lora=refs[name] if name else None)
    # all8 and attn4 took the two slots; mlp16's requests wait, checked, and are never refused
    stats = engine.stats()
    assert stats.resident_loras == ("all8", "attn4") and stats.waiting_loras == NAMES
    waiting = [r for g in engine.groups.values() for r in g if r.lora is refs["mlp16"]]
    assert len(waiting) == 2 and all(r.lora_slot is None and not r.is_ready for r in waiting)
    tokens: dict[str, list[int]] = {}
    finals = {}
    saw_waiting = False
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finals[o.request_id] = o
        saw_waiting |= "mlp16" in engine.stats().waiting_loras and "mlp16" not in engine.stats().running_loras
    assert saw_waiting and len(finals) == len(cases)  # nothing dropped
    for i, (name, p) in enumerate(cases):
        assert finals[f"r{i}"].finish_reason == "length" and tokens[f"r{i}"] == expected(name, p), (i, name)
    stats = engine.stats()
    assert stats.num_lora_loads == 3 and stats.num_lora_evictions == 1 and len(stats.resident_loras) == 2
    survivor = stats.resident_loras[0]
    assert stats.resident_loras == (survivor, "mlp16")  # least recently used first
    assert_idle(engine)
    # with no pin left, loading the evicted adapter again evicts the least recently used one
    evicted = next(n for n in NAMES if n not in stats.resident_loras)
    answer = engine.load_lora(refs[evicted])
    assert answer.error is None and answer.seconds > 0
    stats = engine.stats()
    assert stats.resident_loras == ("mlp16", evicted) and stats.num_lora_evictions == 2


def test_abort_releases_pins_of_running_and_waiting_adapters(engine_for, llama, refs, expected):
    engine = engine_for(max_loras=1)
    a, b = mixed_prompts(llama[1], 2, seed=11, min_len=10, max_len=30)
    engine.add_request("a", a, GREEDY, lora=refs["all8"])
    engine.add_request("b", b, GREEDY, lora=refs["attn4"])  # the one slot is pinned: it waits
    engine.step()
    assert engine.stats().resident_loras == ("all8",) and not engine.groups["b"][0].is_ready
    assert [o.finish_reason for o in engine.abort("b")] == ["abort"]
    assert [a.ref.name for a in engine.loras.adapters.values()] == ["all8"]  # no slot, no request: forgotten
    assert [o.finish_reason for o in engine.abort("a")] == ["abort"]
    assert_idle(engine)
    check(engine, refs, expected, [("attn4", b), ("attn4", a)])  # all8 unpinned: evicted for attn4
    assert engine.stats().num_lora_evictions == 1 and engine.stats().resident_loras == ("attn4",)


def test_unload_drains_while_another_adapter_streams(engine_for, llama, refs, expected):
    engine = engine_for()
    a, b, c = mixed_prompts(llama[1], 3, seed=7, min_len=10, max_len=30)
    engine.add_request("a", a, GREEDY, lora=refs["all8"])
    engine.add_request("b", b, GREEDY, lora=refs["attn4"])
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert engine.unload_lora("attn4").error is None
    with pytest.raises(AdapterError, match="being unloaded") as refused:
        engine.add_request("late", c, GREEDY, lora=refs["attn4"])  # new requests for it are refused
    assert refused.value.status == 404 and "late" not in engine.groups
    assert "attn4" in engine.stats().resident_loras  # its request in flight keeps its slot
    engine.add_request("c", c, GREEDY, lora=refs["all8"])  # the other adapter takes new requests
    finals = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finals[o.request_id] = o
    assert {r: f.finish_reason for r, f in finals.items()} == {"a": "length", "b": "length", "c": "length"}
    assert tokens["a"] == expected("all8", a) and tokens["c"] == expected("all8", c)
    assert tokens["b"] == expected("attn4", b)  # in flight at the unload: finished, and with its adapter
    stats = engine.stats()
    assert stats.resident_loras == ("all8",) and stats.num_lora_evictions == 1
    assert engine.unload_lora("attn4").status == 404  # gone
    assert_idle(engine)
    assert engine.load_lora(refs["attn4"]).seconds > 0  # loaded again from its files
    check(engine, refs, expected, [("attn4", c)])


def test_a_name_loaded_again_with_other_weights_drains_the_old_ones(engine_for, llama, refs, expected,
                                                                    lora_adapters):
    engine = engine_for()
    old, new = (adapter_ref("x", str(lora_adapters[n]), "tiny") for n in ("all8", "attn4"))
    a, b = mixed_prompts(llama[1], 2, seed=13, min_len=10, max_len=30)
    engine.add_request("a", a, GREEDY, lora=old)
    tokens = {"a": list(engine.step()[0].new_token_ids)}
    assert engine.load_lora(new).error is None  # e.g. unloaded and loaded again from another path
    with pytest.raises(AdapterError, match="being unloaded"):
        engine.add_request("late", b, GREEDY, lora=old)
    engine.add_request("b", b, GREEDY, lora=new)
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert tokens == {"a": expected("all8", a), "b": expected("attn4", b)}  # each with its own weights
    assert engine.stats().resident_loras == ("x",) and engine.stats().num_lora_evictions == 1
    assert_idle(engine)


def test_ngram_speculation_on_an_adapter(engine_for, llama, refs, expected):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "auto_disable": False}  # drafts in every step that can have them
    engine = engine_for(speculative_config=spec)
    prompts = mixed_prompts(llama[1], 3, seed=8, min_len=10, max_len=30)
    cases = [(name, p + p) for name, p in zip(("all8", "mlp16", None), prompts)]  # repeats: drafts to verify
    results = check(engine, refs, expected, cases)
    assert sum(g[0].stats.num_draft_tokens for g in results[:2]) > 0


def test_a_constrained_adapter_row_picks_peft_s_best_allowed_token(engine_for, llama, refs, expected,
                                                                   tiny_checkpoints, lora_adapters):
    """Structured outputs per row beside adapters. The oracle of a choice's first token is exact: of the
    tokens that begin some choice, the one PEFT scores highest after the prompt; unconstrained rows in the
    same steps still equal PEFT."""
    tok = llama[1]
    words: list[str] = []  # whole words the tiny BPE keeps as one token, none a prefix of another
    for i in range(len(tok)):
        w = tok.decode([i])
        if (w.isalpha() and len(w) >= 3 and tok(w, add_special_tokens=False)["input_ids"] == [i]
                and not any(w.startswith(v) or v.startswith(w) for v in words)):
            words.append(w)
    words = words[:8]
    assert len(words) == 8
    starts = [i for i in range(len(tok)) if (t := tok.decode([i])) and any(w.startswith(t) for w in words)]
    choice = SamplingParams(max_tokens=8, temperature=0, structured=StructuredOutput("choice", json.dumps(words)))
    prompts = mixed_prompts(tok, 2, seed=11, min_len=8, max_len=30)
    cases = [(name, p) for p in prompts for name in (None, *NAMES)]
    engine = engine_for()
    results = engine.generate([p for _, p in cases] * 2, [choice] * len(cases) + [GREEDY] * len(cases),
                              [refs[n] if n else None for n, _ in cases] * 2)
    models = {None: load_hf(tiny_checkpoints["llama"]),
              **{n: peft_model(tiny_checkpoints["llama"], path) for n, path in lora_adapters.items()}}
    firsts = set()
    for (name, prompt), group in zip(cases, results[:len(cases)]):
        with torch.no_grad():
            logits = models[name](input_ids=torch.tensor([prompt])).logits[0, -1]  # (V,)
        best = starts[int(logits[starts].argmax())]
        assert group[0].text in words and group[0].token_ids[0] == best, f"{name}: {group[0].text!r}"
        firsts.add((tuple(prompt), best))
    assert len(firsts) > len(prompts)  # the adapters changed some first token: their rows did not run the base
    for (name, prompt), group in zip(cases, results[len(cases):]):
        assert list(group[0].token_ids) == expected(name, prompt), name
    assert_idle(engine)


def test_bad_adapters_fail_their_request_and_hold_nothing(engine_for, llama, refs, expected, tmp_path):
    engine = engine_for(max_lora_rank=8)  # mlp16's rank 16 is above the cap
    prompt = mixed_prompts(llama[1], 1, seed=9)[0]
    missing = LoraRef("ghost", "tiny", str(tmp_path / "nowhere"), b"\0" * 16)
    for ref, status in ((refs["mlp16"], 400), (missing, 404)):
        with pytest.raises(AdapterError) as failed:
            engine.add_request("bad", prompt, GREEDY, lora=ref)
        assert failed.value.status == status
        answer = engine.load_lora(ref, "q")
        assert (answer.request_id, answer.status) == ("q", status) and answer.error
    assert not engine.loras.adapters and engine.stats().num_lora_loads == 0
    assert_idle(engine)
    check(engine, refs, expected, [("all8", prompt), (None, prompt)])  # the engine serves on


def test_lora_off_has_no_slots_and_refuses_adapters(engine_for, llama, refs):
    engine = engine_for(max_loras=0)
    assert engine.parts.lora_slots is None and engine.loras is None and engine.info.lora is None
    assert engine.weight_bytes == llama[0].weight_bytes()
    with pytest.raises(ValueError, match="max_loras is 0"):
        engine.add_request("x", [5, 6, 7], GREEDY, lora=refs["all8"])
    assert engine.load_lora(refs["all8"]).status == 400 and engine.unload_lora("all8").status == 404
    assert engine.stats().num_lora_loads == 0 and not engine.groups


@pytest.mark.parametrize("kw,match", [(dict(tensor_parallel_size=2), "tensor or pipeline"),
                                      (dict(pipeline_parallel_size=2), "tensor or pipeline"),
                                      (dict(task="embed"), "embeddings"), (dict(max_lora_rank=0), "max_lora_rank"),
                                      (dict(max_loras=-1), "max_loras")])
def test_config_refuses_lora_where_it_is_not_served(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{"max_loras": 2, **kw})


def test_engine_process_loads_generates_and_unloads(tiny_checkpoints, llama, refs, expected):
    client = EngineCoreClient(EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", num_blocks=64,
                                           block_size=4, max_num_batched_tokens=64, max_num_seqs=8, enforce_eager=True,
                                           max_loras=1))
    prompt = mixed_prompts(llama[1], 1, seed=10, min_len=8, max_len=20)[0]

    async def run(ref):
        outs = [o async for o in client.generate(prompt, GREEDY, lora=ref)]
        return [t for o in outs for t in o.new_token_ids], outs[-1]

    async def main():
        assert client.info.lora is not None and client.info.lora.max_loras == 1
        loaded = await client.load_lora(refs["all8"])
        assert loaded.error is None and loaded.seconds > 0
        tokens, last = await run(refs["all8"])
        assert tokens == expected("all8", prompt) and last.stats.lora == "all8"
        tokens, _ = await run(refs["attn4"])  # not loaded: loaded on demand, evicting all8
        assert tokens == expected("attn4", prompt)
        _, failed = await run(LoraRef("ghost", "tiny", "/nowhere/at/all", b"\0" * 16))
        assert failed.finish_reason == "error" and "nowhere" in failed.error
        assert (await client.unload_lora("attn4")).error is None
        assert (await client.unload_lora("attn4")).status == 404
        for _ in range(200):  # the stats value that follows the last command
            if client.stats.resident_loras == () and client.stats.num_lora_evictions == 2:
                break
            await asyncio.sleep(0.01)
        stats = client.stats
        assert (stats.num_lora_loads, stats.num_lora_evictions, stats.resident_loras) == (2, 2, ())
        assert stats.num_used_blocks == 0

    try:
        asyncio.run(main())
    finally:
        client.shutdown()
