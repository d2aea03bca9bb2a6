"""Priority scheduling (`--scheduling-policy priority`, vLLM's): waiting requests admitted by
(priority, arrival), the worst running one preempted first, equal priorities exactly FCFS's schedule,
greedy outputs unchanged, preemptions counted by priority, bad priorities a 400."""
import asyncio
import json
import random
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcache.manager import KVCacheManager
from models import load_model, load_tokenizer
from server.cli import _engine_config, build_parser
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.errors import InvalidRequestError
from server.engine.request import Request
from server.engine.scheduler import Scheduler
from server.http_app import create_app
from server.metrics import MetricsRecorder
from server.model_client import LocalModelClient
from server.openai_api import ApiLimits, OpenAIApi
from server.prometheus import render_prometheus
from server.serve_config import ServeConfig
from server.worker import ModelWorker

BLOCK = 4


# ---- the scheduler alone, over a real KV manager -------------------------------------------------
def simulate(policy: str, specs: list[tuple], num_blocks: int, max_num_seqs: int, budget: int = 64,
             caching: bool = False) -> list[tuple]:
    """Drive a Scheduler as the engine does; `specs`: (id, prompt, max_tokens, priority, n) in arrival order.
    Each sampled token is a function of the sequence's length (scheduling reads lengths, and the prefix
    cache hashes values). Returns per step: ((id, new tokens, computed before, samples) scheduled, admitted ids,
    preempted ids, ids waiting before it)."""
    kv = KVCacheManager(num_blocks, BLOCK, caching)
    sch = Scheduler(kv, budget, max_num_seqs, bytes_per_block=1, policy=policy)
    everyone: list[Request] = []
    for rid, prompt, max_tokens, priority, n in specs:
        params = SamplingParams(max_tokens=max_tokens, priority=priority, n=n)
        group = [Request(rid if n == 1 else f"{rid}#{i}", prompt, params, None, index=i, group_id=rid)
                 for i in range(n)]
        everyone += group
        sch.add(group)
    steps = []
    while not all(r.is_finished for r in everyone):
        assert len(steps) < 2000, "the schedule does not progress"
        waiting = tuple(r.request_id for r in sch.waiting)
        out = sch.schedule()
        steps.append((tuple((s.request.request_id, s.num_new_tokens, s.num_computed_tokens, s.samples)
                            for s in out.seqs),
                      tuple(s.request.request_id for s in out.seqs if s.request.request_id in waiting),
                      out.preempted, waiting))
        for s in out.seqs:
            req = s.request
            if s.samples:
                req.append_token((req.num_tokens * 7 + req.index) % 50, 0.0)
                if len(req.output_token_ids) >= req.params.max_tokens:
                    sch.finish(req, "length")
        sch.advance(out)
    assert kv.num_used_blocks == 0 and not sch.running and not sch.waiting
    return steps


def admitted(steps) -> list[str]:
    return [rid for _, adm, _, _ in steps for rid in adm]


def preempted(steps) -> list[str]:
    return [rid for _, _, pre, _ in steps for rid in pre]


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    # two at a time, blocks to spare: each pair runs to its end before the next two are admitted
    specs = [(rid, [1, 2, 3, 4], 3, p, 1) for rid, p in (("a", 3), ("b", 1), ("c", 3), ("d", 0), ("e", 1), ("f", 2))]
    assert admitted(simulate("fcfs", [s[:3] + (0, 1) for s in specs], 64, 2)) == list("abcdef")
    steps = simulate("priority", specs, 64, 2)
    assert admitted(steps) == list("dbefac")  # 0, then the two 1s in arrival order, 2, then the two 3s
    assert [adm for _, adm, _, _ in steps if adm] == [("d", "b"), ("e", "f"), ("a", "c")]
    assert preempted(steps) == []


def test_blocks_run_out_the_worst_priority_is_preempted_and_readmitted_by_priority():
    """4 prompts of one block each, 8 tokens each: the 6-block pool holds all four only until they
    grow. FCFS preempts the newest (z, then y); the priority policy the worst (y = 3, then w = 2), and
    readmits w before y, which waited longer."""
    specs = [("w", [1, 2, 3, 4], 8, 2, 1), ("x", [5, 6, 7, 8], 8, 0, 1), ("y", [9, 10, 11, 12], 8, 3, 1),
             ("z", [13, 14, 15, 16], 8, 1, 1)]
    fcfs = simulate("fcfs", [s[:3] + (0, 1) for s in specs], 6, 4)
    assert admitted(fcfs)[:4] == list("wxyz") and preempted(fcfs) == ["z", "y"]
    steps = simulate("priority", specs, 6, 4)
    assert admitted(steps) == ["x", "z", "w", "y", "w", "y"]
    assert preempted(steps) == ["y", "w"]
    assert [i for i, (_, _, pre, _) in enumerate(steps) if pre] == [1, 5]  # the 2nd and 3rd blocks' steps
    # a preempted request is recomputed whole: w had 5 tokens out, so 9 tokens come back in one prefill
    readmit = next(seqs for seqs, adm, _, _ in steps[6:] if "w" in adm)
    assert ("w", 9, 0, True) in readmit


@pytest.mark.parametrize("cache_output_blocks", [True, False])
def test_output_blocks_are_shared_only_where_output_tokens_take_the_prompt_kernel(cache_output_blocks):
    """A request's blocks are cached as they fill; where prompt tokens take another kernel than output tokens (the
    amx level's prompt tiles: server/engine/model_runner.py `prompt_tiles`), only those of its prompt. The next turn
    holds the output as prompt tokens: a hit on blocks decode computed would give it other KV than a miss."""
    kv = KVCacheManager(16, BLOCK, True)
    sch = Scheduler(kv, 64, 4, bytes_per_block=1, cache_output_blocks=cache_output_blocks)
    req = Request("a", list(range(10)), SamplingParams(max_tokens=8), None)
    sch.add([req])
    while not req.is_finished:
        out = sch.schedule()
        if out.seqs[0].samples:
            req.append_token(40 + req.num_tokens, 0.0)
            if len(req.output_token_ids) == 8:
                sch.finish(req, "length")
        sch.advance(out)
    # 10 prompt tokens and 8 output ones, 17 of them computed: blocks 0-1 hold prompt tokens only, 2-3 output ones too
    hit = kv.find_prefix("b", req.all_token_ids + [99])
    assert [b.block_id for b in hit.blocks[0]] == ([0, 1, 2, 3] if cache_output_blocks else [0, 1])
    assert len(kv.pool.cached) == len(hit.blocks[0])


def random_case(seed: int, priorities: list[int] | None) -> tuple[list[tuple], dict]:
    """Mixed prompts (some sharing a prefix, for cache hits), lengths and n, priorities from the list (else 0);
    a tight pool, a small token budget (chunked prefill) or not, prefix caching or not."""
    rng = random.Random(seed)
    shared = [rng.randrange(50) for _ in range(12)]
    specs = []
    for i in range(rng.randint(6, 14)):
        prompt = (shared if rng.random() < 0.4 else []) + [rng.randrange(50) for _ in range(rng.randint(1, 30))]
        specs.append((f"r{i}", prompt, rng.randint(1, 20), rng.choice(priorities) if priorities else 0,
                      rng.choice((1, 1, 1, 2))))
    kw = dict(num_blocks=rng.randint(24, 40), max_num_seqs=rng.randint(2, 6), budget=rng.choice((8, 16, 64)),
              caching=rng.random() < 0.5)
    return specs, kw


def coverage(steps) -> Counter:
    """What a schedule exercised: preemptions, prefill chunks short of the prompt, prefix hits."""
    return Counter(preempted=len(preempted(steps)),
                   chunked=sum(not samples for seqs, _, _, _ in steps for *_, samples in seqs),
                   prefix_hits=sum(c > 0 for seqs, adm, _, _ in steps for rid, _, c, _ in seqs if rid in adm))


def test_equal_priorities_give_fcfs_schedule_step_for_step():
    """40 random cases (tight pools, chunked prefill, prefix hits, n > 1): the priority policy with every
    priority equal schedules as FCFS, step for step (ids, tokens, victims, queue)."""
    seen = Counter()
    for seed in range(40):
        specs, kw = random_case(seed, None)
        fcfs = simulate("fcfs", specs, **kw)
        assert simulate("priority", [s[:3] + (7,) + s[4:] for s in specs], **kw) == fcfs, seed
        seen += coverage(fcfs)
    assert min(seen["preempted"], seen["chunked"], seen["prefix_hits"]) > 10, seen


def test_mixed_priorities_admit_the_best_and_preempt_the_worst():
    """40 random cases: each step admits the best of what waited, best first, and each victim is at
    least as bad as every request the step kept."""
    seen = Counter()
    for seed in range(40):
        specs, kw = random_case(seed, [-5, 0, 0, 1, 3, 2**40])
        priority = {f"{rid}#{i}" if n > 1 else rid: p for rid, _, _, p, n in specs for i in range(n)}
        steps = simulate("priority", specs, **kw)
        for seqs, adm, pre, waiting in steps:
            if pre:
                assert not adm  # a step that preempts admits nothing, as FCFS
                assert min(priority[v] for v in pre) >= max((priority[rid] for rid, *_ in seqs), default=-(2**63))
            assert [priority[r] for r in adm] == sorted(priority[r] for r in adm)
            left = [priority[r] for r in waiting if r not in adm]
            assert max((priority[r] for r in adm), default=-(2**63)) <= min(left, default=2**63)
        seen += coverage(steps)
    assert seen["preempted"] > 10, seen


def test_policy_from_the_command_line_and_serve_yaml_and_unknown_ones_refused():
    parser = build_parser()
    assert _engine_config(parser.parse_args(["serve"])).scheduling_policy == "fcfs"  # vLLM's default
    assert _engine_config(parser.parse_args(["serve", "--scheduling-policy", "priority"])).scheduling_policy == \
        "priority"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--scheduling-policy", "sjf"])
    cfg = ServeConfig.from_args({"engine": {"scheduling_policy": "priority"}})
    assert cfg.engine_config("m").scheduling_policy == "priority"
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="sjf")
    with pytest.raises(ValueError, match="policy"):
        Scheduler(KVCacheManager(8, BLOCK), 64, 4, 1, policy="lifo")


# ---- the engine on a tiny checkpoint -------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    return load_model(path), load_tokenizer(path)


def engine_for(tiny, policy: str) -> tuple[LLMEngine, list]:
    """A pool too small for the batch (preemption), a token budget below the prompts (chunked prefill);
    and the scheduler's outputs, step by step (a spy around the real `schedule`)."""
    model, tok = tiny
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_blocks=40, block_size=BLOCK,
                                    max_num_batched_tokens=32, max_num_seqs=6, enforce_eager=True,
                                    scheduling_policy=policy), model=model, tokenizer=tok)
    log, schedule = [], engine.scheduler.schedule

    def spy(*args, **kwargs):
        out = schedule(*args, **kwargs)
        log.append((tuple((s.request.request_id, s.num_new_tokens, s.num_computed_tokens) for s in out.seqs),
                    out.preempted))
        return out
    engine.scheduler.schedule = spy
    return engine, log


PROMPT_RNG = random.Random(3)
PROMPTS = [[PROMPT_RNG.randrange(3, 380) for _ in range(PROMPT_RNG.randint(10, 40))] for _ in range(10)]
MIXED = [2, 0, 1, 2, 0, 1, 2, 0, 1, 2]


def greedy(priority: int) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, priority=priority)


def test_greedy_outputs_unchanged_by_priority_and_equal_priorities_schedule_as_fcfs(tiny):
    fcfs, fcfs_log = engine_for(tiny, "fcfs")
    expected = [g[0].token_ids for g in fcfs.generate(PROMPTS, greedy(0))]
    assert fcfs.scheduler.num_preemptions > 0 and fcfs.scheduler.num_partial_prefills > 0
    equal, equal_log = engine_for(tiny, "priority")
    assert [g[0].token_ids for g in equal.generate(PROMPTS, greedy(5))] == expected
    assert equal_log == fcfs_log  # the same schedule, step for step
    mixed, mixed_log = engine_for(tiny, "priority")
    results = mixed.generate(PROMPTS, [greedy(p) for p in MIXED])
    assert [g[0].token_ids for g in results] == expected  # under preemption, in another order
    assert mixed_log != fcfs_log
    priority = {g[0].request_id: p for g, p in zip(results, MIXED)}
    victims = [v for _, pre in mixed_log for v in pre]
    assert victims
    for seqs, pre in mixed_log:  # the worst go first: no victim better than a request its step kept
        assert not pre or min(priority[v] for v in pre) >= max((priority[r] for r, *_ in seqs), default=0)
    # the metric: the scheduler's count by priority = the victims' = the requests' own accounting
    counts = Counter(priority[v] for v in victims)
    stats = mixed.stats()
    assert stats.preemptions_by_priority == dict(counts) and stats.num_preemptions == len(victims)
    per_request = Counter()
    for g, p in zip(results, MIXED):
        per_request[p] += g[0].stats.num_preemptions
    assert +per_request == counts
    text = render_prometheus([MetricsRecorder("tiny", mixed.info).snapshot(stats)]).decode()
    samples = {(s.name, s.labels.get("priority")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert {p: samples[("attnserve_preemptions_by_priority_total", str(p))] for p in counts} == counts
    assert sum(v for (n, _), v in samples.items() if n == "attnserve_preemptions_by_priority_total") == \
        samples[("attnserve_preemptions_total", None)] == len(victims)


def test_fcfs_refuses_a_priority_as_vllm_does(tiny):
    engine, _ = engine_for(tiny, "fcfs")
    with pytest.raises(InvalidRequestError, match="priority scheduling is not enabled") as e:
        engine.add_request("x", [5, 6, 7], greedy(1))
    assert e.value.param == "priority"
    engine.add_request("y", [5, 6, 7], greedy(0))  # the default is taken
    assert not engine.kv.num_used_blocks  # the refused one holds nothing


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 1.5, True])
def test_priority_outside_int64_is_invalid_in_the_engine(bad):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(priority=bad)
    assert e.value.param == "priority"


# ---- over HTTP: OpenAI's error shape, the outputs, /metrics --------------------------------------
@pytest.fixture(scope="module")
def served(tiny_checkpoints):
    """Two engines on one checkpoint: the default policy (fcfs), and priority on a pool that preempts."""
    common = dict(model=str(tiny_checkpoints["llama"]), dtype="float32", block_size=BLOCK, max_model_len=256,
                  enforce_eager=True)
    workers = {"fcfs": ModelWorker("fcfs", EngineConfig(**common, num_blocks=128)),
               "prio": ModelWorker("prio", EngineConfig(**common, num_blocks=40, max_num_seqs=8,
                                                        scheduling_policy="priority"))}
    api = OpenAIApi({name: LocalModelClient(w) for name, w in workers.items()}, ApiLimits(max_tokens=64))

    async def snapshots():
        return [w.snapshot() for w in workers.values()]
    yield create_app(api, snapshots=snapshots)
    for w in workers.values():
        w.shutdown()


def post_all(app, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=300) as c:
            return await asyncio.gather(*(c.post(path, json=body) for path, body in requests))
    return asyncio.run(go())


def assert_priority_error(resp, contains: str | None = None):
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "priority", error
    assert error["type"] == "invalid_request_error" and (contains is None or contains in error["message"]), error


CHAT = {"model": "prio", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "prio", "prompt": "hello", "max_tokens": 4}


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 10**30, 1.5, "high", None])
def test_priority_outside_int64_is_400_on_every_endpoint(served, bad):
    responses = post_all(served, [("/v1/completions", {**COMPLETION, "priority": bad}),
                                  ("/v1/chat/completions", {**CHAT, "priority": bad}),
                                  ("/v1/responses", {"model": "prio", "input": "hi", "priority": bad})])
    for resp in responses:
        assert_priority_error(resp)


def test_priority_at_int64_bounds_is_served(served):
    for resp in post_all(served, [("/v1/completions", {**COMPLETION, "priority": 2**63 - 1}),
                                  ("/v1/chat/completions", {**CHAT, "priority": -(2**63)}),
                                  ("/v1/responses", {"model": "prio", "input": "hi", "priority": -3,
                                                     "max_output_tokens": 4})]):
        assert resp.status_code == 200, resp.text


def test_fcfs_model_refuses_a_priority_over_http(served):
    refused = post_all(served, [("/v1/completions", {**COMPLETION, "model": "fcfs", "priority": 1}),
                                ("/v1/chat/completions", {**CHAT, "model": "fcfs", "priority": -1, "stream": True})])
    for resp in refused:
        assert_priority_error(resp, "priority scheduling is not enabled")
    ok = post_all(served, [("/v1/completions", {**COMPLETION, "model": "fcfs", "priority": 0})])
    assert ok[0].status_code == 200
    models = asyncio.run(get(served, "/v1/models")).json()["data"]
    assert {m["id"]: m["scheduling_policy"] for m in models} == {"fcfs": "fcfs", "prio": "priority"}


def test_mixed_priorities_under_preemption_over_http_same_text_and_metric(served):
    """8 greedy requests at once, priorities 0-2, on a pool that holds ~3 of them: the same text as
    the FCFS engine gives them, and /metrics counts the preemptions by priority."""
    prompts = PROMPTS[:8]
    body = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    mixed = post_all(served, [("/v1/completions", {"model": "prio", "prompt": p, **body, "priority": i % 3,
                                                   "stream": i % 2 == 1}) for i, p in enumerate(prompts)])
    plain = post_all(served, [("/v1/completions", {"model": "fcfs", "prompt": p, **body}) for p in prompts])
    assert all(r.status_code == 200 for r in mixed + plain), [r.text for r in mixed + plain if r.status_code != 200]
    texts = [streamed_text(r) if i % 2 else r.json()["choices"][0]["text"] for i, r in enumerate(mixed)]
    assert texts == [r.json()["choices"][0]["text"] for r in plain]
    metrics = asyncio.run(get(served, "/metrics")).text
    by_priority = {s.labels["priority"]: s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                   if s.name == "attnserve_preemptions_by_priority_total" and s.labels["model"] == "prio"}
    total = next(s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                 if s.name == "attnserve_preemptions_total" and s.labels["model"] == "prio")
    assert total > 0 and sum(by_priority.values()) == total
    assert set(by_priority) <= {"0", "1", "2"}


def streamed_text(resp: httpx.Response) -> str:
    events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])


async def get(app, path: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.get(path)
