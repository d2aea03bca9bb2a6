"""Speculative decoding through the real stack: Ray Serve serving the default model with n-gram
speculation (the serve.yaml form of --speculative-config), the official OpenAI SDK streaming, the
same greedy text as the engine without speculation, `usage.speculative`, the spec_decode metrics."""
import time

import openai
import pytest

from models.corpus import corpus_words
from tests.test_observability_e2e import scrape, total

APP, ROUTE, MODEL = "attnserve-speculative", "/speculative", "smol"
PASSAGE = " ".join(corpus_words()[400:480])
ASK = [{"role": "user", "content": f"Copy this passage exactly, changing only every 'the' to 'THE':\n\n{PASSAGE}"}]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def url(ray_session, default_model_dir):
    from ray import serve

    from server.deployment import build_app
    from server.serve_config import ServeConfig

    cfg = ServeConfig.from_args({"models": {MODEL: str(default_model_dir)}, "num_cpus": 0.25, "engine": {
        "dtype": "float32", "kv_cache_memory": None, "num_blocks": 512, "max_model_len": 2048, "num_threads": 1,
        # NOTE: auto_disable off: the test needs drafts, whatever this machine measures them to be worth
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "auto_disable": False}}})
    serve.run(build_app(cfg), name=APP, route_prefix=ROUTE)
    yield f"{ray_session}{ROUTE}"
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain_text(default_model_dir):
    """The same chat, greedy, from an engine without speculation. fp32: in bf16 a verification step's
    several rows round as a batch does, so a near-tie may go the other way (tests/test_speculative.py)."""
    from server.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(default_model_dir), dtype="float32", kv_cache_memory=None, num_blocks=256))
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    return engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0][0].text


def test_streamed_greedy_text_equals_no_speculation(client, url, plain_text):
    before = scrape(url)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=MAX_TOKENS,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain_text
    usage = chunks[-1].usage.model_dump()
    spec = usage["speculative"]
    assert 0 < spec["accepted"] <= spec["drafted"]
    # several tokens arrive in one chunk when drafts are accepted
    assert sum(1 for c in chunks if c.choices) < usage["completion_tokens"]
    deadline = time.monotonic() + 30  # replicas push metrics every second
    while time.monotonic() < deadline:
        after = scrape(url)
        drafted = total(after, "attnserve_spec_decode_num_draft_tokens_total") - \
            total(before, "attnserve_spec_decode_num_draft_tokens_total")
        if drafted >= spec["drafted"]:
            break
        time.sleep(0.5)
    assert drafted == spec["drafted"]
    accepted = total(after, "attnserve_spec_decode_num_accepted_tokens_total") - \
        total(before, "attnserve_spec_decode_num_accepted_tokens_total")
    assert accepted == spec["accepted"]
    by_pos = total(after, "attnserve_spec_decode_num_accepted_tokens_per_pos_total", position="0") - \
        total(before, "attnserve_spec_decode_num_accepted_tokens_per_pos_total", position="0")
    assert 0 < by_pos <= accepted


def test_models_report_the_method(client):
    import httpx

    info = httpx.get(f"{client.base_url}models", timeout=30).json()["data"][0]
    assert info.get("speculative") == "ngram"
