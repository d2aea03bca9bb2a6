"""Constrained decoding in the engine (xgrammar): outputs stay inside their grammar, are the same
alone or batched (preemption, chunked prefill, prefix hits), compiling never holds the loop, and
the default model's answers to 50 varied schemas all validate."""
import json
import re
import threading

import jsonschema
import pytest
import torch

from loadtests.structured_schemas import SCHEMAS, messages
from models import load_model, load_tokenizer
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.errors import InvalidRequestError
from server.engine.grammar import GrammarCache, apply_bitmask, check
from server.engine.sampling_params import StructuredOutput
from server.worker import encode_prompt
from tests.tiny import mixed_prompts

REGEX = StructuredOutput("regex", r"(better|simple|[0-9]{1,3})( (is|than|nested|[a-z]{2,5}))*\.")
CHOICE = StructuredOutput("choice", json.dumps(["Paris", "Beautiful is better", 'quote "q"', "ünï"]))
EBNF = StructuredOutput("grammar", 'root ::= "The answer is " [0-9]+ "." | "No."')
JSON = StructuredOutput("json", json.dumps({"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"},
    "tag": {"enum": ["a", "b"]}}, "required": ["n", "ok", "tag"], "additionalProperties": False}))
SPECS = [REGEX, CHOICE, EBNF, JSON, None]


def matches(spec: StructuredOutput, text: str) -> bool:
    if spec.kind == "regex":
        return re.fullmatch(spec.spec, text) is not None
    if spec.kind == "choice":
        return text in json.loads(spec.spec)
    if spec.kind == "grammar":
        return re.fullmatch(r"The answer is [0-9]+\.|No\.", text) is not None
    value = json.loads(text)
    jsonschema.validate(value, json.loads(spec.spec))
    return True


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return load_model(path, "float32"), load_tokenizer(path)


def engine(tiny, **kw):
    cfg = dict(model="tiny", dtype="float32", num_blocks=256, block_size=4, max_num_batched_tokens=512,
               max_num_seqs=32)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), model=tiny[0], tokenizer=tiny[1])


def params(spec, **kw):
    return SamplingParams(**{"max_tokens": 48, "temperature": 0, "structured": spec, **kw})


def test_greedy_outputs_match_their_grammar_alone_and_batched_with_preemption_chunks_and_prefix_hits(tiny):
    """16 requests, every kind of grammar and unconstrained ones, in one batch on a pool small
    enough to preempt, a token budget small enough to chunk prompts, and shared prefixes: every
    output is the one its request gives alone, and each constrained one is in its grammar."""
    tok = tiny[1]
    prompts = mixed_prompts(tok, 12, seed=3, min_len=8, max_len=60)
    prompts += [prompts[0] + prompts[1][:5], prompts[0] + prompts[2][:3], prompts[0], prompts[3][:20]]  # prefix hits
    specs = [SPECS[i % len(SPECS)] for i in range(len(prompts))]
    alone = []
    solo = engine(tiny)
    for prompt, spec in zip(prompts, specs):
        alone.append(solo.generate([prompt], params(spec))[0][0])
    busy = engine(tiny, num_blocks=48, max_num_batched_tokens=40)
    together = busy.generate(prompts, [params(s) for s in specs])
    assert busy.scheduler.num_preemptions > 0 and busy.scheduler.num_partial_prefills > 0
    assert busy.scheduler.num_prefix_hits > 0
    for spec, a, b in zip(specs, alone, together):
        assert b[0].token_ids == a.token_ids
        if spec is not None and a.finish_reason == "stop":
            assert matches(spec, a.text), (spec.kind, a.text)
    constrained_stops = [a for a, s in zip(alone, specs) if s is not None and a.finish_reason == "stop"]
    assert len(constrained_stops) >= 6  # the finite grammars end with "stop" inside max_tokens
    assert busy.kv.num_free_blocks == busy.kv.num_blocks


def test_sampling_fields_apply_inside_the_mask(tiny):
    """Temperature, top-k / top-p / min-p and penalties on constrained rows: still in the grammar,
    and a seeded draw repeats itself."""
    eng = engine(tiny)
    prompt = mixed_prompts(tiny[1], 1, seed=5)[0]
    kw = dict(temperature=1.5, top_k=50, top_p=0.95, min_p=0.01, repetition_penalty=1.2, presence_penalty=0.5,
              n=4, seed=7)
    for spec in (CHOICE, EBNF, JSON):
        first = eng.generate([prompt], params(spec, **kw))[0]
        again = eng.generate([prompt], params(spec, **kw))[0]
        assert [r.token_ids for r in first] == [r.token_ids for r in again]
        for r in first:
            if r.finish_reason == "stop":
                assert matches(spec, r.text), (spec.kind, r.text)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_a_finished_grammar_stops_even_with_ignore_eos(tiny):
    eng = engine(tiny)
    prompt = mixed_prompts(tiny[1], 1, seed=1)[0]
    result = eng.generate([prompt], params(CHOICE, ignore_eos=True, max_tokens=40))[0][0]
    assert result.finish_reason == "stop" and result.text in json.loads(CHOICE.spec)


def test_a_slow_compile_does_not_hold_other_requests(tiny, monkeypatch):
    """While one request's grammar compiles (held here until released), another request runs
    to its end; then the constrained one is served."""
    release = threading.Event()
    real = GrammarCache._compile

    def slow(self, spec):
        assert release.wait(60)
        return real(self, spec)
    monkeypatch.setattr(GrammarCache, "_compile", slow)
    eng = engine(tiny)
    a, b = mixed_prompts(tiny[1], 2, seed=2)
    eng.add_request("constrained", b, params(EBNF))
    eng.add_request("free", a, params(None, max_tokens=12, ignore_eos=True))
    finished = {}
    while "free" not in finished:
        for out in eng.step():
            assert out.request_id == "free", "the constrained request ran before its grammar was ready"
            if out.finished:
                finished[out.request_id] = out
    assert finished["free"].finish_reason == "length"
    assert eng.groups["constrained"][0].num_computed_tokens == 0
    release.set()
    text = ""
    while eng.has_unfinished():
        for out in eng.step():
            text += out.new_text
    assert matches(EBNF, text)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_a_grammar_that_fails_to_compile_ends_its_request_with_an_error(tiny, monkeypatch):
    def broken(self, spec):
        raise RuntimeError("compiler exploded")
    monkeypatch.setattr(GrammarCache, "_compile", broken)
    eng = engine(tiny)
    prompt = mixed_prompts(tiny[1], 1)[0]
    eng.add_request("x", prompt, params(JSON, n=2))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [(o.finish_reason, "compiler exploded" in o.error) for o in outs] == [("error", True)] * 2
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


@pytest.mark.parametrize("spec, param", [
    (StructuredOutput("json", '{"type": "foo"}'), "structured_outputs"),
    (StructuredOutput("json", "{not json", param="response_format"), "response_format"),
    (StructuredOutput("regex", "(abc"), "structured_outputs"),
    (StructuredOutput("grammar", "root ::= missing_rule"), "structured_outputs"),
])
def test_check_names_the_field_of_a_grammar_that_cannot_compile(spec, param):
    with pytest.raises(InvalidRequestError) as e:
        check(spec)
    assert e.value.param == param and "cannot be compiled" in str(e.value)


# CI: each of the 50 schemas once, half of them greedy and half sampled (one batch); every schema at
# both temperatures is exhaustive (make test-all)
SCHEMA_RUNS = [pytest.param("half", id="half-greedy-half-sampled"),
               pytest.param(0.0, marks=pytest.mark.exhaustive), pytest.param(0.8, marks=pytest.mark.exhaustive)]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", SCHEMA_RUNS)
def test_default_model_answers_50_varied_schemas_validly(default_model_dir, temperature):
    """The default model, constrained: every answer parses and validates with jsonschema.
    NOTE: exact activations. A `[0-9]+` pattern lets greedy decoding repeat a digit up to max_tokens,
    and with int8 ones (auto's choice here on x86) the greedy semver answer does: "1111…" on AVX512-VNNI
    (2026-12-04). Bounding such runs is issue 37's; until then this test holds the exact model to 50/50."""
    eng = LLMEngine(EngineConfig(model=str(default_model_dir), num_blocks=2048, max_num_seqs=64, activations="exact"))
    prompts = [encode_prompt(eng.tokenizer, "default", messages=messages(what)) for what, _ in SCHEMAS]
    temps = [(0.0, 0.8)[i % 2] if temperature == "half" else temperature for i in range(len(SCHEMAS))]
    ps = [SamplingParams(max_tokens=1024, temperature=t, seed=i, structured=StructuredOutput("json", json.dumps(schema)))
          for i, ((_, schema), t) in enumerate(zip(SCHEMAS, temps))]
    for (what, schema), group in zip(SCHEMAS, eng.generate(prompts, ps)):
        result = group[0]
        assert result.finish_reason == "stop", (what, result.text[-200:])
        jsonschema.validate(json.loads(result.text), schema)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3]])
def test_apply_bitmask_equals_xgrammars_own(dtype, rows):
    """Our unpacking of the mask words sets exactly the logits xgrammar's kernel sets to -inf."""
    import xgrammar

    vocab = 1000  # not a multiple of 32: the last word is partly padding
    gen = torch.Generator().manual_seed(len(rows))
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), -(-vocab // 32)), dtype=torch.int32, generator=gen)
    bitmask[0, :5] = -1  # all allowed
    bitmask[-1, 5:9] = 0  # none allowed
    logits = torch.randn(4, vocab, generator=gen).to(dtype)
    ours, theirs = logits.clone(), logits.clone()
    apply_bitmask(ours, (bitmask, rows))
    full = torch.full((4, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgrammar.apply_token_bitmask_inplace(theirs, full, vocab_size=vocab, indices=rows)
    assert torch.equal(ours, theirs)
    assert not torch.isinf(ours[rows[0], :160]).any() and torch.isinf(ours[rows[-1], 160:288]).all()
    assert all(torch.equal(ours[r], logits[r]) for r in range(4) if r not in rows)
