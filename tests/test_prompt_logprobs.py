"""Prompt logprobs (vLLM's `prompt_logprobs`, completions' `echo`) against HF's fp32 logits on the tiny
MHA / GQA / MQA models: computed in the prefill that serves the request, chunk by chunk, never skipped by
a prefix-cache hit, kept across a preemption, also on a pipeline-sharded engine; the API's shapes (whole
and streamed, the openai SDK), and bad input."""
import asyncio
import json
import time

import httpx
import openai
import pytest
import torch

from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.sampler import PROMPT_HEAD_ROWS, PROMPT_ROWS_AT_ONCE, prompt_logprobs, score_prompt_rows
from server.http_app import create_app
from server.model_client import LocalModelClient
from server.openai_api import ApiLimits, OpenAIApi
from server.worker import ModelWorker
from tests.reference import load_hf

TOL = 1e-4  # fp32 against fp32: the same sums in another order
LONG = ("Keys and values are cached in blocks of sixteen tokens; queries attend to every earlier position. "
        "The quick brown fox jumps over the lazy dog.")
SHORT = "The capital of France is"
OTHER = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate."
CHUNK = 16  # max_num_batched_tokens: LONG's prefill takes several steps


@pytest.fixture(scope="module")
def hf_rows(tiny_variants):
    """(model name, prompt ids) -> HF's fp32 log_softmax rows (T, V), each HF model loaded once."""
    models = {}

    @torch.no_grad()
    def rows(name: str, ids: list[int]) -> torch.Tensor:
        if name not in models:
            models[name] = load_hf(tiny_variants[name])
        return models[name](torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return rows


@pytest.fixture(scope="module")
def engines(tiny_variants):
    """name -> an eager fp32 engine whose prefills go in chunks of CHUNK tokens, with the prefix cache on."""
    made = {}

    def get(name: str, **kw) -> LLMEngine:
        key = (name, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = LLMEngine(EngineConfig(**{
                "model": str(tiny_variants[name]), "dtype": "float32", "block_size": 4, "kv_cache_memory": None,
                "num_blocks": 256, "max_model_len": 256, "max_num_batched_tokens": CHUNK, "max_num_seqs": 8,
                "enforce_eager": True,
                **kw}))
        return made[key]
    return get


def assert_matches_hf(values, ids: list[int], rows: torch.Tensor, k: int) -> None:
    """Per prompt token after the first: its logprob, its rank and its k best against HF's rows."""
    assert values is not None and len(values) == len(ids) - 1
    for p, v in enumerate(values):
        row, token = rows[p], ids[p + 1]
        want = row[token].item()
        assert v.token_id == token and abs(v.logprob - want) < TOL, (p, v.logprob, want)
        # NOTE: the rank as HF's row gives it, up to the tokens within TOL of this one
        assert int((row > want + TOL).sum()) + 1 <= v.rank <= int((row >= want - TOL).sum()), (p, v.rank)
        assert len(v.top) == k
        best = row.topk(k).values.tolist() if k else []
        for (tid, value), b in zip(v.top, best):
            assert abs(value - row[tid].item()) < TOL and abs(value - b) < TOL


@pytest.mark.kernel  # make test-isa runs it again under the AVX2 cap and on the portable build
@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_give_log_softmax_values_ranks_and_the_best(fused, dtype):
    g = torch.Generator().manual_seed(0)
    # NOTE: two of torch's slices of rows; 1,003 words: the kernel's vectors and its scalar tail
    logits = (3 * torch.randn(PROMPT_ROWS_AT_ONCE + 44, 1003, generator=g)).to(dtype)
    logits[5, 40:60] = logits[5].max() + 1  # 20 tied best: the kernel's k best are the lowest ids among them
    targets = torch.randint(0, 1003, (len(logits),), generator=g).tolist()
    targets[5] = 45
    ks = [i % 6 for i in range(len(logits))]
    ks[5] = 5
    ref = logits.float().log_softmax(-1)
    values = prompt_logprobs(logits, targets, ks, fused=fused)
    assert len(values) == len(logits)
    for row, token, k, v in zip(ref, targets, ks, values):
        assert v.token_id == token and abs(v.logprob - row[token].item()) < 1e-5
        assert v.rank == int((row >= row[token]).sum())
        best = row.topk(k).values.tolist() if k else []
        assert len(v.top) == k and all(abs(value - b) < 1e-5 for (_, value), b in zip(v.top, best))
        assert all(abs(value - row[t].item()) < 1e-5 for t, value in v.top) and len({t for t, _ in v.top}) == k
    assert values[5].rank == 20 and {t for t, _ in values[5].top} <= set(range(40, 60))
    if fused:  # NOTE: torch's topk orders ties as it likes
        assert [t for t, _ in values[5].top] == [40, 41, 42, 43, 44]


@pytest.mark.kernel
@pytest.mark.parametrize("fused, tol", [(True, 5e-6), (False, 1e-4)], ids=["kernel", "torch"])
def test_rows_of_a_served_vocabulary_against_fp64(fused, tol):
    """The default model's vocabulary width, bf16 rows as its LM head gives them. fp32 sums of 49,152
    terms drift: torch's log_softmax by up to 2e-5 here; the kernel sums in a double every 64 vectors."""
    g = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(64, 49152, generator=g)).bfloat16()
    targets = torch.randint(0, 49152, (64,), generator=g).tolist()
    ref = logits.double().log_softmax(-1)
    for row, token, v in zip(ref, targets, prompt_logprobs(logits, targets, [20] * 64, fused=fused)):
        assert abs(v.logprob - row[token].item()) < tol and v.rank == int((row >= row[token]).sum())
        assert all(abs(value - b) < tol for (_, value), b in zip(v.top, row.topk(20).values.tolist()))


def test_a_long_prompt_goes_through_the_lm_head_in_slices_scored_as_one():
    g = torch.Generator().manual_seed(2)
    head, hidden = torch.randn(500, 32, generator=g), torch.randn(2 * PROMPT_HEAD_ROWS + 9, 32, generator=g)
    targets = torch.randint(0, 500, (len(hidden),), generator=g).tolist()
    ks = [i % 3 for i in range(len(hidden))]
    slices = []
    sliced = score_prompt_rows(lambda h: slices.append(len(h)) or h @ head.T, hidden, targets, ks)
    assert slices == [PROMPT_HEAD_ROWS, PROMPT_HEAD_ROWS, 9]
    whole = prompt_logprobs(hidden @ head.T, targets, ks)
    assert len(sliced) == len(whole) == len(hidden)
    for a, b in zip(sliced, whole):
        assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
        assert abs(a.logprob - b.logprob) < 1e-5


@pytest.mark.parametrize("name", ["tiny-mha", "tiny-gqa", "tiny-mqa"])
def test_prompt_logprobs_match_hf_in_chunks_and_past_a_cached_prefix(engines, hf_rows, name):
    engine = engines(name)
    long, other = (engine.tokenizer(t)["input_ids"] for t in (LONG, OTHER))
    assert len(long) > 2 * CHUNK
    plain = SamplingParams(max_tokens=2, temperature=0)
    engine.generate([long], plain)  # NOTE: the prompt's blocks are now in the prefix cache
    partial, queries = engine.scheduler.num_partial_prefills, engine.scheduler.num_prefix_queries
    scored = [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=5),
              SamplingParams(max_tokens=0, prompt_logprobs=0), SamplingParams(max_tokens=3, temperature=0)]
    a, b, c = (g[0] for g in engine.generate([long, other, long], scored))
    assert engine.scheduler.num_partial_prefills - partial >= len(long) // CHUNK  # the prefill went in chunks
    assert a.stats.num_cached_tokens == 0  # no hit skipped a position to score...
    assert c.stats.num_cached_tokens > 0  # ... while the same prompt without them hits
    assert engine.scheduler.num_prefix_queries - queries == len(long)  # only the one that looked it up counts
    assert_matches_hf(a.prompt_logprobs, long, hf_rows(name, long), 5)
    assert_matches_hf(b.prompt_logprobs, other, hf_rows(name, other), 0)
    assert c.prompt_logprobs is None and a.logprobs == ()  # only where asked for
    # the generated tokens are the same as without prompt logprobs; max_tokens 0 generates none
    assert a.token_ids == c.token_ids[:2] and (b.token_ids, b.finish_reason) == ((), "length")
    assert b.stats.num_output_tokens == 0
    d = engine.generate([other], plain)[0][0]  # only a scoring request had this prompt: it filled the cache
    assert d.stats.num_cached_tokens > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_samples_share_one_scoring_and_a_preempted_request_keeps_its_own(engines, hf_rows):
    engine = engines("tiny-gqa", num_blocks=40)  # two LONG prompts + 24 tokens each do not fit: one is preempted
    long = engine.tokenizer(LONG)["input_ids"]
    rows = hf_rows("tiny-gqa", long)
    group = engine.generate([long], SamplingParams(max_tokens=4, temperature=1.0, seed=1, n=2, prompt_logprobs=2))[0]
    assert group[0].prompt_logprobs == group[1].prompt_logprobs
    assert group[1].stats.num_cached_tokens > 0  # the sibling reuses the prompt its sister scored
    assert_matches_hf(group[0].prompt_logprobs, long, rows, 2)
    before = engine.scheduler.num_preemptions
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=1)
    results = engine.generate([long, long[:-1]], params)
    assert engine.scheduler.num_preemptions > before
    assert_matches_hf(results[0][0].prompt_logprobs, long, rows, 1)
    assert_matches_hf(results[1][0].prompt_logprobs, long[:-1], rows, 1)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_pipeline_sharded_engine_scores_its_prompts_too(tiny_variants, hf_rows, ray_session):
    """The rows come back from the last stage's ranks (DistributedRunner), with two steps in flight."""
    engine = LLMEngine(EngineConfig(model=str(tiny_variants["tiny-gqa"]), dtype="float32", pipeline_parallel_size=2,
                                    block_size=4, num_blocks=128, kv_cache_memory=None, max_num_batched_tokens=CHUNK,
                                    max_num_seqs=8, enforce_eager=True, worker_cpus=0.25))
    try:
        prompts = [engine.tokenizer(t)["input_ids"] for t in (LONG, OTHER)]
        results = engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2))
        for ids, group in zip(prompts, results):
            assert_matches_hf(group[0].prompt_logprobs, ids, hf_rows("tiny-gqa", ids), 2)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.in_flight
    finally:
        engine.executor.shutdown()


# ---- the HTTP API -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(tiny_variants):
    worker = ModelWorker("tiny", EngineConfig(model=str(tiny_variants["tiny-gqa"]), dtype="float32", num_blocks=128,
                                              kv_cache_memory=None, block_size=4, max_model_len=256,
                                              max_num_batched_tokens=CHUNK, max_num_seqs=8, enforce_eager=True))
    yield worker, create_app(OpenAIApi({"tiny": LocalModelClient(worker)}, ApiLimits(max_n=4, max_tokens=64)))
    worker.shutdown()


def post(app, path: str, body: dict) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body)
    return asyncio.run(go())


def stream(app, path: str, body: dict) -> list[dict]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            async with c.stream("POST", path, json={**body, "stream": True}) as r:
                assert r.status_code == 200
                return [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    lines = asyncio.run(go())
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def used_blocks(worker: ModelWorker) -> int:
    """The engine's blocks in use once its stats caught up (they come with its outputs)."""
    for _ in range(100):
        stats = worker.stats()
        if stats["num_used_blocks"] == 0 and stats["num_unfinished_groups"] == 0:
            break
        time.sleep(0.02)
    return stats["num_used_blocks"]


def test_echo_scores_the_prompt_as_openai_legacy_did(client, hf_rows):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, max_tokens 0 (or 1), temperature 0."""
    worker, app = client
    ids = worker.tokenizer(LONG)["input_ids"]
    rows = hf_rows("tiny-gqa", ids)
    for max_tokens in (0, 1):
        body = post(app, "/v1/completions", {"model": "tiny", "prompt": LONG, "echo": True, "logprobs": 1,
                                              "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).json()
        choice = body["choices"][0]
        assert choice["text"].startswith(LONG) and body["usage"]["completion_tokens"] == max_tokens
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert "".join(lp["tokens"][:len(ids)]) == LONG and lp["text_offset"][1] == len(lp["tokens"][0])
        for p in range(1, len(ids)):
            want = rows[p - 1]
            assert abs(lp["token_logprobs"][p] - want[ids[p]].item()) < TOL
            (top, value), = lp["top_logprobs"][p].items()
            assert abs(value - want.max().item()) < TOL
            assert top == worker._token_str(int(want.argmax()))[0]  # a piece of a character as bytes:\xNN
        assert choice["finish_reason"] == "length"
    assert used_blocks(worker) == 0


def test_echo_streamed_and_whole_agree_and_token_prompts_echo_their_text(client):
    worker, app = client
    ids = worker.tokenizer(SHORT)["input_ids"]
    body = {"model": "tiny", "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}
    whole = post(app, "/v1/completions", body).json()["choices"][0]
    assert whole["text"].startswith(worker.tokenizer.decode(ids))
    events = [e["choices"][0] for e in stream(app, "/v1/completions", body)]
    assert "".join(e["text"] for e in events) == whole["text"]
    assert events[0]["text"].startswith(SHORT)  # the echo comes first
    streamed = [x for e in events if e["logprobs"] for x in e["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"] and len(streamed) == len(ids) + 5
    plain = post(app, "/v1/completions", {**body, "echo": False}).json()["choices"][0]
    assert whole["text"] == worker.tokenizer.decode(ids) + plain["text"]  # echo changes no token


def test_vllm_prompt_logprobs_on_both_endpoints(client, hf_rows):
    worker, app = client
    ids = worker.tokenizer(SHORT)["input_ids"]
    rows = hf_rows("tiny-gqa", ids)
    choice = post(app, "/v1/completions", {"model": "tiny", "prompt": SHORT, "max_tokens": 2, "temperature": 0,
                                           "prompt_logprobs": 3}).json()["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for p in range(1, len(ids)):
        entry, row = scored[p], rows[p - 1]
        assert str(ids[p]) in entry and len(entry) in (3, 4)  # the prompt's token, and the 3 best
        mine = entry[str(ids[p])]
        assert abs(mine["logprob"] - row[ids[p]].item()) < TOL and mine["rank"] >= 1
        assert mine["decoded_token"] == worker.tokenizer.decode([ids[p]])
        best = sorted((v for k, v in entry.items() if v["rank"] <= 3), key=lambda v: v["rank"])
        assert [v["rank"] for v in best][:3] == [1, 2, 3]
        assert abs(best[0]["logprob"] - row.max().item()) < TOL
    messages = [{"role": "user", "content": SHORT}]
    chat = post(app, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 2,
                                              "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in chat["prompt_logprobs"][1:])
    plain = post(app, "/v1/completions", {"model": "tiny", "prompt": SHORT, "max_tokens": 2}).json()
    assert "prompt_logprobs" not in plain["choices"][0] and "prompt_logprobs" not in chat["choices"][0]


def test_the_openai_sdk_scores_a_prompt(client):
    worker, app = client

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
            return await sdk.completions.create(model="tiny", prompt=SHORT, echo=True, logprobs=1, max_tokens=0,
                                                extra_body={"prompt_logprobs": 1})
    out = asyncio.run(go())
    choice = out.choices[0]
    assert choice.text == SHORT and choice.logprobs.token_logprobs[0] is None
    n = len(worker.tokenizer(SHORT)["input_ids"])
    assert len(choice.logprobs.token_logprobs) == n and all(v < 0 for v in choice.logprobs.token_logprobs[1:])
    scored = choice.model_extra["prompt_logprobs"]  # vLLM's field beside OpenAI's
    assert len(scored) == n and scored[0] is None and all(any(v["rank"] == 1 for v in e.values()) for e in scored[1:])
    for e, value in zip(scored[1:], choice.logprobs.token_logprobs[1:]):
        assert value in [v["logprob"] for v in e.values()]


@pytest.mark.parametrize("path,patch,param,says", [
    ("/v1/chat/completions", {"echo": True}, "echo", "/v1/completions"),
    ("/v1/chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs", "20"),
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs", "20"),
    ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs", "0"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens", "echo"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens", None),
    ("/v1/completions", {"echo": "yes"}, "echo", None),
])
def test_bad_input_is_a_400_that_says_why(client, path, patch, param, says):
    worker, app = client
    base = ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]} if "chat" in path else
            {"model": "tiny", "prompt": SHORT})
    resp = post(app, path, {**base, "max_tokens": 2, **patch})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert says is None or says in error["message"], error
    assert used_blocks(worker) == 0
