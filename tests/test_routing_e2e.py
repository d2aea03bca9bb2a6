"""Cache-aware routing through real Ray Serve: two replicas, requests sharing a prefix land on
the replica that caches it (seen in each replica's own metrics snapshot)."""
import time

import httpx
import pytest

# slow: its set-up starts two replicas that compile the step side by side: 60-100 s on 2 busy cores
pytestmark = pytest.mark.slow
APP = "attnserve-routed"
PREFIX = list(range(200, 240))  # 10 blocks of 4 tokens


def snapshots() -> list:
    import ray

    from server.deployment import STATE_NAMESPACE, state_name

    return ray.get(ray.get_actor(state_name(APP), namespace=STATE_NAMESPACE).collect.remote())


def settled_snapshots(expect_requests: int) -> list:
    """Replica snapshots once every finished request has been reported (they push every second)."""
    for _ in range(60):
        snaps = snapshots()
        done = sum(sum(s.finish_reasons.values()) for s in snaps)
        if len(snaps) == 2 and done >= expect_requests:
            return snaps
        time.sleep(0.5)
    raise AssertionError(f"replicas did not report {expect_requests} finished requests: {snapshots()}")


@pytest.fixture(scope="module")
def routed_url(serve_url, tiny_variants):
    from ray import serve

    from server.deployment import build_app
    from server.engine.config import EngineConfig
    from server.serve_config import ServeConfig

    cfg = ServeConfig(models={"tiny": str(tiny_variants["tiny-gqa"])}, num_replicas=2, num_cpus=0.25,
                      engine=EngineConfig(dtype="float32", block_size=4, kv_cache_memory=None, num_blocks=48,
                                          max_model_len=160, num_threads=1))  # the compiled step, in replicas
    assert cfg.routes_by_cache("tiny")
    serve.run(build_app(cfg), name=APP, route_prefix="/routed")
    yield f"{serve_url}/routed"
    serve.delete(APP)


def complete(url: str, prompt) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_requests_sharing_a_prefix_land_on_the_replica_that_caches_it(routed_url):
    from ray import serve

    assert {"OpenAIIngress", "model-tiny"} <= set(serve.status().applications[APP].deployments)
    first = complete(routed_url, PREFIX + [7])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    time.sleep(3)  # the engine's cache summary (1 s) and Serve's routing stats (1 s) catch up
    cached = [complete(routed_url, PREFIX + [10 + i, 11 + i])["usage"]["prompt_tokens_details"]["cached_tokens"]
              for i in range(6)]
    assert cached == [40] * 6  # every one hit the whole prefix: each went where it is cached

    snaps = settled_snapshots(7)
    hits = sorted(s.counters["prefix_cache_hits"] for s in snaps)
    assert hits == [0, 6 * 40]  # all on one replica, nothing on the other
    assert all(s.gauges.kv_blocks_used == 0 for s in snaps)  # no leak on either


def test_chat_is_tokenized_in_the_ingress_and_served(routed_url):
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "hello there"}]}
    r = httpx.post(f"{routed_url}/v1/chat/completions", timeout=60, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 2
    bad = httpx.post(f"{routed_url}/v1/completions", timeout=60,
                     json={"model": "tiny", "prompt": [10**7], "max_tokens": 2})
    error = bad.json()["error"]
    assert bad.status_code == 400 and "token ids must be integers" in error["message"] and "ray::" not in error["message"]
