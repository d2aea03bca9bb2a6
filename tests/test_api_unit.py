"""API logic in-process (no Ray): request validation and OpenAI-shaped errors, via ASGI."""
import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from server.engine import EngineConfig
from server.engine.sampling_params import SamplingParams
from server.http_app import create_app
from server.model_client import LocalModelClient
from server.openai_api import ApiLimits, OpenAIApi
from server.wire import Chunk, GenerateCall, ModelInfo, PromptInfo
from server.worker import ModelWorker


@pytest.fixture(scope="module")
def api(tiny_checkpoints):
    # NOTE: eager: the API is the subject; the compiled step's tests are test_compiled / test_engine_greedy
    worker = ModelWorker("tiny", EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", num_blocks=128,
                                              block_size=4, max_model_len=256, enforce_eager=True))
    yield OpenAIApi({"tiny": LocalModelClient(worker)}, ApiLimits(max_n=4, max_tokens=200, max_body_bytes=64 * 1024))
    worker.shutdown()


@pytest.fixture(scope="module")
def app(api):
    return create_app(api)


def call(app, method, path, **kw):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


def assert_error(resp, status, param=None, contains=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    if param is not None:
        assert body["error"]["param"] == param, body
    if contains is not None:
        assert contains in body["error"]["message"], body


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("patch,param", [
    ({"temperature": "hot"}, "temperature"), ({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "x"}, "max_tokens"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"frequency_penalty": 9}, "frequency_penalty"), ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"stop": ["x"] * 40}, "stop"), ({"n": 99}, "n"),
    ({"max_tokens": 100000}, "max_tokens"),
])
def test_bad_chat_fields_are_400_with_param(app, patch, param):
    assert_error(call(app, "POST", "/v1/chat/completions", json={**CHAT, **patch}), 400, param)


def test_invalid_json_is_400(app):
    resp = call(app, "POST", "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(resp, 400)


def test_unknown_model_is_404(app):
    assert_error(call(app, "POST", "/v1/chat/completions", json={**CHAT, "model": "nope"}), 404, "model",
                 "does not exist")


def test_prompt_plus_max_tokens_over_context_names_both_numbers(app):
    body = {"model": "tiny", "prompt": [5] * 200, "max_tokens": 100}
    assert_error(call(app, "POST", "/v1/completions", json=body), 400, "max_tokens", "prompt (200 tokens) + max_tokens (100)")
    assert_error(call(app, "POST", "/v1/completions", json={"model": "tiny", "prompt": [5] * 300}), 400, "prompt",
                 "context is 256")


def test_out_of_vocab_and_empty_prompts(app):
    assert_error(call(app, "POST", "/v1/completions", json={"model": "tiny", "prompt": [10**7]}), 400, "prompt")
    assert_error(call(app, "POST", "/v1/completions", json={"model": "tiny", "prompt": []}), 400, "prompt")
    assert_error(call(app, "POST", "/v1/completions", json={"model": "tiny", "prompt": ""}), 400, "prompt")


def test_body_too_large_is_413(app):
    resp = call(app, "POST", "/v1/completions", content=b"x" * (65 * 1024), headers={"content-type": "application/json"})
    assert_error(resp, 413)


def test_completion_ok_and_usage(app):
    resp = call(app, "POST", "/v1/completions", json={"model": "tiny", "prompt": ["0 1 2", "3 4"], "max_tokens": 3,
                                                      "temperature": 0, "ignore_eos": True, "n": 2})
    body = resp.json()
    assert resp.status_code == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    assert body["choices"][0]["text"] == body["choices"][1]["text"]  # greedy samples agree


def test_streaming_sse_format(app):
    resp = call(app, "POST", "/v1/chat/completions", json={**CHAT, "stream": True, "temperature": 0,
                                                            "stream_options": {"include_usage": True}})
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in resp.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)


def test_continuous_usage_stats_count_tokens_as_they_stream(app):
    body = {"model": "tiny", "prompt": "1 2 3", "max_tokens": 9, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    resp = call(app, "POST", "/v1/completions", json=body)
    events = [json.loads(line[6:]) for line in resp.text.split("\n\n") if line.startswith("data: {")]
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 9
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 9 and len(set(counts)) == len(counts)  # grows every chunk
    prompt = final["usage"]["prompt_tokens"]
    assert all(c["usage"]["prompt_tokens"] == prompt and c["usage"]["total_tokens"] == prompt + n
               for c, n in zip(chunks, counts))
    plain = call(app, "POST", "/v1/completions", json={**body, "stream_options": {"include_usage": True}})
    assert all("usage" not in json.loads(line[6:]) for line in plain.text.split("\n\n")[:-3] if line.startswith("data: {"))


def test_api_key_guard(api):
    keyed = create_app(api, api_key="s3cret")
    assert_error(call(keyed, "GET", "/v1/models"), 401)
    assert_error(call(keyed, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert call(keyed, "GET", "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert call(keyed, "GET", "/health").status_code == 200  # stays open


def test_tokenize_detokenize_roundtrip(app):
    ids = call(app, "POST", "/tokenize", json={"model": "tiny", "prompt": "The capital of France"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 256
    text = call(app, "POST", "/detokenize", json={"model": "tiny", "tokens": ids["tokens"]}).json()["prompt"]
    assert text == "The capital of France"
    assert_error(call(app, "POST", "/detokenize", json={"model": "tiny", "tokens": [-1]}), 400, "tokens")
    assert_error(call(app, "POST", "/tokenize", json={"model": "tiny"}), 400)


def test_unknown_route_is_openai_shaped_404(app):
    assert_error(call(app, "GET", "/v1/nothing"), 404)


def test_concurrent_stream_limit_is_429(tiny_checkpoints):
    from server.openai_api import ApiError
    from server.protocol import CompletionRequest

    worker = ModelWorker("tiny", EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", num_blocks=64,
                                              enforce_eager=True))
    api = OpenAIApi({"tiny": LocalModelClient(worker)}, ApiLimits(max_concurrent_streams=1))

    async def main():
        body = CompletionRequest(model="tiny", prompt="0 1", max_tokens=50, stream=True, ignore_eos=True)
        first = await api.completions(body)  # an open stream holds the only slot
        with pytest.raises(ApiError) as e:
            await api.completions(body)
        assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
        await first.aclose()  # a client that goes away frees the slot
        again = await api.completions(body)
        chunks = [c async for c in again]
        assert chunks[-1] == "data: [DONE]\n\n"
    try:
        asyncio.run(main())
    finally:
        worker.shutdown()


def test_weights_are_never_loaded_with_remote_code_or_pickle():
    """A static guard: no code path passes trust_remote_code=True or calls torch.load."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for package in ("models", "kvcache", "server"):
        for path in (root / package).rglob("*.py"):
            text = path.read_text()
            assert "trust_remote_code=True" not in text, path
            assert "torch.load(" not in text and "pickle.load" not in text, path


def test_api_layer_does_not_import_torch():
    code = ("import sys; import server.http_app, server.openai_api, server.protocol, server.wire, "
            "server.engine.errors, server.engine.config; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_non_streaming_call_gets_one_chunk_per_sample(api):
    worker = api.clients["tiny"].worker
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, n=2)

    async def run(stream):
        return [x async for x in worker.generate(GenerateCall(params, prompt_token_ids=(5, 6, 7), stream=stream))]
    whole, streamed = asyncio.run(run(False)), asyncio.run(run(True))
    assert isinstance(whole[0], PromptInfo) and len(whole) == 3  # one chunk per sample crosses to the ingress
    assert len(streamed) > 3
    for chunk in whole[1:]:
        parts = [c for c in streamed[1:] if c.index == chunk.index]
        assert chunk.token_ids == tuple(t for c in parts for t in c.token_ids) and len(chunk.token_ids) == 7
        assert chunk.text == "".join(c.text for c in parts) and chunk.finish_reason == "length"
        assert chunk.num_output_tokens == 7 and chunk.peak_kv_bytes == parts[-1].peak_kv_bytes > 0


def test_attention_weights_over_http(api, app, tiny_checkpoints):
    import torch

    from models import load_model
    from models.attention_maps import attention_weights

    r = call(app, "POST", "/v1/attention", json={"model": "tiny", "prompt": "The capital of France", "layers": [0, 1]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"model", "tokens", "token_ids", "layers"} and len(body["tokens"]) == len(body["token_ids"])
    t = len(body["token_ids"])
    expected = attention_weights(load_model(tiny_checkpoints["llama"], torch.float32), body["token_ids"], [0, 1])
    assert [layer["layer"] for layer in body["layers"]] == [0, 1]
    for layer in body["layers"]:
        w = torch.tensor(layer["weights"])  # (heads, query, key)
        assert w.shape == (4, t, t) and (w.triu(diagonal=1) == 0).all()
        assert torch.allclose(w.sum(-1), torch.ones(4, t), atol=1e-5)
        assert torch.allclose(w, expected[layer["layer"]], atol=1e-6)
    chat = call(app, "POST", "/v1/attention", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and len(chat.json()["layers"]) == 2  # every layer of the tiny model
    assert len(chat.json()["token_ids"]) > 2  # the chat template's tokens too


def test_attention_bad_input_is_4xx(api, app):
    capped = create_app(OpenAIApi(api.clients, ApiLimits(max_attention_tokens=8)), api_key="k")
    auth = {"Authorization": "Bearer k"}
    assert_error(call(capped, "POST", "/v1/attention", json={"model": "tiny", "prompt": "x"}), 401)
    long = {"model": "tiny", "prompt": list(range(10, 30))}
    assert_error(call(capped, "POST", "/v1/attention", json=long, headers=auth), 400, "prompt", "at most 8")
    assert_error(call(app, "POST", "/v1/attention", json={"model": "tiny", "prompt": "x", "layers": [7]}), 400,
                 "layers", "out of range")
    assert_error(call(app, "POST", "/v1/attention", json={"model": "tiny", "prompt": [10**6]}), 400, "prompt")
    both = {"model": "tiny", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}
    assert_error(call(app, "POST", "/v1/attention", json=both), 400)
    assert_error(call(app, "POST", "/v1/attention", json={"model": "nope", "prompt": "x"}), 404)


class CannedClient:
    """A replica that answers every sample "ab" in two chunks, the final one with sample i's draft counts
    (3 + i drafted, 1 + i accepted): the API layer's usage arithmetic, without an engine."""

    def __init__(self, speculative: str | None) -> None:
        self.speculative = speculative

    async def info(self) -> ModelInfo:
        from models.native.cpu_path import CpuPath

        return ModelInfo(256, "gqa", 2, 128, 100, 16, 100, 4, "float32",
                         CpuPath("cpu", "avx2", "float32", "float32", "torch", "sdpa", 1), "none", 1000, self.speculative)

    async def generate(self, call: GenerateCall):
        yield PromptInfo(3)
        for i in range(call.params.n):
            yield Chunk(i, "a", (1,))
            yield Chunk(i, "b", (2,), finish_reason="length", num_output_tokens=2, num_draft_tokens=3 + i,
                        num_accepted_tokens=1 + i)


def test_usage_counts_drafts_only_for_speculative_models():
    canned = create_app(OpenAIApi({"spec": CannedClient("ngram"), "plain": CannedClient(None)}))
    models = call(canned, "GET", "/v1/models").json()["data"]
    assert [(m["id"], m["speculative"]) for m in models] == [("spec", "ngram"), ("plain", None)]
    for model, expected in (("spec", {"drafted": 7, "accepted": 3}), ("plain", None)):
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "n": 2}
        completion = {"model": model, "prompt": ["x", "y"], "n": 2}  # two prompts of two samples: twice the counts
        usages = [call(canned, "POST", "/v1/chat/completions", json=chat).json()["usage"],
                  call(canned, "POST", "/v1/completions", json=completion).json()["usage"]]
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
            resp = call(canned, "POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
            *_, final = [json.loads(line[6:]) for line in resp.text.split("\n\n") if line.startswith("data: {")]
            usages.append(final["usage"])
        assert [u["completion_tokens"] for u in usages] == [4, 8, 4, 8]
        if expected is None:
            assert not [u for u in usages if "speculative" in u]
        else:
            doubled = {k: 2 * v for k, v in expected.items()}
            assert [u["speculative"] for u in usages] == [expected, doubled, expected, doubled]


def test_usage_carries_the_engines_draft_counts(tiny_checkpoints):
    """n-gram drafts on the tiny model (greedy, a few of its tokens recur and some drafts hold): the
    response's counts are those the replica's metrics recorded."""
    from server.prometheus import render_prometheus
    from tests.test_metrics_unit import parse, value

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "auto_disable": False}  # drafts in every step: the test needs some accepted and some rejected
    worker = ModelWorker("tiny", EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", num_blocks=64,
                                              enforce_eager=True, speculative_config=spec))
    try:
        body = {"model": "tiny", "prompt": [9] * 12, "max_tokens": 100, "temperature": 0, "ignore_eos": True}
        usage = call(create_app(OpenAIApi({"tiny": LocalModelClient(worker)})), "POST", "/v1/completions",
                     json=body).json()["usage"]
        s = parse(render_prometheus([worker.snapshot()]))
    finally:
        worker.shutdown()
    assert usage["completion_tokens"] == 100 and 0 < usage["speculative"]["accepted"] < usage["speculative"]["drafted"]
    assert usage["speculative"] == {"drafted": value(s, "attnserve_spec_decode_num_draft_tokens_total"),
                                    "accepted": value(s, "attnserve_spec_decode_num_accepted_tokens_total")}
