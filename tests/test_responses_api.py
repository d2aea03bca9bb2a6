"""/v1/responses through the official `openai` SDK: in-process (a tiny model's worker behind the app,
over ASGI) for the shapes, streams, tools and the store; one Ray Serve test for a store that two
API processes share."""
import asyncio
import json
import shutil

import httpx
import openai
import pydantic
import pytest
from openai.lib._parsing._responses import type_to_text_format_param
from openai.types.responses import Response, ResponseStreamEvent

from server.engine import EngineConfig
from server.http_app import create_app
from server.model_client import LocalModelClient
from server.openai_api import ApiLimits, OpenAIApi
from server.response_store import LocalStore, ResponseStore, StoreConfig
from server.worker import ModelWorker

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}


class Verdict(pydantic.BaseModel):
    ok: bool
    mood: str = pydantic.Field(json_schema_extra={"enum": ["calm", "wild"]})


# a template that renders tools itself, compactly (the Hermes prompt is longer than the tiny model's context)
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def worker(tiny_checkpoints, tmp_path_factory):
    model = tmp_path_factory.mktemp("tools") / "llama"
    shutil.copytree(tiny_checkpoints["llama"], model)
    (model / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    # NOTE: eager: the API is the subject (as in test_api_unit)
    worker = ModelWorker("tiny", EngineConfig(model=str(model), dtype="float32", num_blocks=256,
                                              block_size=4, max_model_len=512, enforce_eager=True))
    yield worker
    worker.shutdown()


@pytest.fixture(scope="module")
def api(worker):
    return OpenAIApi({"tiny": LocalModelClient(worker)}, ApiLimits(max_n=4, max_tokens=200))


def run(app, work):
    """`work(client, http)` against `app` with the official async SDK (and plain httpx)."""
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
            return await work(client, http)
    return asyncio.run(go())


@pytest.fixture(scope="module")
def app(api):
    return create_app(api)


def chat_text(app, messages, **kw):
    async def work(client, http):
        return await client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)
    return run(app, work)


def test_text_is_the_chat_answer(app):
    async def work(client, http):
        resp = await client.responses.create(model="tiny", input="hello world", instructions="Be brief.",
                                             max_output_tokens=12, temperature=0, metadata={"k": "v"})
        raw = (await http.get(f"/v1/responses/{resp.id}")).json()
        return resp, raw
    resp, raw = run(app, work)
    Response.model_validate(raw)  # the SDK's own type, strictly
    chat = chat_text(app, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}],
                     max_tokens=12)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.metadata == {"k": "v"}
    assert [o.type for o in resp.output] == ["message"] and resp.output[0].content[0].annotations == []
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == chat.usage.total_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert resp.status == ("incomplete" if cut else "completed")
    assert (resp.incomplete_details.reason if cut else resp.incomplete_details) == ("max_output_tokens" if cut else None)
    assert raw == resp.model_dump(mode="json", exclude_unset=True)  # GET gives the stored response


def test_cut_short_is_incomplete(app):
    async def work(client, http):
        return await client.responses.create(model="tiny", input="0 1 2 3 4 5", max_output_tokens=1, temperature=0)
    resp = run(app, work)
    chat = chat_text(app, [{"role": "user", "content": "0 1 2 3 4 5"}], max_tokens=1)
    assert chat.choices[0].finish_reason == "length"  # the prompt is chosen so that greedy does not stop at once
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.usage.output_tokens == 1


def stream_events(app, text_format=openai.NOT_GIVEN, tools=openai.NOT_GIVEN, **kw):
    """The same streamed request twice: (every raw event, typed as the SDK's events; the SDK stream
    helper's final response, where it completed; the helper's events). `tools` may be the SDK's pydantic tools."""
    body = {**kw, "stream": True}
    if text_format is not openai.NOT_GIVEN:
        body["text"] = {"format": type_to_text_format_param(text_format)}
    if tools is not openai.NOT_GIVEN:
        body["tools"] = [{"type": "function", **t["function"]} if "function" in t else t for t in tools]

    async def work(client, http):
        async with http.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in r.aiter_lines()]
        raw = [EVENTS.validate_python(json.loads(line[6:])) for line in lines if line.startswith("data: ")]
        names = [line[7:] for line in lines if line.startswith("event: ")]
        assert names == [e.type for e in raw]  # each SSE event names its type
        async with client.responses.stream(**kw, text_format=text_format, tools=tools) as s:
            seen = [e async for e in s]  # NOTE: the helper checks the events' order as it accumulates them
            final = await s.get_final_response() if raw[-1].type == "response.completed" else None
        return raw, final, seen
    return run(app, work)


def test_stream_events_and_whole_answer_agree(app):
    # greedy, the tiny model stops after 82 tokens here: the SDK's stream helper needs response.completed
    body = {"model": "tiny", "input": "Readability counts.", "max_output_tokens": 100, "temperature": 0}
    raw, final, seen = stream_events(app, **body)
    types = [e.type for e in raw]
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = "".join(e.delta for e in raw if e.type == "response.output_text.delta")

    async def whole(client, http):
        return await client.responses.create(**body)
    resp = run(app, whole)
    assert deltas == resp.output_text == final.output_text == raw[-1].response.output_text
    streamed = raw[-1].response.usage  # (cached_tokens differ: the second run hits the prefix cache)
    assert (streamed.input_tokens, streamed.output_tokens) == (resp.usage.input_tokens, resp.usage.output_tokens)
    assert resp.usage.input_tokens_details.cached_tokens > 0 and raw[-1].response.status == resp.status
    assert [e.type for e in seen][-1] == raw[-1].type


def test_parse_with_a_pydantic_model(app):
    async def work(client, http):
        return await client.responses.parse(model="tiny", input="how is it?", text_format=Verdict,
                                            max_output_tokens=40)
    resp = run(app, work)
    assert resp.status == "completed", resp
    assert isinstance(resp.output_parsed, Verdict) and resp.output_parsed.mood in ("calm", "wild")
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "Verdict"
    _, final, seen = stream_events(app, model="tiny", input="how is it?", text_format=Verdict, max_output_tokens=40)
    assert isinstance(final.output_parsed, Verdict)
    assert any(e.type == "response.output_text.done" and isinstance(e.parsed, Verdict) for e in seen)


def test_json_object_format(app):
    async def work(client, http):
        return await client.responses.create(model="tiny", input="json please", max_output_tokens=60,
                                             text={"format": {"type": "json_object"}}, temperature=0)
    resp = run(app, work)
    if resp.status == "completed":
        assert isinstance(json.loads(resp.output_text), dict)
    else:  # cut short: at least a JSON object's start
        assert resp.output_text.startswith("{")


def test_function_tools_round_trip(app):
    async def work(client, http):
        first = await client.responses.create(model="tiny", input="weather in Paris?", tools=[WEATHER],
                                              tool_choice={"type": "function", "name": "get_weather"})
        call = first.output[-1]
        follow = [{"role": "user", "content": "weather in Paris?"}, *first.output,
                  {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 25 C"}]
        answer = await client.responses.create(model="tiny", input=follow, tools=[WEATHER], max_output_tokens=8,
                                               temperature=0, store=False)
        chained = await client.responses.create(model="tiny", previous_response_id=first.id, tools=[WEATHER],
                                                input=follow[-1:], max_output_tokens=8, temperature=0)
        return first, answer, chained
    first, answer, chained = run(app, work)
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome") and first.status == "completed"
    assert answer.output[-1].type == "message" and answer.usage.input_tokens > first.usage.input_tokens
    # the same conversation, given whole or continued from the stored response
    assert chained.output_text == answer.output_text and chained.usage.input_tokens == answer.usage.input_tokens
    chat = chat_text(app, [{"role": "user", "content": "weather in Paris?"},
                           {"role": "assistant", "content": None, "tool_calls": [
                               {"id": call.call_id, "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}}]},
                           {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 25 C"}],
                     tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
                     max_tokens=8)
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.output_text == (chat.choices[0].message.content or "")


def test_streamed_function_call_events(app):
    tool = openai.pydantic_function_tool(Verdict, name="judge")
    raw, final, _ = stream_events(app, model="tiny", input="judge it", tools=[tool], tool_choice="required",
                                  parallel_tool_calls=False, temperature=0, max_output_tokens=150)
    assert raw[-1].type == "response.completed"
    calls = [e.item for e in raw if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert len(calls) == 1 and [c.call_id for c in calls] == [o.call_id for o in raw[-1].response.output]
    for call in calls:  # each call's arguments: streamed pieces, then done, then the whole item
        done = [e.arguments for e in raw if e.type == "response.function_call_arguments.done" and e.item_id == call.id]
        pieces = [e.delta for e in raw if e.type == "response.function_call_arguments.delta" and e.item_id == call.id]
        assert done == ["".join(pieces)] == [call.arguments] and call.name == "judge"
    assert all(isinstance(o.parsed_arguments, Verdict) for o in final.output)  # the SDK parses strict tools'


def test_a_reasoning_models_thinking_is_a_reasoning_item(tiny_checkpoints):
    """deepseek_r1's parser: the output starts inside the thinking, and the tiny model never closes it,
    so its whole answer is reasoning: one reasoning item, cut short by max_output_tokens (as OpenAI's)."""
    worker = ModelWorker("think", EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", num_blocks=64,
                                               block_size=4, max_model_len=256, enforce_eager=True,
                                               reasoning_parser="deepseek_r1"))
    try:
        app = create_app(OpenAIApi({"think": LocalModelClient(worker)}))
        body = {"model": "think", "input": "hello world", "max_output_tokens": 8, "temperature": 0,
                "reasoning": {"effort": "low"}}

        async def whole(client, http):
            return await client.responses.create(**body)
        resp = run(app, whole)
        raw, _, _ = stream_events(app, **body)
    finally:
        worker.shutdown()
    assert [o.type for o in resp.output] == ["reasoning"] and resp.output_text == "" and resp.status == "incomplete"
    thought = resp.output[0].content[0]
    assert thought.type == "reasoning_text" and thought.text and resp.reasoning.effort == "low"
    assert "".join(e.delta for e in raw if e.type == "response.reasoning_text.delta") == thought.text
    assert [e.text for e in raw if e.type == "response.reasoning_text.done"] == [thought.text]
    assert raw[-1].type == "response.incomplete" and raw[-1].response.output[0].content[0].text == thought.text


def test_a_failed_generation_is_a_failed_response(app, worker):
    async def work(client, http):
        worker.inject_step_failures(1)  # the next model step raises, as a real failure would
        whole = await client.responses.create(model="tiny", input="hi", max_output_tokens=4)
        worker.inject_step_failures(1)
        async with http.stream("POST", "/v1/responses", json={"model": "tiny", "input": "hi", "stream": True}) as r:
            lines = [line async for line in r.aiter_lines()]
        return whole, [EVENTS.validate_python(json.loads(line[6:])) for line in lines if line.startswith("data: ")]
    whole, raw = run(app, work)
    assert whole.status == "failed" and whole.error.code == "server_error"
    assert [e.type for e in raw][-1] == "response.failed" and "injected" in raw[-1].response.error.message
    assert worker.stats()["num_used_blocks"] == 0


def test_previous_response_id_continues_the_conversation(app):
    async def work(client, http):
        first = await client.responses.create(model="tiny", input="hello world", max_output_tokens=6, temperature=0,
                                              instructions="Be brief.")
        second = await client.responses.create(model="tiny", input="and then?", previous_response_id=first.id,
                                               max_output_tokens=6, temperature=0)
        return first, second
    first, second = run(app, work)
    chat = chat_text(app, [{"role": "user", "content": "hello world"},  # instructions are not carried on
                           {"role": "assistant", "content": first.output_text},
                           {"role": "user", "content": "and then?"}], max_tokens=6)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content


def test_unknown_ids_are_404_and_delete_removes(app):
    async def work(client, http):
        errors = []
        for call in (lambda: client.responses.retrieve("resp_nope"), lambda: client.responses.delete("resp_nope"),
                     lambda: client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")):
            with pytest.raises(openai.NotFoundError) as e:
                await call()
            errors.append(e.value.body)
        kept = await client.responses.create(model="tiny", input="x", max_output_tokens=2)
        unkept = await client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
        assert (await client.responses.retrieve(kept.id)).id == kept.id
        deleted = await http.delete(f"/v1/responses/{kept.id}")
        after = [await http.get(f"/v1/responses/{i}") for i in (kept.id, unkept.id)]
        return errors, deleted.json(), after
    errors, deleted, after = run(app, work)
    assert [e["param"] for e in errors] == ["response_id", "response_id", "previous_response_id"]
    assert all(set(e) == {"message", "type", "param", "code"} for e in errors)
    assert deleted["object"] == "response.deleted" and deleted["deleted"] is True
    assert [r.status_code for r in after] == [404, 404]


def test_store_evicts_by_size_and_age():
    now = [0.0]
    store = ResponseStore(StoreConfig(max_responses=2, ttl_s=10), clock=lambda: now[0])
    for i in range(3):
        store.put(f"r{i}", {"i": i})
        now[0] += 1
    assert store.get("r0") is None and store.get("r1") == {"i": 1} and len(store) == 2  # the oldest went first
    now[0] = 11.5  # r1 stored at 1, r2 at 2
    assert store.get("r1") is None and store.get("r2") == {"i": 2}
    now[0] = 12.0
    assert len(store) == 0 and not store.delete("r2")
    with pytest.raises(ValueError):
        StoreConfig(max_responses=0)


def test_an_evicted_response_cannot_be_continued(api):
    app = create_app(api, responses_store=LocalStore(ResponseStore(StoreConfig(max_responses=1))))

    async def work(client, http):
        first = await client.responses.create(model="tiny", input="a", max_output_tokens=2)
        await client.responses.create(model="tiny", input="b", max_output_tokens=2)
        return await http.post("/v1/responses", json={"model": "tiny", "input": "c", "previous_response_id": first.id})
    resp = run(app, work)
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "previous_response_id"


BAD = [
    ({"input": "x", "frequency_penalty": 1}, "frequency_penalty"),
    ({"input": "x", "temperature": 9}, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 1000}, "max_output_tokens"),  # past the server's limit (200)
    ({"input": [{"role": "wizard", "content": "x"}]}, None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, None),
    ({"input": []}, "input"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),  # no tools
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, None),
    ({"input": "x " * 600}, "input"),  # longer than the context
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
]


@pytest.mark.parametrize("patch,param", BAD)
def test_bad_input_is_4xx_in_openai_shape_and_holds_no_kv(app, worker, patch, param):
    async def work(client, http):
        await client.responses.create(model="tiny", input="warm", max_output_tokens=1)  # stats are current
        before = worker.stats()["num_adds_received"]
        bad = [await http.post("/v1/responses", json={"model": "tiny", **patch, "stream": stream})
               for stream in (False, True)]
        good = await client.responses.create(model="tiny", input="fine", max_output_tokens=1)
        return bad, before, good
    bad, before, good = run(app, work)
    for resp in bad:
        assert resp.status_code == 400, resp.text
        body = resp.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        if param is not None:
            assert body["error"]["param"] == param, body
    stats = worker.stats()
    assert stats["num_adds_received"] == before + 1  # only the good request reached the engine
    assert stats["num_used_blocks"] == 0 and good.status in ("completed", "incomplete")


def test_unknown_model_is_404(app):
    async def work(client, http):
        return await http.post("/v1/responses", json={"model": "nope", "input": "x"})
    resp = run(app, work)
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"


async def idle(worker, timeout_s: float = 5.0) -> None:
    """Until the engine runs nothing (an abort lands a step or so after the stream closes), at most `timeout_s`."""
    for _ in range(int(timeout_s / 0.05)):
        if worker.stats()["num_running"] == 0:
            return
        await asyncio.sleep(0.05)


def test_a_client_that_goes_away_aborts_the_generation(api, worker):
    from server.responses_api import ResponsesApi
    from server.responses_protocol import ResponsesRequest

    async def work():
        responses = ResponsesApi(api, LocalStore(ResponseStore(StoreConfig())))
        events = await responses.create(ResponsesRequest(model="tiny", input="0 1 2", max_output_tokens=150,
                                                         stream=True))
        first = [await events.__anext__() for _ in range(5)]
        await events.aclose()  # as Starlette does when the client disconnects
        await idle(worker)
        return first, api.num_streams
    first, streams = asyncio.run(work())
    assert "response.created" in first[0] and streams == 0
    stats = worker.stats()
    assert stats["num_running"] == 0 and stats["num_used_blocks"] == 0


def test_a_client_gone_before_the_first_event_aborts_the_generation(api, worker):
    """The response is cancelled before its stream was ever read: an async generator never started runs
    no `finally`, so the response itself must close what holds the request (server/event_stream.py)."""
    from server.event_stream import EventStreamResponse
    from server.responses_api import ResponsesApi
    from server.responses_protocol import ResponsesRequest

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("connection reset")  # the first bytes find the client gone

    async def work():
        responses = ResponsesApi(api, LocalStore(ResponseStore(StoreConfig())))
        events = await responses.create(ResponsesRequest(model="tiny", input="0 1 2", max_output_tokens=150,
                                                         stream=True))
        held = api.num_streams
        with pytest.raises(OSError):
            await EventStreamResponse(events)({"type": "http"}, receive, send)
        await idle(worker)
        return held, api.num_streams
    held, streams = asyncio.run(work())
    assert held == 1 and streams == 0
    stats = worker.stats()
    assert stats["num_running"] == 0 and stats["num_used_blocks"] == 0


def test_stored_responses_are_shared_by_every_api_process(serve_url):
    """The Serve app's ingress and a second API process (this one, over the same model deployment)
    continue each other's responses: the store is the application's actor, not a dict per process."""
    import ray
    from ray import serve

    from server.deployment import STATE_NAMESPACE, RayModelClient, RayStore, state_name
    from tests.conftest import TINY_APP

    actor = ray.get_actor(state_name(TINY_APP), namespace=STATE_NAMESPACE)
    here = create_app(OpenAIApi({"tiny-gqa": RayModelClient(serve.get_deployment_handle("model-tiny-gqa", TINY_APP))}),
                      responses_store=RayStore(actor))
    ingress = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="x", max_retries=0)
    ask = {"model": "tiny-gqa", "max_output_tokens": 4, "temperature": 0}
    first = ingress.responses.create(input="hello world", **ask)

    async def continue_here(client, http):
        return await client.responses.create(input="and then?", previous_response_id=first.id, **ask)
    second = run(here, continue_here)
    third = ingress.responses.create(input="and now?", previous_response_id=second.id, **ask)
    assert ingress.responses.retrieve(second.id).output_text == second.output_text
    assert ray.get(actor.get.remote(third.id))["response"]["id"] == third.id  # held by the actor
    # each turn's prompt holds the one before it (the template adds the same few tokens per turn)
    assert first.usage.input_tokens < second.usage.input_tokens < third.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
