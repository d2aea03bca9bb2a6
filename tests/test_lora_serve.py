"""LoRA adapters through real Ray Serve: two replicas of the tiny llama with one adapter slot each and
three adapters. Every answer is PEFT's; an adapter's requests go to the replica holding it (Serve's
model multiplexing in the cache-aware router); loads and evictions are counted."""
import time

import httpx
import openai
import pytest

from models.tokenizer import load_tokenizer
from tests.lora_helpers import peft_model
from tests.reference import hf_greedy

pytestmark = pytest.mark.e2e
APP, ROUTE = "attnserve-lora", "/lora"
PROMPT = [5, 17, 42, 99, 7, 3, 61, 28, 14]
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def url(ray_session, tiny_checkpoints, lora_adapters):
    from ray import serve

    from server.deployment import build_app
    from server.engine.config import EngineConfig
    from server.serve_config import ServeConfig

    # NOTE: eager, and a quarter CPU each: two replicas fit beside the session's other apps on 2 CPUs
    cfg = ServeConfig(models={"tiny": str(tiny_checkpoints["llama"])}, num_replicas=2, num_cpus=0.25,
                      allow_runtime_lora=True, lora_modules={name: str(path) for name, path in lora_adapters.items()},
                      engine=EngineConfig(dtype="float32", block_size=4, kv_cache_memory=None, num_blocks=128,
                                          max_model_len=256, num_threads=1, enforce_eager=True, max_loras=1))
    serve.run(build_app(cfg), name=APP, route_prefix=ROUTE)
    yield f"{ray_session}{ROUTE}"
    serve.delete(APP)


def snapshots() -> list:
    """Each replica's latest metrics report (they push one a second)."""
    import ray

    from server.deployment import STATE_NAMESPACE, state_name

    return ray.get(ray.get_actor(state_name(APP), namespace=STATE_NAMESPACE).collect.remote())


def loads() -> dict[str, int]:
    return {s.replica: s.counters.get("lora_loads", 0) for s in snapshots()}


def settle(read, ok=bool, what: str = "", timeout: float = 30.0):
    """`read()` once `ok` of it holds: the replicas' reports lag a second or two."""
    deadline = time.monotonic() + timeout
    while not ok(value := read()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return value


def resident(url: str, *names: str) -> dict[str, list[str]] | None:
    """/v1/models' adapters -> the replicas holding each, once each of `names` is held somewhere."""
    adapters = [m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"] if "parent" in m]
    assert {m["parent"] for m in adapters} == {"tiny"}
    holders = {m["id"]: m["lora"]["replicas"] for m in adapters}
    return holders if all(holders.get(n) for n in names) else None


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def complete(url: str, model: str) -> str:
    """The official SDK's completion: the adapter named in `model`, greedy."""
    r = client(url).completions.create(model=model, prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    return r.choices[0].text


def test_adapters_route_to_their_replica_and_answer_as_peft(url, tiny_checkpoints, lora_adapters):
    base = tiny_checkpoints["llama"]
    tok = load_tokenizer(base)
    expected = {name: tok.decode(hf_greedy(peft_model(base, path), PROMPT, NUM_TOKENS))
                for name, path in lora_adapters.items()}
    assert len(set(expected.values())) == 3

    # two adapters, one per replica (a replica holding none is preferred for an adapter held nowhere)
    assert complete(url, "all8") == expected["all8"]
    assert complete(url, "attn4") == expected["attn4"]
    holders = settle(lambda: resident(url, "all8", "attn4"), what="adapters resident")
    assert len(holders["all8"]) == len(holders["attn4"]) == 1 and holders["all8"] != holders["attn4"]
    assert holders["mlp16"] == []
    before = settle(loads, lambda n: sum(n.values()) >= 2, "two loads counted")

    # each adapter's requests go to the replica holding it: no load anywhere
    for name in ("all8", "attn4", "all8", "attn4"):
        assert complete(url, name) == expected[name]
    time.sleep(2.5)  # two report periods: a load these requests caused would show now
    assert loads() == before

    # a third adapter evicts one of them where it lands; every answer stays PEFT's
    assert complete(url, "mlp16") == expected["mlp16"]
    for name in ("all8", "attn4", "mlp16"):
        assert complete(url, name) == expected[name]
    snaps = settle(snapshots, lambda s: sum(x.counters.get("lora_evictions", 0) for x in s) >= 1, "an eviction")
    assert sum(s.counters["lora_loads"] for s in snaps) >= 3
    assert all(len(s.loras) <= 1 for s in snaps)  # one slot each
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'attnserve_lora_requests_total{' in metrics and 'adapter="mlp16"' in metrics


def test_runtime_load_and_unload_through_the_registry_actor(url, tiny_checkpoints, lora_adapters):
    """POST /v1/load_lora_adapter lands in the application's registry actor, which the ingress reads."""
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                        json={"lora_name": "late", "lora_path": str(lora_adapters["attn4"])})
    assert loaded.status_code == 200, loaded.text
    assert httpx.post(f"{url}/v1/load_lora_adapter", timeout=60, json={
        "lora_name": "late", "lora_path": str(lora_adapters["attn4"])}).status_code == 400  # the name is taken
    assert "late" in {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    base = tiny_checkpoints["llama"]
    expected = load_tokenizer(base).decode(hf_greedy(peft_model(base, lora_adapters["attn4"]), PROMPT, NUM_TOKENS))
    assert complete(url, "late") == expected
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", timeout=60, json={"lora_name": "late"})
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError) as gone:
        client(url).completions.create(model="late", prompt=PROMPT, max_tokens=2)
    assert gone.value.code == "model_not_found"
