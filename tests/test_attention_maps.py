"""Attention weights for heatmaps against transformers' own (eager attention, output_attentions), and
POST /v1/attention's word on each layer's variant: its sliding window, and learned sinks."""
import pytest
import torch

from models import load_model, load_tokenizer
from models.attention_maps import attention_weights

PROMPT = "Keys and values are cached in blocks of sixteen tokens; queries attend to every one"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "gpt_bigcode"])  # GQA, GQA + bias, MHA, MQA
def test_weights_equal_transformers_eager(arch, tiny_checkpoints):
    path = tiny_checkpoints[arch]
    ids = load_tokenizer(path)(PROMPT)["input_ids"]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids]), output_attentions=True).attentions  # per layer (1, H, T, T)
    ours = attention_weights(load_model(path, torch.float32), ids)
    assert sorted(ours) == list(range(len(expected)))
    t = len(ids)
    for layer, w in ours.items():
        assert w.shape == expected[layer].shape[1:] == (hf.config.num_attention_heads, t, t)
        assert (w - expected[layer][0]).abs().max() <= 1e-4, layer
        assert torch.allclose(w.sum(-1), torch.ones(w.shape[:-1]), atol=1e-5)
        assert (w.triu(diagonal=1) == 0).all()  # nothing above the diagonal, exactly
    assert max(w.std().item() for w in ours.values()) > 0.01  # not uniform attention everywhere


def test_chosen_layers_and_bad_indices(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    model = load_model(path, torch.float32)
    assert sorted(attention_weights(model, [5, 6, 7], layers=[1])) == [1]
    with pytest.raises(ValueError, match="out of range"):
        attention_weights(model, [5, 6], layers=[model.config.num_layers])
    with pytest.raises(ValueError, match="no tokens"):
        attention_weights(model, [])
    from models import attention_maps

    big = int((attention_maps.MAX_WEIGHTS / (model.config.num_layers * model.config.num_heads)) ** 0.5) + 1
    with pytest.raises(ValueError, match="fewer layers or a shorter prompt"):
        attention_weights(model, [5] * big)


# ---- POST /v1/attention: each layer's window, over the API and a real engine process -----------------
API_PROMPT = " ".join(str(i % 17) for i in range(40))  # past tests/tiny.py's WINDOW in the tiny tokenizer


@pytest.fixture(scope="module")
def attention_app(tiny_checkpoints, variant_checkpoints):
    """name -> the ASGI app over that one model (a ModelWorker and its engine process), started on first
    use: a windowed model that fails to load fails its own tests only."""
    from server.engine import EngineConfig
    from server.http_app import create_app
    from server.model_client import LocalModelClient
    from server.openai_api import ApiLimits, OpenAIApi
    from server.worker import ModelWorker

    workers = {}
    sources = {"tiny": lambda: tiny_checkpoints["llama"],
               "tiny-window": lambda: variant_checkpoints["mistral-window"],
               "tiny-gemma2": lambda: variant_checkpoints["gemma2"],
               "tiny-granite": lambda: variant_checkpoints["granite_swa"]}

    def app(name: str):
        if name not in workers:
            path = sources[name]()
            workers[name] = (path, ModelWorker(name, EngineConfig(model=str(path), dtype="float32", num_blocks=64,
                                                                  block_size=4, max_model_len=256, enforce_eager=True)))
        path, worker = workers[name]
        return path, create_app(OpenAIApi({name: LocalModelClient(worker)}, ApiLimits()))
    yield app
    for _, worker in workers.values():
        worker.shutdown()


def post_attention(app, body: dict):
    import asyncio

    import httpx

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/attention", json=body)
    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    return r.json()


def test_api_says_every_layer_of_a_global_model_is_global(attention_app):
    _, app = attention_app("tiny")
    body = post_attention(app, {"model": "tiny", "prompt": API_PROMPT})
    assert set(body) == {"model", "tokens", "token_ids", "layers"}  # the old keys, no new top-level ones
    assert [layer["layer"] for layer in body["layers"]] == [0, 1]
    for layer in body["layers"]:
        assert set(layer) == {"layer", "weights", "window", "sinks"}  # added beside the old two
        assert layer["window"] is None and layer["sinks"] is False
    chosen = post_attention(app, {"model": "tiny", "prompt": "x y", "layers": [1]})["layers"]
    assert [(l["layer"], l["window"]) for l in chosen] == [(1, None)]


@pytest.mark.parametrize("name", ["tiny-window", "tiny-gemma2"])  # every layer sliding; sliding / global alternating
def test_api_says_each_layers_window_and_weights_past_it_are_zero(attention_app, name):
    from tests.tiny import WINDOW

    path, app = attention_app(name)
    body = post_attention(app, {"model": name, "prompt": API_PROMPT})
    config = load_model(path, torch.float32).config
    t = len(body["token_ids"])
    assert t > WINDOW + 4, t
    windows = [layer["window"] for layer in body["layers"]]
    assert windows == [config.window(i) for i in range(config.num_layers)]
    assert windows == ([WINDOW, WINDOW] if name == "tiny-window" else [WINDOW, None])  # Gemma 2: layer 0 slides
    expected = attention_weights(load_model(path, torch.float32), body["token_ids"])
    for layer in body["layers"]:
        w = torch.tensor(layer["weights"])  # (heads, query, key)
        assert layer["sinks"] is False and torch.allclose(w.sum(-1), torch.ones(w.shape[:-1]), atol=1e-5)
        assert torch.allclose(w, expected[layer["layer"]], atol=1e-5)
        q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
        visible = (k <= q) & ((q - k < layer["window"]) if layer["window"] else True)
        assert (w[:, ~visible] == 0).all() and (w[:, visible] > 0).all(), layer["layer"]
    # one layer asked for: its own window, not layer 0's
    (one,) = post_attention(app, {"model": name, "prompt": "x y", "layers": [1]})["layers"]
    assert one["layer"] == 1 and one["window"] == config.window(1)


def test_api_says_layers_have_sinks_and_rows_leave_them_their_share(attention_app):
    """Granite SWA: learned sinks on every layer (a row sums to 1 minus the sink's share), a global
    layer then three sliding ones."""
    from tests.tiny import WINDOW

    path, app = attention_app("tiny-granite")
    body = post_attention(app, {"model": "tiny-granite", "prompt": API_PROMPT})
    model = load_model(path, torch.float32)
    assert model.config.attn_sinks
    assert [layer["window"] for layer in body["layers"]] == [None, WINDOW, WINDOW, WINDOW]
    expected = attention_weights(model, body["token_ids"])
    t = len(body["token_ids"])
    q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
    for layer in body["layers"]:
        w = torch.tensor(layer["weights"])
        assert layer["sinks"] is True and torch.allclose(w, expected[layer["layer"]], atol=1e-5)
        sums = w.sum(-1)  # (heads, query): what the sink leaves
        assert (sums < 1 + 1e-5).all() and (sums < 0.99).any(), layer["layer"]
        outside = (k > q) | ((q - k >= layer["window"]) if layer["window"] else False)
        assert (w[:, outside] == 0).all()
