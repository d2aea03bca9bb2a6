"""A tensor-parallel replica behind real Ray Serve: the official openai client streams from it,
/v1/models and the dashboard show its workers, and a worker killed under load ends every stream
with an error (no hang), after which Serve starts a whole new group and no block is held."""
import os

import httpx
import openai
import pytest

from server.engine import EngineConfig, LLMEngine, SamplingParams
from tests.test_reliability import AUTH, CHAOS_KEY, kill_under_load
from tests.test_two_nodes import wait_for

APP = "attnserve-tp"


@pytest.fixture(scope="module")
def tp_url(serve_url, tiny_variants):
    from ray import serve

    from server.deployment import build_app
    from server.openai_api import ApiLimits
    from server.serve_config import ServeConfig

    os.environ["ATTNSERVE_CHAOS"] = "1"  # slow_steps, so that the kill lands mid-stream
    # NOTE: the replica's 0.5 CPU is its 2 workers' (0.25 each, one thread); the replica itself holds none
    cfg = ServeConfig(models={"chaos": str(tiny_variants["tiny-gqa"])},
                      engine=EngineConfig(dtype="float32", block_size=4, kv_cache_memory=None, num_blocks=64,
                                          max_model_len=160, max_num_batched_tokens=64, max_num_seqs=8,
                                          enforce_eager=True, tensor_parallel_size=2),
                      num_cpus=0.5, api_key=CHAOS_KEY, limits=ApiLimits(max_tokens=100))
    serve.run(build_app(cfg), name=APP, route_prefix="/tp")
    yield f"{serve_url}/tp"
    serve.delete(APP)


def handle():
    from ray import serve

    return serve.get_deployment_handle("model-chaos", app_name=APP)


def workers(url: str) -> list[dict]:
    (model,) = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=30).json()["data"]
    assert model["tensor_parallel_size"] == 2 and model["pipeline_parallel_size"] == 1
    return model["workers"]


def test_tensor_parallel_replica_streams_the_unsharded_tokens(tp_url, tiny_variants):
    """A one-model app is one deployment (no ingress): its replica serves HTTP itself, with the app's key,
    routes and /metrics, and streams the tokens of the unsharded model."""
    from ray import serve

    assert set(serve.status().applications[APP].deployments) == {"model-chaos"}
    assert httpx.get(f"{tp_url}/v1/models", timeout=30).status_code == 401
    engine = LLMEngine(EngineConfig(model=str(tiny_variants["tiny-gqa"]), dtype="float32", block_size=4,
                                    num_blocks=256, kv_cache_memory=None, enforce_eager=True))
    prompt = "Beautiful is better than"
    expected = engine.generate([engine.tokenizer(prompt)["input_ids"]],
                               SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0][0].text
    client = openai.OpenAI(base_url=f"{tp_url}/v1", api_key=CHAOS_KEY)
    stream = client.completions.create(model="chaos", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == expected
    ranks = workers(tp_url)
    assert [w["tp_rank"] for w in ranks] == [0, 1] and len({w["pid"] for w in ranks}) == 2
    assert handle().engine_pid.remote().result() not in {w["pid"] for w in ranks}  # workers are their own processes
    assert sum(w["num_kv_heads"] for w in ranks) == 2  # the tiny GQA model's 2 K/V heads, one per rank
    (model,) = httpx.get(f"{tp_url}/dashboard/data", timeout=30).json()["models"]
    assert sorted(w["rank"] for w in model["workers"]) == [0, 1] and model["tensor_parallel_size"] == 2
    assert "attnserve_requests_total" in httpx.get(f"{tp_url}/metrics", timeout=30).text


def test_worker_killed_under_load_fails_streams_and_the_group_restarts(tp_url):
    before = workers(tp_url)
    outs, _ = kill_under_load(tp_url, before[1]["pid"], handle())
    assert any(any('"error"' in v for k, v in out if k == "line") for out in outs)
    after = wait_for(lambda: (lambda w: w if w and {x["pid"] for x in w}.isdisjoint({x["pid"] for x in before})
                              else None)(workers(tp_url)), 60, "a new group of workers")
    assert len(after) == 2
    wait_for(lambda: httpx.get(f"{tp_url}/dashboard/data", timeout=30).json()["models"][0]["kv_blocks_used"] == 0,
             40, "every KV block free")


def test_serve_config_reserves_the_workers_with_the_replica():
    from server.deployment import worker_placement
    from server.serve_config import ServeConfig

    cfg = ServeConfig.from_args({"num_cpus": 2.0, "engine": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}})
    engine = cfg.engine_config("default", 2.0)
    assert engine.worker_cpus == 0.5 and engine.num_threads == 1 and engine.world_size == 4
    placement = worker_placement(engine, {"resources": {"replica_slot": 1}})
    assert placement["placement_group_strategy"] == "SPREAD"  # pipeline stages: over nodes where there are several
    assert placement["placement_group_bundles"] == [{"CPU": 0.5, "replica_slot": 1}] + [{"CPU": 0.5}] * 3
    tp_only = ServeConfig.from_args({"engine": {"tensor_parallel_size": 2}}).engine_config("default", 4.0)
    assert tp_only.worker_cpus == 2.0 and tp_only.num_threads == 2
    assert worker_placement(tp_only, {})["placement_group_strategy"] == "STRICT_PACK"
    assert worker_placement(ServeConfig().engine_config("default", 1.0), {}) == {}
