"""LoRA adapters through the API in-process (no Ray): `model` names an adapter, /v1/models lists it
with its parent, vLLM's load / unload endpoints, every refusal a 4xx, answers equal PEFT's."""
import asyncio
import dataclasses
import json
import shutil

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from models.tokenizer import load_tokenizer
from server.engine import EngineConfig
from server.http_app import create_app
from server.model_client import LocalModelClient
from server.openai_api import ApiError, ApiLimits, OpenAIApi
from server.protocol import CompletionRequest, LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from server.worker import ModelWorker
from tests.lora_helpers import make_adapter, peft_model
from tests.reference import hf_greedy, load_hf

PROMPT = [5, 17, 42, 99, 7, 3, 61, 28, 14]
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def worker(tiny_checkpoints):
    # NOTE: two slots for three adapters: a third one evicts the least recently used
    w = ModelWorker("tiny", EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", num_blocks=128,
                                         block_size=4, max_model_len=256, enforce_eager=True, max_loras=2,
                                         max_lora_rank=16))
    yield w
    w.shutdown()


def make_api(worker, lora_adapters, **kw) -> OpenAIApi:
    async def snapshots():
        return [dataclasses.replace(worker.snapshot(), replica="replica-1")]

    return OpenAIApi({"tiny": LocalModelClient(worker)}, ApiLimits(max_tokens=200),
                     lora_modules={"all8": str(lora_adapters["all8"]), "attn4": str(lora_adapters["attn4"])},
                     snapshots=snapshots, **kw)


@pytest.fixture(scope="module")
def api(worker, lora_adapters):
    return make_api(worker, lora_adapters, allow_runtime_lora=True)


@pytest.fixture(scope="module")
def peft_tokens(tiny_checkpoints, lora_adapters) -> dict[str, list[int]]:
    """PEFT's greedy tokens for PROMPT, per adapter, and the base's (None)."""
    base = tiny_checkpoints["llama"]
    out = {name: hf_greedy(peft_model(base, path), PROMPT, NUM_TOKENS) for name, path in lora_adapters.items()}
    out[None] = hf_greedy(load_hf(base), PROMPT, NUM_TOKENS)
    return out


@pytest.fixture(scope="module")
def tok(tiny_checkpoints):
    return load_tokenizer(tiny_checkpoints["llama"])


def run(app, go):
    """`go(sdk, http)` against `app` in process: the official openai SDK and a plain httpx client."""
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     headers={"Authorization": "Bearer k"}) as http:
            sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http, max_retries=0)
            return await go(sdk, http)
    return asyncio.run(main())


def assert_error(resp, status, param=None, contains=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if param is not None:
        assert body["error"]["param"] == param, body
    if contains is not None:
        assert contains in body["error"]["message"], body


def completion(model: str, **kw) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, **kw}


def test_adapter_answers_are_peft_greedy_through_the_sdk(api, peft_tokens, tok, lora_adapters):
    """Each adapter alone, then all three and the base at once (one batch), with the third adapter loaded
    at run time into two slots: every answer PEFT's, streamed or not."""
    assert len({tuple(v) for v in peft_tokens.values()}) == 4  # the adapters change the answer

    async def go(sdk, http):
        loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "mlp16",
                                                                  "lora_path": str(lora_adapters["mlp16"])})
        assert loaded.status_code == 200, loaded.text

        async def one(model, stream=False):
            kw = completion(model)
            args = dict(model=kw.pop("model"), prompt=kw.pop("prompt"), max_tokens=kw.pop("max_tokens"),
                        temperature=0, extra_body={"ignore_eos": True})
            if not stream:
                return (await sdk.completions.create(**args)).choices[0].text
            return "".join([c.choices[0].text async for c in await sdk.completions.create(**args, stream=True)
                            if c.choices])

        alone = {m: await one(m) for m in ("all8", "attn4", "mlp16", "tiny")}
        together = await asyncio.gather(*(one(m, stream=s) for m in ("all8", "attn4", "mlp16", "tiny")
                                          for s in (False, True)))
        return alone, together

    alone, together = run(create_app(api), go)
    expected = {m: tok.decode(peft_tokens[None if m == "tiny" else m]) for m in alone}
    assert alone == expected
    assert together == [expected[m] for m in ("all8", "attn4", "mlp16", "tiny") for _ in range(2)]


def test_chat_streamed_equals_whole_and_messages_take_an_adapter(api):
    chat = {"model": "all8", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}

    async def go(sdk, http):
        whole = await sdk.chat.completions.create(**{k: v for k, v in chat.items() if k != "ignore_eos"},
                                                  extra_body={"ignore_eos": True})
        parts = [c.choices[0].delta.content or "" async for c in await sdk.chat.completions.create(
            **{k: v for k, v in chat.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True}, stream=True)
            if c.choices]
        base = await http.post("/v1/chat/completions", json={**chat, "model": "tiny"})
        messages = await http.post("/v1/messages", json={"model": "all8", "max_tokens": 6, "temperature": 0,
                                                         "messages": [{"role": "user", "content": "hello"}]})
        return whole, "".join(parts), base.json(), messages

    whole, streamed, base, messages = run(create_app(api), go)
    assert whole.model == "all8" and whole.choices[0].message.content == streamed
    assert base["choices"][0]["message"]["content"] != streamed  # the adapter's answer, not the base's
    assert messages.status_code == 200, messages.text
    assert messages.json()["model"] == "all8"


def test_models_list_adapters_with_parent_and_replicas(api, lora_adapters):
    async def go(sdk, http):
        await sdk.completions.create(model="attn4", prompt=PROMPT, max_tokens=1)  # resident on the replica now
        return (await http.get("/v1/models")).json()["data"], [m.id async for m in sdk.models.list()]

    data, ids = run(create_app(api), go)
    by_id = {m["id"]: m for m in data}
    assert {"tiny", "all8", "attn4"} <= set(ids)
    for name in ("all8", "attn4"):
        assert by_id[name]["object"] == "model" and by_id[name]["parent"] == "tiny"
        assert by_id[name]["root"] == str(lora_adapters[name])
    assert "parent" not in by_id["tiny"]
    assert by_id["attn4"]["lora"]["replicas"] == ["replica-1"]


def test_bad_adapters_are_4xx(api, worker, lora_adapters, tiny_checkpoints, tmp_path):
    rank32 = make_adapter(tiny_checkpoints["llama"], tmp_path / "rank32", r=32, lora_alpha=32,
                          target_modules=["q_proj"])
    other_base = make_adapter(tiny_checkpoints["mistral"], tmp_path / "mistral", r=4, lora_alpha=8,
                              target_modules=["k_proj"])  # mistral's K/V width (1 head) is not the llama's (2)
    pickled = tmp_path / "pickled"
    shutil.copytree(lora_adapters["attn4"], pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    blocks_before = worker.stats()["num_used_blocks"]

    async def go(sdk, http):
        def load(name, path, **kw):
            return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **kw})
        return {
            "rank": await load("r32", rank32), "shape": await load("mistral", other_base),
            "missing": await load("gone", tmp_path / "nothing-here"), "pickle": await load("pkl", pickled),
            "duplicate": await load("all8", lora_adapters["mlp16"]),
            "base_name": await load("tiny", lora_adapters["mlp16"]),
            "unknown_base": await load("x", lora_adapters["mlp16"], base_model="nope"),
            "bad_field": await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y",
                                                                        "lora_int_idx": 3}),
            "unload_unknown": await http.post("/v1/unload_lora_adapter", json={"lora_name": "never"}),
            "unknown_model": await http.post("/v1/completions", json=completion("no-such-adapter")),
            "embeddings": await http.post("/v1/embeddings", json={"model": "all8", "input": "hi"}),
            "attention": await http.post("/v1/attention", json={"model": "all8", "prompt": "hi"}),
            "models": (await http.get("/v1/models")).json(),
        }

    r = run(create_app(api), go)
    assert_error(r["rank"], 400, contains="--max-lora-rank")
    assert_error(r["shape"], 400, contains="another base")
    for key in ("missing", "pickle"):
        assert 400 <= r[key].status_code < 500, r[key].text
        assert_error(r[key], r[key].status_code, param="lora_path")
    assert_error(r["duplicate"], 400, "lora_name", "already been loaded")
    assert_error(r["base_name"], 400, "lora_name")
    assert_error(r["unknown_base"], 404, "base_model")
    assert_error(r["bad_field"], 400, "lora_int_idx")
    assert_error(r["unload_unknown"], 404, "lora_name")
    assert_error(r["unknown_model"], 404, "model", "does not exist")
    assert_error(r["embeddings"], 400, "model", "LoRA adapter")
    assert_error(r["attention"], 400, "model", "LoRA adapter")
    assert not {"r32", "mistral", "gone", "pkl", "x"} & {m["id"] for m in r["models"]["data"]}
    assert worker.stats()["num_used_blocks"] == blocks_before


def test_runtime_loading_needs_an_api_key_or_the_allow_flag(worker, lora_adapters):
    closed = make_api(worker, lora_adapters)  # neither: 403 (these endpoints read server paths)
    keyed = OpenAIApi(closed.clients, closed.limits, closed.adapters)

    async def go_closed(sdk, http):
        return await http.post("/v1/load_lora_adapter", json={"lora_name": "a",
                                                               "lora_path": str(lora_adapters["mlp16"])})

    assert_error(run(create_app(closed), go_closed), 403, contains="--api-key")

    async def go_keyed(sdk, http):
        body = {"lora_name": "keyed", "lora_path": str(lora_adapters["mlp16"])}
        anonymous = await http.post("/v1/load_lora_adapter", json=body, headers={"Authorization": ""})
        loaded = await http.post("/v1/load_lora_adapter", json=body)
        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "keyed"})
        return anonymous, loaded, unloaded

    anonymous, loaded, unloaded = run(create_app(keyed, api_key="k"), go_keyed)
    assert_error(anonymous, 401)
    assert loaded.status_code == 200 and loaded.json()["id"] == "keyed", loaded.text
    assert unloaded.status_code == 200, unloaded.text


def test_unload_refuses_new_requests_while_one_in_flight_finishes(worker, lora_adapters, tiny_checkpoints, tok):
    api = make_api(worker, lora_adapters, allow_runtime_lora=True)

    async def main():
        await api.load_lora_adapter(LoadLoraAdapterRequest(lora_name="late", lora_path=str(lora_adapters["mlp16"])))
        stream = await api.completions(CompletionRequest(**completion("late", max_tokens=24), stream=True))
        first = await stream.__anext__()
        await api.unload_lora_adapter(UnloadLoraAdapterRequest(lora_name="late"))
        with pytest.raises(ApiError) as refused:
            await api.completions(CompletionRequest(**completion("late")))
        rest = [event async for event in stream]
        return first, rest, refused.value

    first, rest, refused = asyncio.run(main())
    assert refused.status == 404 and refused.code == "model_not_found"
    assert rest[-1] == "data: [DONE]\n\n" and '"finish_reason":"length"' in rest[-2].replace(" ", "")
    expected = tok.decode(hf_greedy(peft_model(tiny_checkpoints["llama"], lora_adapters["mlp16"]), PROMPT, 24))
    events = [json.loads(e[len("data: "):]) for e in [first, *rest[:-1]]]
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == expected


def test_metrics_by_adapter(api, worker, promtool):
    async def go(sdk, http):
        for model in ("all8", "all8", "attn4"):
            await sdk.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
        return (await http.get("/metrics")).text, (await http.get("/dashboard/data")).json()

    app = create_app(api, snapshots=api.snapshots)
    before = worker.snapshot()
    text, dashboard = run(app, go)
    after = worker.snapshot()
    assert after.lora_requests["all8"] - before.lora_requests.get("all8", 0) == 2
    assert after.lora_requests["attn4"] - before.lora_requests.get("attn4", 0) == 1
    assert after.lora_generation_tokens["all8"] - before.lora_generation_tokens.get("all8", 0) == 6
    assert after.lora_prompt_tokens["attn4"] - before.lora_prompt_tokens.get("attn4", 0) == len(PROMPT)
    assert after.counters["lora_loads"] >= 2 and sum(after.histograms["lora_load_seconds"].series[""][:-1]) >= 1
    samples = {(s.name, s.labels.get("adapter")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["attnserve_lora_requests_total", "all8"] >= 2
    assert samples["attnserve_lora_generation_tokens_total", "attn4"] >= 3
    assert samples["attnserve_lora_loads_total", None] >= 2
    assert ("attnserve_lora_evictions_total", None) in samples
    assert samples["attnserve_lora_load_seconds_count", None] >= 1
    assert samples["attnserve_lora_adapter_replicas", "attn4"] == 1
    (info,) = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "vllm:lora_requests_info"]
    assert info.labels["max_lora"] == "2" and info.labels["running_lora_adapters"] == ""
    assert promtool(text.encode()) == []
    (model,) = dashboard["models"]
    assert model["adapters_by_replica"] == {"replica-1": list(after.loras)} and "attn4" in after.loras


def test_cli_takes_the_lora_flags():
    from server.cli import _engine_config, _parse_lora_modules, build_parser

    args = build_parser().parse_args(["serve", "--lora-modules", "a=/x", "b=/y", "--max-loras", "2",
                                      "--max-lora-rank", "32", "--allow-runtime-lora"])
    assert _parse_lora_modules(args.lora_modules) == {"a": "/x", "b": "/y"} and args.allow_runtime_lora
    engine = _engine_config(args)
    assert (engine.max_loras, engine.max_lora_rank) == (2, 32)
    defaults = build_parser().parse_args(["serve"])
    assert (_engine_config(defaults).max_loras, _parse_lora_modules(defaults.lora_modules)) == (0, {})
    with pytest.raises(ValueError, match="NAME=PATH"):
        _parse_lora_modules(["just-a-path"])


def test_a_lora_module_that_cannot_be_served_is_a_404_saying_why(worker, tmp_path):
    api = OpenAIApi({"tiny": LocalModelClient(worker)}, lora_modules={"broken": str(tmp_path / "missing")})

    async def go(sdk, http):
        return (await http.post("/v1/completions", json=completion("broken")),
                (await http.get("/v1/models")).json()["data"])

    refused, models = run(create_app(api), go)
    assert_error(refused, 404, "model", "--lora-modules entry failed")
    assert [m["id"] for m in models] == ["tiny"]
