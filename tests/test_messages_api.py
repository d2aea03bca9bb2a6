"""The Anthropic Messages API (`/v1/messages`) as the official `anthropic` SDK calls it: in-process over
ASGI on a tiny checkpoint, and once end to end through real Ray Serve over real HTTP."""
import asyncio
import json
import shutil

import anthropic
import httpx2
import pytest
from anthropic.lib.streaming._messages import accumulate_event

from server.engine import EngineConfig
from server.http_app import create_app
from server.messages_api import MessageBuilder, chat_request
from server.messages_protocol import MessagesRequest
from server.model_client import LocalModelClient
from server.openai_api import ApiLimits, OpenAIApi
from server.worker import ModelWorker
from tests.tiny import make_thinking_checkpoint

KEY = "sesame"
GREEDY = {"temperature": 0}  # the SDK sends sampling fields as extra_body
USER = [{"role": "user", "content": "The capital of France is"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def worker(tiny_checkpoints, tmp_path_factory):
    # NOTE: the tiny Llama with a longer context: the Hermes tool prompt alone is ~570 of its tokens
    path = tmp_path_factory.mktemp("messages") / "llama"
    shutil.copytree(tiny_checkpoints["llama"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    worker = ModelWorker("tiny", EngineConfig(model=str(path), dtype="float32", num_blocks=512, block_size=4,
                                              max_model_len=1024, enforce_eager=True))
    yield worker
    worker.shutdown()


@pytest.fixture(scope="module")
def api(worker):
    return OpenAIApi({"tiny": LocalModelClient(worker)}, ApiLimits(max_tokens=200, max_body_bytes=64 * 1024))


@pytest.fixture(scope="module")
def app(api):
    return create_app(api)


def run(app, test, api_key: str = "unused"):
    """`test(client, http)`: the SDK client and a raw client, both over ASGI."""
    async def go():
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://t") as http:
            client = anthropic.AsyncAnthropic(base_url="http://t", api_key=api_key, http_client=http, max_retries=0)
            return await test(client, http)
    return asyncio.run(go())


async def streamed(client, **kw):
    """(event types, the SDK's final message) of a `messages.stream` call."""
    async with client.messages.stream(**kw) as stream:
        types = [event.type async for event in stream]
        return types, await stream.get_final_message()


def blocks(message) -> list[dict]:
    return [b.model_dump(exclude_none=True, exclude={"parsed_output"}) for b in message.content]


def test_text_message_and_its_stream_agree(app):
    kw = dict(model="tiny", max_tokens=12, messages=USER, extra_body=GREEDY)

    async def test(client, http):
        whole = await client.messages.create(**kw)
        types, final = await streamed(client, **kw)
        count = await client.messages.count_tokens(model="tiny", messages=USER)
        chat = (await http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 12,
                                                              **GREEDY})).json()
        return whole, types, final, count, chat

    whole, types, final, count, chat = run(app, test)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == "tiny" and whole.stop_sequence is None
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.content[0].text == chat["choices"][0]["message"]["content"]  # the chat answer, translated
    assert whole.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
    assert whole.usage.input_tokens == count.input_tokens == chat["usage"]["prompt_tokens"]
    assert whole.usage.output_tokens == chat["usage"]["completion_tokens"]
    # the stream: the same answer, in Anthropic's event order
    assert blocks(final) == blocks(whole) and final.stop_reason == whole.stop_reason
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)
    assert types[:2] == ["message_start", "content_block_start"] and types[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta", "text"}  # the SDK adds a `text` event per text delta


def test_system_prompt_reaches_the_template(app):
    system = "You answer in one word."

    async def test(client, http):
        message = await client.messages.create(model="tiny", max_tokens=4, system=system, messages=USER,
                                               extra_body=GREEDY)
        as_blocks = await client.messages.count_tokens(model="tiny", messages=USER,
                                                       system=[{"type": "text", "text": system}])
        chat = await http.post("/tokenize", json={"model": "tiny", "messages": [
            {"role": "system", "content": system}, *USER]})
        plain = await client.messages.count_tokens(model="tiny", messages=USER)
        return message, as_blocks, chat.json(), plain

    message, as_blocks, chat, plain = run(app, test)
    assert message.usage.input_tokens == as_blocks.input_tokens == chat["count"] > plain.input_tokens


def test_tool_use_then_tool_result_round_trip(app):
    kw = dict(model="tiny", max_tokens=40, messages=USER, tools=[WEATHER], extra_body=GREEDY,
              tool_choice={"type": "tool", "name": "get_weather"})

    async def test(client, http):
        call = await client.messages.create(**kw)
        types, final = await streamed(client, **kw)
        history = [*USER, {"role": "assistant", "content": call.content},  # the SDK's blocks, sent back
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.content[0].id,
                                                 "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
        answer = await client.messages.create(model="tiny", max_tokens=8, messages=history, tools=[WEATHER],
                                              extra_body=GREEDY)
        count = await client.messages.count_tokens(model="tiny", messages=history, tools=[WEATHER])
        openai_history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
        tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                   "parameters": WEATHER["input_schema"]}}]
        chat = await http.post("/tokenize", json={"model": "tiny", "messages": openai_history, "tools": tools})
        return call, types, final, answer, count, chat.json()

    call, types, final, answer, count, chat = run(app, test)
    assert call.stop_reason == "tool_use" and len(call.content) == 1
    use = call.content[0]
    assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input == {"city": "Paris"}
    # streamed: the same block, its input as input_json_delta pieces the SDK joins
    assert [b["type"] for b in blocks(final)] == ["tool_use"] and final.content[0].input == use.input
    assert final.stop_reason == "tool_use" and "input_json" in types
    # the second turn: the call and its result are in the prompt, as the OpenAI form of that history renders
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.usage.input_tokens == count.input_tokens
    assert count.input_tokens == chat["count"] > call.usage.input_tokens


def test_any_tool_call_and_count_tokens_with_tools(app):
    async def test(client, http):
        call = await client.messages.create(model="tiny", max_tokens=100, messages=USER, tools=[WEATHER],
                                            tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                            extra_body=GREEDY)
        with_tools = await client.messages.count_tokens(model="tiny", messages=USER, tools=[WEATHER])
        no_choice = await client.messages.count_tokens(model="tiny", messages=USER, tools=[WEATHER],
                                                       tool_choice={"type": "none"})
        plain = await client.messages.count_tokens(model="tiny", messages=USER)
        return call, with_tools, no_choice, plain

    call, with_tools, no_choice, plain = run(app, test)
    assert call.usage.input_tokens == with_tools.input_tokens > no_choice.input_tokens == plain.input_tokens
    assert call.stop_reason == "tool_use" and call.usage.output_tokens < 100  # the call's JSON array closed
    assert [(b.type, b.name, b.input) for b in call.content] == [("tool_use", "get_weather", {"city": "Paris"})]


def test_stop_sequences(app):
    kw = dict(model="tiny", max_tokens=24, messages=USER, extra_body={**GREEDY, "ignore_eos": True})

    async def test(client, http):
        free = await client.messages.create(**kw)
        text = free.content[0].text
        at = next(i for i in range(2, len(text) - 1) if text[i:i + 2].isalnum())
        stop = text[at:at + 2]
        stopped = await client.messages.create(**kw, stop_sequences=["no such text", stop])
        _, final = await streamed(client, **kw, stop_sequences=["no such text", stop])
        return text, stop, free, stopped, final

    with pytest.raises(anthropic.BadRequestError):  # ignore_eos is not Anthropic's
        run(app, lambda client, http: client.messages.create(**kw))
    kw["extra_body"] = GREEDY
    text, stop, free, stopped, final = run(app, test)
    assert free.stop_sequence is None
    assert stopped.content[0].text == text[:text.find(stop)]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert blocks(final) == blocks(stopped) and (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def anthropic_error(resp, status: int, type_: str, contains: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == type_, body
    if contains is not None:
        assert contains in body["error"]["message"], body


BODY = {"model": "tiny", "max_tokens": 4, "messages": USER}


@pytest.mark.parametrize("patch,contains", [
    ({"temperatur": 0.5}, "temperatur"),  # unknown field
    ({"max_tokens": None}, "max_tokens"),  # missing
    ({"max_tokens": 100000}, "max_tokens"),  # over the server's limit
    ({"temperature": 1.5}, "temperature"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"messages": [*USER, {"role": "assistant", "content": "Paris"}]}, "prefill"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "y"}]},
                   *USER]}, "tool_result"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "budget_tokens"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
])
def test_bad_requests_are_anthropic_400s(app, patch, contains):
    body = {k: v for k, v in {**BODY, **patch}.items() if v is not None}
    anthropic_error(run(app, lambda client, http: http.post("/v1/messages", json=body)), 400,
                    "invalid_request_error", contains)


def test_not_found_and_other_errors(app):
    async def test(client, http):
        with pytest.raises(anthropic.NotFoundError) as e:
            await client.messages.create(model="nope", max_tokens=4, messages=USER)
        assert e.value.body == {"type": "error", "error": {"type": "not_found_error", "message": e.value.body[
            "error"]["message"]}} and "nope" in e.value.body["error"]["message"]
        return [await http.post("/v1/messages", json={**BODY, "model": "nope"}),
                await http.post("/v1/messages/count_tokens", json={"model": "nope", "messages": USER}),
                await http.post("/v1/messages/nope", json=BODY),
                await http.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"}),
                await http.post("/v1/chat/completions", json={**BODY, "model": "nope"})]

    model, count, route, bad_json, chat = run(app, test)
    anthropic_error(model, 404, "not_found_error", "does not exist")
    anthropic_error(count, 404, "not_found_error")
    anthropic_error(route, 404, "not_found_error")
    anthropic_error(bad_json, 400, "invalid_request_error")
    assert chat.status_code == 404 and set(chat.json()["error"]) == {"message", "type", "param", "code"}  # OpenAI's


def test_api_key_as_x_api_key_or_bearer(api):
    app = create_app(api, api_key=KEY)

    async def test(client, http):
        message = await client.messages.create(model="tiny", max_tokens=2, messages=USER)
        models = await http.get("/v1/models", headers={"x-api-key": KEY})
        bearer = await http.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
        bad = await http.post("/v1/messages", json=BODY, headers={"x-api-key": "wrong"})
        none = await http.post("/v1/messages", json=BODY)
        chat = await http.post("/v1/chat/completions", json=BODY, headers={"x-api-key": "wrong"})
        return message, models, bearer, bad, none, chat

    message, models, bearer, bad, none, chat = run(app, test, api_key=KEY)
    assert message.usage.output_tokens > 0
    assert models.status_code == bearer.status_code == 200
    anthropic_error(bad, 401, "authentication_error")
    anthropic_error(none, 401, "authentication_error")
    assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape there

    with pytest.raises(anthropic.AuthenticationError):
        run(app, lambda client, http: client.messages.create(model="tiny", max_tokens=2, messages=USER),
            api_key="wrong")


async def drop_after_first_delta(app, body: dict) -> bytes:
    """A streamed request whose client goes away after the first delta (raw ASGI: httpx's ASGI transport
    reads a response whole, so it cannot drop one)."""
    gone, requested, received = asyncio.Event(), [], []

    async def receive():
        if not requested:
            requested.append(True)
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        received.append(message.get("body", b""))
        if b"content_block_delta" in message.get("body", b""):
            gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/messages", "raw_path": b"/v1/messages",
             "root_path": "", "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("t", 80)}
    await app(scope, receive, send)
    return b"".join(received)


def test_bad_inputs_and_dropped_streams_hold_no_kv_block(app, api, worker):
    aborted = worker.snapshot().finish_reasons.get("abort", 0)

    async def test(client, http):
        for body in ({**BODY, "max_tokens": 100000}, {**BODY, "messages": [{"role": "user", "content": "x" * 5000}]},
                     {**BODY, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}):
            assert (await http.post("/v1/messages", json=body)).status_code == 400
        # NOTE: greedy: sampled, the tiny model may end on its EOS (stop) before the drop reaches the engine
        cut = await drop_after_first_delta(app, {**BODY, "max_tokens": 150, "stream": True, "temperature": 0})
        assert b"event: content_block_delta" in cut and b"message_stop" not in cut
        for _ in range(200):
            stats = worker.stats()
            if stats["num_used_blocks"] == 0 and stats["num_unfinished_groups"] == 0 and api.num_streams == 0:
                return stats
            await asyncio.sleep(0.05)
        return worker.stats()

    with pytest.raises(anthropic.BadRequestError):
        run(app, lambda client, http: client.messages.create(model="tiny", max_tokens=2, messages=USER,
                                                             extra_body={"ignore_eos": True}))
    stats = run(app, test)
    assert stats["num_used_blocks"] == 0 and stats["num_unfinished_groups"] == 0 and api.num_streams == 0
    assert worker.snapshot().finish_reasons.get("abort", 0) == aborted + 1  # the dropped stream's generation


def test_a_failed_step_is_an_api_error(app, worker):
    """A generation that fails in the engine: the whole answer is a 500 `api_error`, the stream ends
    with an `error` event (the SDK raises it)."""
    async def test(client, http):
        worker.inject_step_failures(1)
        whole = await http.post("/v1/messages", json=BODY)
        worker.inject_step_failures(1)
        with pytest.raises(anthropic.APIStatusError) as e:
            await streamed(client, **BODY)
        return whole, e.value

    whole, error = run(app, test)
    anthropic_error(whole, 500, "api_error", "injected")
    assert error.body["type"] == "error" and error.body["error"]["type"] == "api_error", error.body


@pytest.fixture(scope="module")
def thinking_app(tmp_path_factory):
    """A tiny Qwen3-style reasoning model (tests/tiny.py: greedy decoding opens and closes a thinking)."""
    path = make_thinking_checkpoint(tmp_path_factory.mktemp("messages-thinking") / "qwen3", r1=False)
    worker = ModelWorker("think", EngineConfig(model=str(path), dtype="float32", num_blocks=128, block_size=4,
                                               max_model_len=256, enforce_eager=True, reasoning_parser="auto"))
    yield create_app(OpenAIApi({"think": LocalModelClient(worker)}, ApiLimits(max_tokens=200)))
    worker.shutdown()


def test_a_reasoning_models_thinking_is_a_thinking_block(thinking_app):
    ask = [{"role": "user", "content": "hello world"}]  # the prompt the checkpoint was made to think on
    kw = dict(model="think", max_tokens=16, messages=ask, extra_body=GREEDY)

    async def test(client, http):
        whole = await client.messages.create(**kw)
        types, final = await streamed(client, **kw)
        off = await client.messages.create(**kw, thinking={"type": "disabled"})
        counts = [(await client.messages.count_tokens(model="think", messages=ask, **t)).input_tokens
                  for t in ({}, {"thinking": {"type": "disabled"}})]
        return whole, types, final, off, counts

    whole, types, final, off, counts = run(thinking_app, test)
    assert [b.type for b in whole.content][:1] == ["thinking"] and whole.content[0].thinking
    assert whole.content[0].signature == "" and "<think>" not in whole.content[0].thinking
    assert blocks(final) == blocks(whole) and "thinking" in types  # the SDK's event per thinking_delta
    # thinking disabled: the template closes the thinking in the prompt, and the answer has none
    assert "thinking" not in [b.type for b in off.content]
    assert (whole.usage.input_tokens, off.usage.input_tokens) == tuple(counts) and counts[1] > counts[0]


def test_thinking_and_tool_blocks_stream_as_the_whole_message():
    """Chat chunks of a reasoning model's answer (reasoning_content, then text, then a call) -> events
    the SDK's own accumulator turns into exactly the whole message."""
    chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"choices": [{"delta": {"reasoning_content": "Paris is "}, "finish_reason": None}]},
              {"choices": [{"delta": {"reasoning_content": "the capital."}, "finish_reason": None}]},
              {"choices": [{"delta": {"content": "Let me check."}, "finish_reason": None}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_ab12", "type": "function",
                                                      "function": {"name": "get_weather", "arguments": ""}}]},
                            "finish_reason": None}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                            "finish_reason": None}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
                            "finish_reason": "tool_calls", "stop_reason": None}]},
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7}}]
    builder = MessageBuilder("m", 9)
    events = builder.start() + [e for c in chunks for e in builder.add(c)] + builder.finish()
    snapshot, bufs = None, {}
    for event in events:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    whole = builder.message()
    assert whole["content"] == [{"type": "thinking", "thinking": "Paris is the capital.", "signature": ""},
                                {"type": "text", "text": "Let me check."},
                                {"type": "tool_use", "id": "toolu_ab12", "name": "get_weather",
                                 "input": {"city": "Paris"}}]
    assert (whole["stop_reason"], whole["usage"]) == ("tool_use", {"input_tokens": 9, "output_tokens": 7})
    assert snapshot.to_dict(exclude_none=True) == {k: v for k, v in whole.items() if v is not None}
    assert [e["type"] for e in events if e["type"].startswith("content_block_")] == [
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop"]


def test_thinking_and_output_config_become_chat_fields():
    def chat(**kw):
        return chat_request(MessagesRequest.model_validate({**BODY, "max_tokens": 64, **kw}))

    assert chat(thinking={"type": "enabled", "budget_tokens": 32}).thinking_token_budget == 32
    assert chat(thinking={"type": "disabled"}).chat_template_kwargs == {"enable_thinking": False}
    adaptive = chat(thinking={"type": "adaptive"})
    assert adaptive.thinking_token_budget is None and adaptive.chat_template_kwargs is None
    assert chat(output_config={"effort": "low"}).reasoning_effort == "low"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert chat(output_config={"format": {"type": "json_schema", "schema": schema}}).response_format.json_schema.schema_ \
        == schema
    translated = chat(stop_sequences=["\n\n"], temperature=0.5, top_k=5, metadata={"user_id": "u1"},
                      tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert (translated.stop, translated.temperature, translated.top_k, translated.user) == (["\n\n"], 0.5, 5, "u1")
    assert translated.tool_choice == "auto" and translated.parallel_tool_calls is False
    assert translated.tools[0].function.parameters == WEATHER["input_schema"]


def test_messages_through_ray_serve(serve_url):
    """The one end-to-end test: the SDK over real HTTP to Serve; streamed and whole answers agree."""
    client = anthropic.Anthropic(base_url=serve_url, api_key="unused", max_retries=0, timeout=60)
    kw = dict(model="tiny-gqa", max_tokens=10, system="Be brief.", messages=USER, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    count = client.messages.count_tokens(model="tiny-gqa", system="Be brief.", messages=USER)
    assert [b.type for b in whole.content] == ["text"] and text == whole.content[0].text
    assert blocks(final) == blocks(whole) and final.stop_reason == whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens == final.usage.input_tokens == count.input_tokens
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**{**kw, "model": "nope"})
