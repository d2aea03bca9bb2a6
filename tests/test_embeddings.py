"""POST /v1/embeddings for decoder models: each pooling (last, mean, cls; normalised or not) against HF's
base model (`AutoModel`, final norm included) in fp32, detected from a sentence-transformers config; the
official openai SDK (float, base64, dimensions: truncated and renormalised whether or not the model
normalises); embeddings in the same engine steps as generation, with no KV block held and no prefix-cache block
left after them; bad input as 4xx in OpenAI's shape; base models' checkpoints (HF `AutoModel`: bare tensor
names, no LM head) served as embedding models and refused for generation; and one app through real Ray Serve
over HTTP."""
import asyncio
import base64
import json
import shutil

import httpx
import numpy as np
import openai
import pytest
import torch
from safetensors import safe_open

from models import load_model
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.pooling import Pooling, read_sentence_transformers, resolve_pooling
from server.http_app import create_app
from server.model_client import LocalModelClient
from server.openai_api import ApiLimits, OpenAIApi
from server.worker import ModelWorker
from tests.tiny import hf_config, mixed_prompts, train_tokenizer

TOL = 1e-5
POOLINGS = [("last", True), ("last", False), ("mean", True), ("mean", False), ("cls", True), ("cls", False)]
ST_FLAGS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
TEXTS = ["The capital of France is Paris.", "Flat is better than nested.", "hello world"]


def sentence_transformers_dir(src, out, method: str, normalize: bool):
    """A copy of checkpoint `src` with a sentence-transformers config: Transformer, Pooling (`method`), and
    Normalize when asked (as Qwen3-Embedding ships it)."""
    shutil.copytree(src, out)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    flags = {flag: flag == ST_FLAGS[method] for flag in ST_FLAGS.values()}
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags,
                                                                 "pooling_mode_max_tokens": False}))
    return out


@pytest.fixture(scope="module")
def st_dirs(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("st")
    return {(m, n): sentence_transformers_dir(tiny_checkpoints["llama"], root / f"{m}-{n}", m, n) for m, n in POOLINGS}


@pytest.fixture(scope="module")
def hf(tiny_checkpoints):
    """HF's base model (no LM head) of the tiny Llama and its tokenizer: `last_hidden_state` has the final norm."""
    from transformers import AutoModel, AutoTokenizer

    path = tiny_checkpoints["llama"]
    return AutoModel.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def hf_embedding(hf, ids, method: str, normalize: bool) -> np.ndarray:
    model, _ = hf
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0]  # (T, C)
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[method]
    return (torch.nn.functional.normalize(v, dim=-1) if normalize else v).numpy()


def engine_config(model, **kw) -> EngineConfig:
    # NOTE: a token budget of 32 prefills the longer prompts in chunks: mean pooling spans them
    defaults = dict(model=str(model), dtype="float32", num_blocks=128, block_size=4, max_model_len=256,
                    max_num_batched_tokens=32, max_num_seqs=8, enforce_eager=True)
    return EngineConfig(**{**defaults, **kw})


@pytest.mark.parametrize("method,normalize", POOLINGS)
def test_pooling_from_sentence_transformers_matches_hf(st_dirs, hf, method, normalize):
    engine = LLMEngine(engine_config(st_dirs[(method, normalize)]))
    assert (engine.info.task, engine.info.pooling, engine.info.hidden_size) == ("embed", Pooling(method, normalize), 64)
    prompts = mixed_prompts(hf[1], 6, seed=1, min_len=1, max_len=90)
    for ids, ours in zip(prompts, engine.embed(prompts)):
        assert ours.dtype == np.float32 and ours.shape == (64,)
        np.testing.assert_allclose(ours, hf_embedding(hf, ids, method, normalize), rtol=0, atol=TOL)
        if normalize:
            assert abs(np.linalg.norm(ours) - 1) < 1e-5
    assert engine.kv.num_used_blocks == 0 and engine.kv.pool.num_cached_free_blocks == 0


def test_flags_pool_a_checkpoint_without_sentence_transformers_config(tiny_checkpoints, st_dirs, hf):
    plain = tiny_checkpoints["llama"]
    assert resolve_pooling(plain, "auto") is None  # a causal LM's checkpoint: generation
    assert resolve_pooling(plain, "embed") == Pooling("last", True)
    assert resolve_pooling(st_dirs[("mean", True)], "auto", "cls", False) == Pooling("cls", False)  # flags win
    assert resolve_pooling(st_dirs[("mean", True)], "generate") is None
    assert read_sentence_transformers(st_dirs[("cls", False)]) == Pooling("cls", False)
    engine = LLMEngine(engine_config(plain, task="embed", pooling="mean", embed_normalize=False))
    ids = hf[1](TEXTS[0])["input_ids"]
    np.testing.assert_allclose(engine.embed([ids])[0], hf_embedding(hf, ids, "mean", False), rtol=0, atol=TOL)


def test_unserved_sentence_transformers_pooling_is_refused(tiny_checkpoints, tmp_path):
    out = sentence_transformers_dir(tiny_checkpoints["llama"], tmp_path / "max", "mean", True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="not served"):
        read_sentence_transformers(out)


def test_embeddings_share_steps_with_generation_and_keep_no_kv(st_dirs, hf):
    """One engine: greedy generations and embeddings queued together run in the same steps; each is what it
    is alone (HF's, for the embeddings); an embedding of a cached prompt reads no cached block; afterwards no
    block is held. (That embeddings cache nothing: test_pooling_from_sentence_transformers_matches_hf.)"""
    method, normalize = "mean", True
    engine = LLMEngine(engine_config(st_dirs[(method, normalize)], num_blocks=512))  # no preemption
    tok = hf[1]
    gen_prompts = mixed_prompts(tok, 3, seed=2, min_len=5, max_len=40)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = [r[0].token_ids for r in engine.generate(gen_prompts, params)]
    assert engine.kv.num_used_blocks == 0 and engine.kv.pool.num_cached_free_blocks > 0
    hits = engine.scheduler.num_prefix_hits

    mixed_steps, submit = [], engine.runner.submit

    def recording(batch):
        mixed_steps.append(bool(batch.pooling_counts) and len(batch.logits_indices) > 0)
        return submit(batch)
    engine.runner.submit = recording
    # an embedding of a prompt the cache holds (the first generation's) must not read it
    embed_prompts = [gen_prompts[0], *mixed_prompts(tok, 4, seed=3, min_len=20, max_len=80)]
    for i, ids in enumerate(gen_prompts):
        engine.add_request(f"g{i}", ids, params)
    for i, ids in enumerate(embed_prompts):
        engine.add_validated(f"e{i}", ids, SamplingParams(max_tokens=1), final_only=True, embed=True)
    tokens, vectors = {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id.startswith("g"):
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            elif o.finished:
                assert o.finish_reason == "stop" and o.new_token_ids == () and o.stats.num_cached_tokens == 0
                vectors[o.request_id] = o.embedding
    assert any(mixed_steps)
    assert [tuple(tokens[f"g{i}"]) for i in range(3)] == alone
    for i, ids in enumerate(embed_prompts):
        np.testing.assert_allclose(vectors[f"e{i}"], hf_embedding(hf, ids, method, normalize), rtol=0, atol=TOL)
    # only the generations' repeats hit the cache (their full prompt blocks), not the embedding of one of them
    assert engine.scheduler.num_prefix_hits - hits == sum((len(ids) - 1) // 4 * 4 for ids in gen_prompts)
    assert engine.kv.num_used_blocks == 0


def test_a_preempted_embedding_starts_its_pooling_over(st_dirs, hf):
    """A pool too small for both: the embedding (newest) is preempted mid-prefill, again and again while a long
    generation holds its blocks, and recomputed from position 0: its mean counts each position once."""
    engine = LLMEngine(engine_config(st_dirs[("mean", False)], num_blocks=22, max_num_batched_tokens=16))
    tok = hf[1]
    gen, ids = mixed_prompts(tok, 1, seed=4, min_len=8, max_len=8)[0], mixed_prompts(tok, 1, seed=5, min_len=80,
                                                                                      max_len=80)[0]
    engine.add_request("g", gen, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    engine.add_validated("e", ids, SamplingParams(max_tokens=1), final_only=True, embed=True)
    final = None
    while engine.has_unfinished():
        final = next((o for o in engine.step() if o.request_id == "e"), final)
    assert final.stats.num_preemptions > 0 and engine.scheduler.num_preemptions == final.stats.num_preemptions
    np.testing.assert_allclose(final.embedding, hf_embedding(hf, ids, "mean", False), rtol=0, atol=TOL)
    assert engine.kv.num_used_blocks == 0


# ---- the API, in process --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def api(st_dirs, tiny_checkpoints):
    workers = {"emb": ModelWorker("emb", engine_config(st_dirs[("last", True)])),
               "tiny": ModelWorker("tiny", engine_config(tiny_checkpoints["llama"])),
               "both": ModelWorker("both", engine_config(tiny_checkpoints["llama"], task="generate,embed",
                                                         pooling="mean", embed_normalize=False))}
    yield OpenAIApi({name: LocalModelClient(w) for name, w in workers.items()},
                    ApiLimits(max_body_bytes=256 * 1024, max_embedding_inputs=64))
    for w in workers.values():
        w.shutdown()


def run(api, go):
    """`go(sdk, http)` against the app in process: the official openai SDK and a plain httpx client."""
    async def main():
        transport = httpx.ASGITransport(app=create_app(api))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
            return await go(sdk, http)
    return asyncio.run(main())


def used_blocks(api) -> int:
    return sum(c.worker.stats()["num_used_blocks"] for c in api.clients.values())


def test_openai_sdk_float_base64_and_dimensions(api, hf):
    tok = hf[1]
    ids = [tok(t)["input_ids"] for t in TEXTS]
    expected = [hf_embedding(hf, i, "last", True) for i in ids]

    async def go(sdk, http):
        default = await sdk.embeddings.create(model="emb", input=TEXTS)  # the SDK asks for base64 and decodes it
        floats = await sdk.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
        raw = (await http.post("/v1/embeddings", json={"model": "emb", "input": TEXTS,
                                                        "encoding_format": "base64"})).json()
        short = await sdk.embeddings.create(model="emb", input=ids, dimensions=16, encoding_format="float")
        one = await sdk.embeddings.create(model="emb", input=ids[0], encoding_format="float")  # token ids
        return default, floats, raw, short, one

    default, floats, raw, short, one = run(api, go)
    n = sum(map(len, ids))
    for res in (default, floats, short):
        assert res.object == "list" and res.model == "emb" and [d.index for d in res.data] == [0, 1, 2]
        assert res.usage.prompt_tokens == res.usage.total_tokens == n
    for res in (default, floats):
        for d, want in zip(res.data, expected):
            np.testing.assert_allclose(d.embedding, want, rtol=0, atol=TOL)
    # base64 is the float32 values themselves, little-endian: bit for bit the float answer
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    assert all(np.array_equal(a, np.array(d.embedding, dtype=np.float32)) for a, d in zip(decoded, floats.data))
    for d, want in zip(short.data, expected):  # Matryoshka: the first 16 values, renormalised
        assert len(d.embedding) == 16
        np.testing.assert_allclose(d.embedding, want[:16] / np.linalg.norm(want[:16]), rtol=0, atol=TOL)
    np.testing.assert_allclose(one.data[0].embedding, expected[0], rtol=0, atol=TOL)
    assert one.usage.prompt_tokens == len(ids[0])
    assert used_blocks(api) == 0


def test_concurrent_requests_batch_in_one_engine(api, hf):
    tok = hf[1]
    batches = [mixed_prompts(tok, 5, seed=10 + k, min_len=2, max_len=60) for k in range(4)]

    async def go(sdk, http):
        return await asyncio.gather(*(sdk.embeddings.create(model="emb", input=b, encoding_format="float")
                                      for b in batches))

    for batch, res in zip(batches, run(api, go)):
        for ids, d in zip(batch, res.data):
            np.testing.assert_allclose(d.embedding, hf_embedding(hf, ids, "last", True), rtol=0, atol=TOL)
    assert used_blocks(api) == 0


def test_generation_and_embeddings_batched_on_one_model(api, hf):
    """A generate,embed model: chats and embeddings sent together through the SDK, answered as a generate-only
    model's greedy chats (same weights) and HF's embeddings; no block held afterwards."""
    tok = hf[1]
    chats = [[{"role": "user", "content": t}] for t in TEXTS]
    inputs = [mixed_prompts(tok, 4, seed=20 + k, min_len=10, max_len=80) for k in range(3)]
    kw = dict(max_tokens=12, temperature=0)

    async def go(sdk, http):
        together = await asyncio.gather(
            *(sdk.chat.completions.create(model="both", messages=m, **kw) for m in chats),
            *(sdk.embeddings.create(model="both", input=i, encoding_format="float") for i in inputs))
        alone = [await sdk.chat.completions.create(model="tiny", messages=m, **kw) for m in chats]
        return together[:len(chats)], together[len(chats):], alone

    answers, embedded, alone = run(api, go)
    assert [a.choices[0].message.content for a in answers] == [a.choices[0].message.content for a in alone]
    assert all(a.usage.completion_tokens >= 1 for a in answers)
    for batch, res in zip(inputs, embedded):
        for ids, d in zip(batch, res.data):
            np.testing.assert_allclose(d.embedding, hf_embedding(hf, ids, "mean", False), rtol=0, atol=TOL)
    assert used_blocks(api) == 0


def test_models_say_what_each_serves(api):
    async def go(sdk, http):
        return (await http.get("/v1/models")).json()

    by_id = {m["id"]: m for m in run(api, go)["data"]}
    assert by_id["emb"]["task"] == "embed" and by_id["emb"]["pooling"] == {"method": "last", "normalize": True}
    assert by_id["emb"]["hidden_size"] == 64
    assert by_id["tiny"]["task"] == "generate" and by_id["tiny"]["pooling"] is None
    assert by_id["both"]["task"] == "generate,embed" and by_id["both"]["pooling"] == {"method": "mean",
                                                                                      "normalize": False}


def test_dimensions_renormalise_a_model_that_does_not_normalise(api, hf):
    """`dimensions` cuts and renormalises even where the model's embeddings are not normalised (vLLM would not):
    the "both" model pools mean without Normalize; the full width is the vector as it is."""
    tok = hf[1]
    ids = [tok(t)["input_ids"] for t in TEXTS]
    raw = [hf_embedding(hf, i, "mean", False) for i in ids]
    assert all(abs(np.linalg.norm(v) - 1) > 0.1 for v in raw)  # unnormalised, so renormalising shows

    async def go(sdk, http):
        cut = [await sdk.embeddings.create(model="both", input=ids, dimensions=k, encoding_format="float")
               for k in (1, 16, 63)]
        full = await sdk.embeddings.create(model="both", input=ids, dimensions=64, encoding_format="float")
        b64 = (await http.post("/v1/embeddings", json={"model": "both", "input": ids, "dimensions": 16,
                                                        "encoding_format": "base64"})).json()
        return cut, full, b64

    cut, full, b64 = run(api, go)
    for k, res in zip((1, 16, 63), cut):
        for d, want in zip(res.data, raw):
            assert len(d.embedding) == k
            np.testing.assert_allclose(d.embedding, want[:k] / np.linalg.norm(want[:k]), rtol=0, atol=TOL)
    for d, want in zip(full.data, raw):
        np.testing.assert_allclose(d.embedding, want, rtol=0, atol=TOL)
    for d, want in zip(b64["data"], raw):  # base64 too
        np.testing.assert_allclose(np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4"),
                                   want[:16] / np.linalg.norm(want[:16]), rtol=0, atol=TOL)
    assert used_blocks(api) == 0


@pytest.mark.parametrize("body,param,contains", [
    ({"model": "tiny", "input": "hello"}, "model", "serves text generation"),
    ({"model": "emb", "input": "hello", "dimensions": 65}, "dimensions", "embedding size of 64"),
    ({"model": "emb", "input": "hello", "dimensions": 0}, "dimensions", None),
    ({"model": "emb", "input": ""}, "input", "empty"),
    ({"model": "emb", "input": []}, "input", "empty"),
    ({"model": "emb", "input": ["a", ""]}, "input", "empty"),
    ({"model": "emb", "input": [[5, 6], []]}, "input", "empty"),
    ({"model": "emb", "input": [5, 10**6]}, "input", "token ids"),
    ({"model": "emb", "input": [[5], [-1]]}, "input", "token ids"),
    ({"model": "emb", "input": [5] * 257}, "input", "context is 256"),
    ({"model": "emb", "input": ["x"] * 65}, "input", "at most 64"),
    ({"model": "emb", "input": "hello", "encoding_format": "int8"}, "encoding_format", None),
    ({"model": "emb", "input": "hello", "truncate": True}, "truncate", None),
])
def test_bad_input_is_400_in_openai_shape(api, body, param, contains):
    async def go(sdk, http):
        return await http.post("/v1/embeddings", json=body)

    resp = run(api, go)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and (contains is None or contains in error["message"]), error
    assert used_blocks(api) == 0


def test_generation_on_an_embedding_model_is_400(api):
    async def go(sdk, http):
        chat = await http.post("/v1/chat/completions", json={"model": "emb", "messages": [{"role": "user", "content": "hi"}]})
        completion = await http.post("/v1/completions", json={"model": "emb", "prompt": "hi", "stream": True})
        ok = await http.post("/v1/embeddings", json={"model": "emb", "input": [5] * 256})  # the whole context
        return chat, completion, ok

    chat, completion, ok = run(api, go)
    for resp in (chat, completion):
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "model", resp.text
        assert "serves embeddings" in resp.json()["error"]["message"]
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 256
    assert used_blocks(api) == 0


# ---- base models' checkpoints: HF `AutoModel` saves a bare decoder, as embedding models often ship ------------
BASE_ARCHS = {"llama": "LlamaModel", "qwen2": "Qwen2Model", "gpt2": "GPT2Model"}
PREFIXES = ("model.", "transformer.", "lm_head.")  # a ...ForCausalLM's names, which these have none of


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory):
    """Each arch's tiny random decoder as `AutoModel.from_config(...).save_pretrained` writes it: architectures
    `LlamaModel` etc., tensor names without `model.` / `transformer.`, embeddings untied and no LM head."""
    from transformers import AutoModel

    root, tok = tmp_path_factory.mktemp("base"), train_tokenizer()
    eos, bos = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    out = {}
    for arch in BASE_ARCHS:
        cfg = hf_config(arch, len(tok), eos, bos)
        cfg.tie_word_embeddings = False
        torch.manual_seed(7)
        AutoModel.from_config(cfg, dtype=torch.float32).save_pretrained(root / arch, safe_serialization=True)
        tok.save_pretrained(root / arch)
        out[arch] = root / arch
    return out


@pytest.fixture(scope="module")
def base_api(base_dirs):
    workers = {arch: ModelWorker(arch, engine_config(d)) for arch, d in base_dirs.items()}  # task auto
    yield OpenAIApi({name: LocalModelClient(w) for name, w in workers.items()}, ApiLimits(max_embedding_inputs=64))
    for w in workers.values():
        w.shutdown()


def test_base_model_checkpoints_load_without_lm_head(base_dirs):
    for arch, d in base_dirs.items():
        assert json.loads((d / "config.json").read_text())["architectures"] == [BASE_ARCHS[arch]]
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            names = list(f.keys())
        assert names and not any(n.startswith(PREFIXES) for n in names), names
        assert load_model(d).lm_head is None


@pytest.mark.parametrize("arch", list(BASE_ARCHS))
def test_base_model_checkpoint_serves_embeddings_as_hf_pools_them(base_api, base_dirs, arch):
    """Detected as an embedding model (task auto: last, normalised); each input's vector is HF `AutoModel`'s
    last hidden state of its last token, normalised, within 1e-5 in fp32."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(base_dirs[arch], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(base_dirs[arch])
    token_ids = [*mixed_prompts(tok, 3, seed=30, min_len=2, max_len=70), tok("hello")["input_ids"][:1]]

    async def go(sdk, http):
        texts, tokens = await asyncio.gather(sdk.embeddings.create(model=arch, input=TEXTS, encoding_format="float"),
                                             sdk.embeddings.create(model=arch, input=token_ids, encoding_format="float"))
        return texts, tokens, (await http.get("/v1/models")).json()

    texts, tokens, models = run(base_api, go)
    listed = {m["id"]: m for m in models["data"]}[arch]
    assert listed["task"] == "embed" and listed["pooling"] == {"method": "last", "normalize": True}
    inputs = [tok(t)["input_ids"] for t in TEXTS] + token_ids
    for ids, d in zip(inputs, [*texts.data, *tokens.data], strict=True):
        with torch.no_grad():
            h = model(torch.tensor([ids])).last_hidden_state[0, -1]  # (C,)
        np.testing.assert_allclose(d.embedding, torch.nn.functional.normalize(h, dim=-1).numpy(), rtol=0, atol=TOL)
    assert texts.usage.prompt_tokens + tokens.usage.prompt_tokens == sum(map(len, inputs))
    assert used_blocks(base_api) == 0


def test_a_quantized_base_model_embeds_on_the_native_decoder(base_dirs):
    """No LM head is no reason to leave the C++ decoder: int8 weights run there, within int8's error of HF."""
    from transformers import AutoModel, AutoTokenizer

    engine = LLMEngine(engine_config(base_dirs["llama"], quantization="int8", enforce_eager=False))
    assert engine.runner.step == "native"
    ids = AutoTokenizer.from_pretrained(base_dirs["llama"])(TEXTS[0])["input_ids"]
    with torch.no_grad():
        h = AutoModel.from_pretrained(base_dirs["llama"], dtype=torch.float32)(torch.tensor([ids])).last_hidden_state
    got = torch.as_tensor(engine.embed([ids])[0])
    assert torch.nn.functional.cosine_similarity(got, h[0, -1], dim=0) > 0.99


@pytest.mark.parametrize("task", ["generate", "generate,embed"])
def test_generation_on_a_base_model_without_lm_head_is_refused_at_start(base_dirs, task):
    with pytest.raises(ValueError, match="no LM head .* cannot generate"):
        LLMEngine(engine_config(base_dirs["qwen2"], task=task))


def test_a_causal_lm_checkpoint_without_its_lm_head_is_still_refused(tiny_checkpoints, tmp_path):
    """Only a base model's checkpoint may lack the LM head: a `...ForCausalLM` one without it is broken."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "no-head"
    shutil.copytree(tiny_checkpoints["qwen2"], d)  # untied
    tensors = load_file(d / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(KeyError, match="lm_head.weight"):
        load_model(d)


# ---- real Ray Serve over HTTP ---------------------------------------------------------------------------------
APP, ROUTE = "attnserve-embed", "/embed"


@pytest.fixture(scope="module")
def serve_embed(ray_session, st_dirs):
    from ray import serve

    from server.deployment import build_app
    from server.serve_config import ServeConfig

    cfg = ServeConfig(models={"emb": str(st_dirs[("cls", True)])}, num_cpus=0.25,
                      engine=engine_config(st_dirs[("cls", True)], num_threads=1))
    serve.run(build_app(cfg), name=APP, route_prefix=ROUTE)
    yield f"{ray_session}{ROUTE}"
    serve.delete(APP)


def test_embeddings_through_ray_serve(serve_embed, hf):
    from ray import serve

    client = openai.OpenAI(base_url=f"{serve_embed}/v1", api_key="unused", max_retries=0, timeout=120)
    res = client.embeddings.create(model="emb", input=TEXTS)
    for text, d in zip(TEXTS, res.data):
        np.testing.assert_allclose(d.embedding, hf_embedding(hf, hf[1](text)["input_ids"], "cls", True), rtol=0, atol=TOL)
    assert [m.id for m in client.models.list().data] == ["emb"]
    assert httpx.get(f"{serve_embed}/v1/models").json()["data"][0]["task"] == "embed"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="emb", messages=[{"role": "user", "content": "hi"}])
    assert bad.value.body["param"] == "model"
    stats = serve.get_deployment_handle("model-emb", app_name=APP).stats.remote().result()
    assert stats["num_used_blocks"] == 0 and stats["num_cached_free_blocks"] == 0
