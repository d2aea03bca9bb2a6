"""Structured outputs and tool calling through the real stack: Ray Serve serving the default
model, the official OpenAI SDK (`beta.chat.completions.parse`, `tools`, streaming assembled by the
SDK), vLLM's `structured_outputs`, 400s that name the field, the metrics, and answers that finish
(numbers bounded, a repeated tool call ends the answer)."""
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from pydantic import BaseModel, Field, create_model

from tests.test_observability_e2e import scrape, total

APP, ROUTE, MODEL = "attnserve-structured", "/structured", "smol"


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=30)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


WEATHER_TOOL = openai.pydantic_function_tool(GetWeather, name="get_weather")
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone", "strict": True,
                                              "parameters": {"type": "object", "properties": {
                                                  "timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
                                                  "required": ["timezone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def url(ray_session, default_model_dir):
    from ray import serve

    from server.deployment import build_app
    from server.engine.config import EngineConfig
    from server.serve_config import ServeConfig

    cfg = ServeConfig(models={MODEL: str(default_model_dir)}, num_cpus=0.25,
                      engine=EngineConfig(kv_cache_memory=None, num_blocks=512, max_model_len=2048, num_threads=1))
    serve.run(build_app(cfg), name=APP, route_prefix=ROUTE)
    yield f"{ray_session}{ROUTE}"
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def used_blocks() -> int:
    from ray import serve

    return serve.get_deployment_handle(f"model-{MODEL}", app_name=APP).stats.remote().result()["num_used_blocks"]


def test_parse_with_a_pydantic_model(client):
    completion = client.beta.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person called Ann."}], response_format=Person,
        temperature=0, max_tokens=200)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person) and message.parsed.model_dump() == json.loads(message.content)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_match_the_function_schema(client, stream, tool_choice):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice, temperature=0,
              max_tokens=300)
    if stream:  # the SDK assembles the streamed delta.tool_calls
        with client.beta.chat.completions.stream(**kw) as events:
            completion = events.get_final_completion()
    else:
        completion = client.beta.chat.completions.parse(**kw)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert isinstance(call.function.parsed_arguments, GetWeather)
            assert GetWeather.model_validate(arguments) == call.function.parsed_arguments
        else:
            assert call.function.name == "get_time" and re.fullmatch("[A-Z][a-z]+/[A-Z][a-z]+", arguments["timezone"])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


def test_raw_stream_sends_openai_shaped_tool_call_deltas(url):
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": 300,
            "stream": True, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    calls = [c for e in events for ch in e["choices"] for c in ch["delta"].get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all(c["index"] == 0 and "id" not in c for c in calls[1:]) and len(calls) > 2  # arguments as they come
    assert GetWeather.model_validate_json("".join(c["function"]["arguments"] for c in calls))
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_tool_choice_answers_in_text_or_in_valid_calls(client):
    """The model decides: whichever it does, the answer is OpenAI-shaped (content, or calls of a
    given tool whose arguments are JSON) and no <tool_call> tag leaks into content."""
    completion = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL],
                                                temperature=0, max_tokens=120)
    choice = completion.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)
    else:
        assert "<tool_call>" not in (choice.message.content or "") or choice.finish_reason == "length"


def test_history_with_tool_calls_and_results_renders(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    completion = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0,
                                                max_tokens=40, tool_choice="none")
    assert completion.choices[0].message.content and not completion.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, value, check", [
    ("regex", r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)", lambda t: re.fullmatch(r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)", t)),
    ("choice", ["Paris", "London", "Berlin"], lambda t: t in ("Paris", "London", "Berlin")),
    ("grammar", 'root ::= "The capital is " [A-Z] [a-z]+ "."', lambda t: re.fullmatch(r"The capital is [A-Z][a-z]+\.", t)),
    ("json", {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"]}, lambda t: len(json.loads(t)["capital"]) <= 20),
])
def test_vllm_structured_outputs(client, field, value, check, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0,
              max_tokens=60, extra_body={"structured_outputs": {field: value}})
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content
    assert check(text), text


def test_completions_take_response_format_and_structured_outputs(client):
    text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=40, temperature=0,
                                     extra_body={"response_format": {"type": "json_object"}}).choices[0].text
    assert isinstance(json.loads(text), dict)
    text = client.completions.create(model=MODEL, prompt="Yes or no?", max_tokens=5, temperature=0.9,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0].text
    assert text in ("yes", "no")


@pytest.mark.parametrize("body, param, text", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "Unsupported type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs", "not defined"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools", "cannot be compiled"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, None, "exactly one"),
])
def test_bad_input_is_a_400_naming_the_field_and_holds_no_block(url, body, param, text):
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 8, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert text in error["message"] and (param is None or error["param"] == param)
    assert used_blocks() == 0


def test_metrics_count_structured_requests_and_time_their_grammars(url, client):
    time.sleep(2.5)  # NOTE: replicas push metrics every second: earlier tests' requests land first
    before = scrape(url)
    for _ in range(2):  # a miss, then a hit
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"regex": "[A-Z][a-z]{2,6} metrics"}})
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20)
    for _ in range(30):  # until both have been reported
        after = scrape(url)
        grown = lambda name, **labels: total(after, name, **labels) - total(before, name, **labels)  # noqa: E731
        if grown("attnserve_grammar_compile_seconds_count", model=MODEL) >= 2:
            break
        time.sleep(0.5)
    assert grown("attnserve_structured_requests_total", model=MODEL, kind="regex") == 2
    assert grown("attnserve_grammar_compile_seconds_count", model=MODEL, cache="miss") == 1
    assert grown("attnserve_grammar_compile_seconds_count", model=MODEL, cache="hit") == 1
    assert grown("attnserve_grammar_compile_seconds_sum", model=MODEL) > 0


def schema_model(model_name: str, /, **fields) -> type[BaseModel]:
    """A pydantic model: `field=type` or `field=(type, Field(...))`."""
    return create_model(model_name, **{k: v if isinstance(v, tuple) else (v, ...) for k, v in fields.items()})


# float and int fields, most without bounds (what a plain pydantic `float` / `int` gives), each asked
# about a country: with JSON's own number grammar the default model answered about a third of these
# with digits until max_tokens (`"population_millions": 1000000000...`)
NUMBER_MODELS = [
    (schema_model("Country", name=str, capital=str, population_millions=float), "France"),
    (schema_model("Planet", name=str, mass_kg=float, radius_km=float, moons=int), "Japan"),
    (schema_model("Product", title=(str, Field(max_length=40)), price=(float, Field(ge=0)), stock=(int, Field(ge=0))),
     "Japan"),
    (schema_model("Reading", celsius=float, humidity_percent=(float, Field(ge=0, le=100))),
     "France"),
    (schema_model("Point", x=float, y=float, z=float), "Japan"),
    (schema_model("Score", player=(str, Field(max_length=20)), points=int, accuracy=(float, Field(ge=0, le=1))),
     "Brazil"),
    (schema_model("Account", balance=float, transactions=(int, Field(ge=0))), "Japan"),
    (schema_model("Recipe", dish=(str, Field(max_length=40)), servings=(int, Field(ge=1, le=20)), calories=float),
     "Brazil"),
    (schema_model("Car", model=(str, Field(max_length=30)), year=(int, Field(ge=1900, le=2030)), top_speed_kmh=float),
     "Canada"),
    (schema_model("Stock", ticker=(str, Field(max_length=6)), price=float, volume=int), "Canada"),
    (schema_model("Atom", element=(str, Field(max_length=20)), atomic_number=int, atomic_mass=float),
     "Canada"),
    (schema_model("Mountain", name=(str, Field(max_length=30)), height_m=(float, Field(gt=0))), "France"),
    (schema_model("Invoice", number=int, total=float, tax_rate=float), "Canada"),
    (schema_model("Runner", name=(str, Field(max_length=30)), time_seconds=float, rank=(int, Field(ge=1))),
     "Japan"),
    (schema_model("Star", name=(str, Field(max_length=30)), distance_light_years=float, magnitude=float),
     "Brazil"),
    (schema_model("Team", name=(str, Field(max_length=30)), wins=int, losses=int, win_ratio=float),
     "Canada"),
    (schema_model("Loan", principal=(float, Field(gt=0)), rate_percent=float, months=(int, Field(ge=1, le=480))),
     "France"),
    (schema_model("Location", latitude=(float, Field(ge=-90, le=90)), longitude=(float, Field(ge=-180, le=180)),
                  elevation_m=float), "Japan"),
    (schema_model("Book", title=(str, Field(max_length=40)), pages=int, price=float), "Japan"),
    (schema_model("Measurement", values=(list[float], Field(max_length=5)), count=int), "France"),
]


def test_numbers_end_for_twenty_pydantic_models(client):
    """Every answer parses and ends with `stop` (before numbers were bounded, a plain `float` field
    could fill max_tokens with digits and the SDK raised LengthFinishReasonError). Sent at once: the
    engine batches them."""
    def ask(job):
        (model, subject), temperature = job
        messages = [{"role": "user", "content": f"Tell me about {subject}."}]
        completion = client.beta.chat.completions.parse(model=MODEL, messages=messages, response_format=model,
                                                        temperature=temperature, seed=0, max_tokens=300)
        return model, completion.choices[0]

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, [(m, t) for m in NUMBER_MODELS for t in (0, 0.8)]))
    for model, choice in answers:
        assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, model)
        assert choice.message.parsed.model_dump() == json.loads(choice.message.content)


def test_a_repeated_tool_call_ends_the_answer_streamed_and_not(client):
    """The default model answers this, at temperature 0, with a call (two, where prompt tokens take the int8
    kernel) and then the same call again and again: the answer ends at the first repeat, long before
    max_tokens, with the unique calls, and frees its blocks."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris and London, and the time in Tokyo?"}],
              tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", temperature=0, max_tokens=400)
    response = client.chat.completions.create(**kw)
    whole = response.choices[0]
    with client.beta.chat.completions.stream(**kw) as events:
        streamed = events.get_final_completion().choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == calls
    assert whole.finish_reason == streamed.finish_reason == "tool_calls" and len(set(calls)) == len(calls) >= 1
    assert 0 < response.usage.completion_tokens < 200
    assert not whole.message.content and not streamed.message.content
    for _ in range(100):  # the engine reports the aborted request's blocks freed with its next stats
        if used_blocks() == 0:
            break
        time.sleep(0.05)
    assert used_blocks() == 0
