"""Reasoning models (server/reasoning.py, server/engine/thinking.py): `<think>` text split into
`reasoning_content` (whole and streamed alike, before tool-call parsing), the thinking budget forced
engine-side (exactly N thinking tokens, an answer under its budget unchanged: batched, preempted, with
drafts), the grammar after the thinking, `chat_template_kwargs` into the template, and one run through
Ray Serve with the OpenAI SDK.

Two tiny random checkpoints made here: a Qwen3 whose tokenizer has `<think>` / `</think>` as added
tokens and a template with `enable_thinking`, its LM head rows for the two tags set so that greedy
decoding opens and later closes a thinking by itself; and a DeepSeek-R1-style one whose template opens
`<think>` in the prompt and whose tags are plain text (several tokens each).
"""
import asyncio
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from server.api_request import ApiLimits
from server.api_response import ChoiceBuilder
from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.engine.sampling_params import Reasoning, SamplingParams, StructuredOutput
from server.http_app import create_app
from server.model_client import LocalModelClient
from server.openai_api import OpenAIApi
from server.reasoning import ANSWERING, END, PENDING, START, THINKING, ReasoningParser, answer_start, resolve
from server.tools import ToolChoice
from server.wire import Chunk
from server.worker import ModelWorker
from tests.tiny import CHAT_TEMPLATE, QWEN3_TEMPLATE, R1_TEMPLATE, make_thinking_checkpoint, mixed_prompts
from tests.tiny import thinking_prompt as _prompt

ASK = [{"role": "user", "content": "hello world"}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["n", "ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("thinking")
    return {"qwen3": make_thinking_checkpoint(root / "qwen3", r1=False),
            "r1": make_thinking_checkpoint(root / "r1", r1=True)}


# ---- the parser (pure) ------------------------------------------------------------------------
def split_streamed(start: str, text: str, cuts: list[int]) -> tuple[str, str]:
    parser, reasoning, content, last = ReasoningParser(start), "", "", 0
    for cut in [*cuts, len(text)]:
        r, c = parser.feed(text[last:cut])
        reasoning, content, last = reasoning + r, content + c, cut
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("start, text, expected", [
    (THINKING, "a plan</think>\n\nthe answer", ("a plan", "\n\nthe answer")),
    (THINKING, "<think>opened again</think>x", ("opened again", "x")),  # R1-0528 repeats the opening tag
    (THINKING, "cut short by length </thi", ("cut short by length </thi", "")),  # never closed: all reasoning
    (PENDING, "<think>\nhmm\n</think>\n\nyes", ("\nhmm\n", "\n\nyes")),
    (PENDING, "no thinking at all </think> here", ("", "no thinking at all </think> here")),  # qwen3: not opened
    (PENDING, "<thin", ("", "<thin")),
    (ANSWERING, "<think>x</think>y", ("", "<think>x</think>y")),  # enable_thinking=false: all content
])
def test_parser_splits_whole_and_at_every_cut(start, text, expected):
    assert split_streamed(start, text, []) == expected
    for cut in range(len(text) + 1):  # NOTE: a tag split across pieces is held back, never leaked
        assert split_streamed(start, text, [cut]) == expected, cut
    assert split_streamed(start, text, list(range(len(text)))) == expected  # one character at a time


def test_parser_choice_and_where_answers_start():
    assert resolve("auto", QWEN3_TEMPLATE) == "qwen3" and resolve("auto", R1_TEMPLATE) == "deepseek_r1"
    assert resolve("auto", CHAT_TEMPLATE) is None and resolve(None, QWEN3_TEMPLATE) is None
    with pytest.raises(ValueError, match="reasoning_parser"):
        resolve("granite", QWEN3_TEMPLATE)
    assert answer_start("qwen3", "<|im_start|>assistant\n") == PENDING
    assert answer_start("deepseek_r1", "<|im_start|>assistant\n") == THINKING  # R1 thinks, tag or not
    assert answer_start("qwen3", "assistant\n<think>\n") == THINKING
    assert answer_start("qwen3", "assistant\n<think>\n\n</think>\n\n") == ANSWERING
    with pytest.raises(ValueError, match="reasoning_parser"):
        EngineConfig(reasoning_parser="granite")
    with pytest.raises(ValueError, match="reasoning_budget"):
        EngineConfig(reasoning_budget=-2)


def test_tool_calls_are_parsed_from_the_answer_only_streamed_and_whole():
    """A `<tool_call>` the model thinks about stays reasoning; the one after `</think>` is a call."""
    pieces = ['<think>maybe <tool_call>{"name": "f", "arguments": {"x": 1}}</tool', '_call> no</th', 'ink>ok ',
              '<tool_call>{"name": "g", "arguments": {"y": 2}}</tool_call>']
    builder = ChoiceBuilder(0, chat=True, tools=ToolChoice("auto"), reasoning=PENDING)
    events = [e for i, p in enumerate(pieces)
              for e in builder.add(Chunk(0, p, (i,), finish_reason="stop" if i == len(pieces) - 1 else None))]
    message = builder.whole()["message"]
    assert message["reasoning_content"] == 'maybe <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> no'
    assert message["content"].strip() == "ok" and [c["function"]["name"] for c in message["tool_calls"]] == ["g"]
    assert "".join(e["delta"].get("reasoning_content", "") for e in events) == message["reasoning_content"]
    streamed = [c["function"]["name"] for e in events for c in e["delta"].get("tool_calls", []) if "name" in c["function"]]
    assert streamed == ["g"] and builder.whole()["finish_reason"] == "tool_calls"


# ---- the engine: budgets and grammars ---------------------------------------------------------
def _engine(path: Path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), dtype="float32", num_blocks=256, block_size=4, max_num_batched_tokens=512,
               max_num_seqs=32, enforce_eager=True)
    return LLMEngine(EngineConfig(**{**cfg, **kw}))


def _tags(tok) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(tok.encode(START, add_special_tokens=False)), tuple(tok.encode(END, add_special_tokens=False))


BUDGETS = [0, 1, 3, 7, 12, None]  # None: no budget; 40 > max_tokens: never reached


@pytest.mark.parametrize("ckpt", ["qwen3", "r1"])
def test_budget_forces_the_end_after_exactly_n_thinking_tokens_batched_preempted_and_drafted(checkpoints, ckpt):
    """Prompts that end inside a thinking, each with a budget: the first N tokens are the unbudgeted
    run's, then the end tag's tokens (one or several); a budget past max_tokens changes nothing. The
    same outputs in one batch on a pool small enough to preempt, and with n-gram drafts."""
    alone = _engine(checkpoints[ckpt])
    tok = alone.tokenizer
    start, end = _tags(tok)
    prompts = mixed_prompts(tok, 12, seed=5, min_len=6, max_len=40)
    budgets = [BUDGETS[i % len(BUDGETS)] for i in range(len(prompts))] + [40]
    prompts.append(prompts[0])

    def params(b):
        reasoning = Reasoning(start, end, THINKING, b) if b is not None else None
        return SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, reasoning=reasoning)

    free = [alone.generate([p], params(None))[0][0].token_ids for p in prompts]
    solo = [alone.generate([p], params(b))[0][0].token_ids for p, b in zip(prompts, budgets)]
    for b, f, s in zip(budgets, free, solo):
        natural = next((i for i in range(len(f)) if f[i:i + len(end)] == end), len(f))  # where it closes by itself
        if b is None or b >= natural:
            assert s == f  # NOTE: an answer that stays under its budget is the unbudgeted one
        else:
            assert s[:b] == f[:b] and s[b:b + len(end)] == end, (b, s, f)
    busy = _engine(checkpoints[ckpt], num_blocks=40, max_num_batched_tokens=64)
    together = busy.generate(prompts, [params(b) for b in budgets])
    assert busy.scheduler.num_preemptions > 0
    assert [r[0].token_ids for r in together] == solo
    spec = _engine(checkpoints[ckpt], speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                          "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                                          "auto_disable": False})
    drafted = spec.generate(prompts, [params(b) for b in budgets])
    assert [r[0].token_ids for r in drafted] == solo
    assert sum(r[0].stats.num_accepted_tokens for r in drafted) > 0  # drafts ran, and were kept


def test_grammar_applies_after_the_thinking(checkpoints):
    """A JSON schema with a thinking budget: the thinking is free (the unconstrained run's tokens), the
    end tag is forced, and the answer after it parses against the schema; with a pending start (qwen3) the
    model may still open its thinking: the grammar's first token mask lets `<think>` through."""
    engine = _engine(checkpoints["r1"])
    tok = engine.tokenizer
    start, end = _tags(tok)
    json_spec = StructuredOutput("json", json.dumps(SCHEMA))
    prompt = _prompt(tok)
    free = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0][0]
    for budget in (0, 4):
        params = SamplingParams(max_tokens=60, temperature=0, structured=json_spec,
                                reasoning=Reasoning(start, end, THINKING, budget))
        out = engine.generate([prompt], params)[0][0]
        assert out.finish_reason == "stop"
        assert out.token_ids[:budget] == free.token_ids[:budget] and out.token_ids[budget:budget + len(end)] == end
        jsonschema.validate(json.loads(tok.decode(out.token_ids[budget + len(end):], skip_special_tokens=True)), SCHEMA)
    q3 = _engine(checkpoints["qwen3"])
    start, end = _tags(q3.tokenizer)
    params = SamplingParams(max_tokens=60, temperature=0, structured=json_spec, reasoning=Reasoning(start, end, PENDING, 2))
    out = q3.generate([_prompt(q3.tokenizer)], params)[0][0]
    assert out.token_ids[:1] == start and out.token_ids[3:4] == end and out.finish_reason == "stop"
    jsonschema.validate(json.loads(q3.tokenizer.decode(out.token_ids[4:], skip_special_tokens=True)), SCHEMA)


# ---- the API, in process ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def api(checkpoints):
    cfg = dict(model=str(checkpoints["qwen3"]), dtype="float32", num_blocks=128, block_size=4, max_model_len=256,
               enforce_eager=True)
    workers = {"think": ModelWorker("think", EngineConfig(**cfg, reasoning_parser="auto")),
               "plain": ModelWorker("plain", EngineConfig(**cfg))}
    yield OpenAIApi({k: LocalModelClient(w) for k, w in workers.items()}, ApiLimits(max_tokens=200))
    for w in workers.values():
        w.shutdown()


def post(api, path, body, status=200):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(api)), base_url="http://t") as c:
            if not body.get("stream"):
                response = await c.post(path, json=body)
                assert response.status_code == status, response.text
                return response.json()
            events = []
            async with c.stream("POST", path, json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
            return events
    return asyncio.run(go())


def chat(api, model="think", stream=False, status=200, **kw):
    body = {"model": model, "messages": ASK, "max_tokens": 16, "temperature": 0, "stream": stream, **kw}
    answer = post(api, "/v1/chat/completions", body, status)
    if not stream:
        return answer
    reasoning = "".join(e["choices"][0]["delta"].get("reasoning_content", "") for e in answer if e.get("choices"))
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in answer if e.get("choices"))
    return reasoning or None, content


def test_reasoning_content_splits_the_greedy_text_at_the_end_tag_streamed_and_whole(api):
    models = {m["id"]: m["reasoning_parser"] for m in post_get(api, "/v1/models")["data"]}
    assert models == {"think": "qwen3", "plain": None}
    plain = chat(api, "plain")["choices"][0]["message"]
    assert "reasoning_content" not in plain and END in plain["content"]
    message = chat(api)["choices"][0]["message"]
    assert message["reasoning_content"] and START + message["reasoning_content"] + END + message["content"] == plain["content"]
    assert chat(api, stream=True) == (message["reasoning_content"], message["content"])
    low = chat(api, reasoning_effort="low")["choices"][0]["message"]  # 256 tokens: never reached here
    assert low == message


def post_get(api, path):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(api)), base_url="http://t") as c:
            return (await c.get(path)).json()
    return asyncio.run(go())


def test_thinking_token_budget_and_a_schema_after_the_thinking(api):
    whole = chat(api, thinking_token_budget=3, logprobs=True)["choices"][0]
    tokens = [t["token"] for t in whole["logprobs"]["content"]]
    assert tokens[0] == START and tokens[4] == END  # exactly 3 thinking tokens, then the forced end tag
    assert whole["message"]["reasoning_content"] == "".join(tokens[1:4])
    assert chat(api, stream=True, thinking_token_budget=3) == (whole["message"]["reasoning_content"],
                                                                whole["message"]["content"])
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    structured = chat(api, thinking_token_budget=2, response_format=fmt, max_tokens=60)["choices"][0]
    assert structured["finish_reason"] == "stop" and structured["message"]["reasoning_content"]
    jsonschema.validate(json.loads(structured["message"]["content"]), SCHEMA)


def test_enable_thinking_false_changes_the_prompt_and_bad_kwargs_are_400s(api):
    on, off = chat(api), chat(api, chat_template_kwargs={"enable_thinking": False})
    closed = len(api.clients["think"].worker.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert off["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"] + closed
    plain_off = chat(api, "plain", chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert off["choices"][0]["message"]["reasoning_content"] is None  # the prompt closed the thinking
    assert off["choices"][0]["message"]["content"] == plain_off["content"]
    for bad in ({"tokenize": True}, {"add_generation_prompt": False}, {"bos_token": "x"}, {"x": {"nested": 1}},
                {"x": [1]}, [1], "enable_thinking"):
        error = chat(api, chat_template_kwargs=bad, status=400)
        assert set(error) == {"error"} and error["error"]["param"] in ("chat_template_kwargs", "body.chat_template_kwargs"), bad
    assert chat(api, thinking_token_budget=-1, status=400)["error"]["type"] == "invalid_request_error"


# ---- Ray Serve, the OpenAI SDK ----------------------------------------------------------------
APP, ROUTE = "attnserve-reasoning", "/reasoning"


@pytest.fixture(scope="module")
def sdk(ray_session, checkpoints):
    from ray import serve

    from server.deployment import build_app
    from server.serve_config import ServeConfig

    cfg = ServeConfig(models={"think": str(checkpoints["qwen3"])}, num_cpus=0.25,
                      engine=EngineConfig(dtype="float32", kv_cache_memory=None, num_blocks=64, block_size=4,
                                          max_model_len=256, num_threads=1, enforce_eager=True,
                                          reasoning_parser="auto"))
    serve.run(build_app(cfg), name=APP, route_prefix=ROUTE)
    yield openai.OpenAI(base_url=f"{ray_session}{ROUTE}/v1", api_key="unused", max_retries=0, timeout=120)
    serve.delete(APP)


def test_openai_sdk_over_ray_serve_gets_reasoning_content(sdk, api):
    ask = dict(model="think", messages=ASK, max_tokens=16, temperature=0, extra_body={"thinking_token_budget": 3})
    message = sdk.chat.completions.create(**ask).choices[0].message
    assert message.model_extra["reasoning_content"] == message.reasoning_content and message.reasoning_content
    local = chat(api, thinking_token_budget=3)["choices"][0]["message"]
    assert (message.reasoning_content, message.content) == (local["reasoning_content"], local["content"])
    reasoning, content = "", ""
    for event in sdk.chat.completions.create(**ask, stream=True):
        if event.choices:
            reasoning += (event.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            content += event.choices[0].delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)
    assert [m.model_extra["reasoning_parser"] for m in sdk.models.list().data] == ["qwen3"]
