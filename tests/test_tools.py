"""Tool calling's pure parts: the schemas decoding is held to, templating of tools and history,
and the parser that turns text (whole or in chunks of any size) into OpenAI tool_calls."""
import json

import jsonschema
import pytest

from server.tools import HERMES_SYSTEM, ToolCallParser, ToolChoice, assemble, call_schema, template_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: an empty object


def parse(choice: ToolChoice, text: str, chunk: int) -> tuple[str | None, list[dict], list[dict]]:
    parser, deltas = ToolCallParser(choice), []
    for i in range(0, len(text), chunk):
        deltas += parser.feed(text[i:i + chunk])
    deltas += parser.finish()
    return (*assemble(deltas), deltas)


def test_call_schemas():
    named = call_schema([WEATHER, NOW], ToolChoice("named", "get_weather"))
    assert named == WEATHER["function"]["parameters"]
    required = call_schema([WEATHER, NOW], ToolChoice("required"))
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}],
                        required)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = call_schema([WEATHER], ToolChoice("required", parallel=False))
    assert single["maxItems"] == 1
    assert call_schema([WEATHER], ToolChoice("auto")) is None


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_named_arguments_stream_as_they_come(chunk):
    text = '{"city": "Pa\\"ris}"}'
    content, calls, deltas = parse(ToolChoice("named", "get_weather"), text, chunk)
    assert content is None and [c["function"] for c in calls] == [{"name": "get_weather", "arguments": text}]
    first = deltas[0]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"] == {"name": "get_weather", "arguments": ""}
    assert len(deltas) == 1 + -(-len(text) // chunk)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_required_array_elements_go_out_as_each_closes(chunk):
    text = '[{"name": "get_weather", "arguments": {"city": "}]\\"{"}}, {"name": "now", "arguments": {}}]'
    content, calls, deltas = parse(ToolChoice("required"), text, chunk)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": '}]"{'}), ("now", {})]
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 1]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("chunk", [1, 2, 7, 1000])
def test_auto_reads_hermes_tags_around_content(chunk):
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    content, calls, deltas = parse(ToolChoice("auto"), text, chunk)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert not any("<tool" in d.get("content", "") for d in deltas)


@pytest.mark.parametrize("text", ["Plain answer, no calls.", "a < b and <tool_ca", "x <tool_call>{not json}</tool_call> y",
                                  "unclosed <tool_call>{\"name\": \"now\""])
def test_auto_keeps_text_that_is_no_call_as_content(text):
    for chunk in (1, 5, 1000):
        content, calls, _ = parse(ToolChoice("auto"), text, chunk)
        assert calls == [] and content == text


def test_plain_template_gets_the_hermes_prompt_and_history_as_text():
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    out, extra = template_messages(history, [WEATHER], "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert extra == {}
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n")
    assert json.dumps(WEATHER) in out[0]["content"] and HERMES_SYSTEM.split("{tools}")[0] in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                      '{"city": "Paris"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}
    no_system, _ = template_messages(history[1:2], [WEATHER], "plain")
    assert no_system[0]["role"] == "system" and no_system[1] == history[1]


def test_template_that_takes_tools_gets_them_and_arguments_as_objects():
    history = [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    out, extra = template_messages(history, [WEATHER], "{% if tools %}...{% endif %}")
    assert extra == {"tools": [WEATHER]}
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert history[0]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's copy untouched


TOOLS_TEMPLATE = (  # the shape of Qwen's and Hermes' templates: tools in the system turn, calls as JSON
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.arguments | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


@pytest.mark.parametrize("template", ["tools", "plain"])
def test_the_worker_renders_tools_through_either_kind_of_template(template):
    from server.worker import encode_prompt
    from tests.tiny import CHAT_TEMPLATE, train_tokenizer

    tok = train_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE if template == "tools" else CHAT_TEMPLATE
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c", "content": "21 C"}]
    text = tok.decode(encode_prompt(tok, "tiny", messages=history, tools=[WEATHER]))
    assert "get_weather" in text and '"city"' in text and "21 C" in text
    if template == "tools":  # the template's own rendering: arguments as an object, tools its way
        assert '<tool_call>{"city": "Paris"}</tool_call>' in text and "<tools>" not in text
    else:  # the Hermes prompt and history as text
        assert "<tools>" in text and "<tool_response>\n21 C\n</tool_response>" in text


def test_a_routing_ingress_tokenizes_the_tools_into_the_prompt():
    """With cache-aware routing the ingress tokenizes the chat; the replica takes its ids as they
    are, so the tools must be in them (a routed app once dropped them)."""
    import asyncio

    from server.deployment import RayModelClient
    from server.engine.sampling_params import SamplingParams
    from server.wire import GenerateCall
    from server.worker import encode_prompt
    from tests.tiny import train_tokenizer

    class Info:
        block_size = 4

    class Method:
        async def remote(self):
            return Info()

    class Handle:
        info = Method()

        def options(self, **_):
            return self

    tok = train_tokenizer()
    messages = ({"role": "user", "content": "Weather?"},)
    client = RayModelClient(Handle(), tok, "tiny")
    call = GenerateCall(SamplingParams(), messages=messages, tools=(WEATHER,))
    routed = asyncio.run(client._routable(call))
    assert list(routed.prompt_token_ids) == encode_prompt(tok, "tiny", messages=messages, tools=[WEATHER])
    assert len(routed.prompt_token_ids) > len(encode_prompt(tok, "tiny", messages=messages))
    assert routed.tools is None and routed.messages is None and routed.block_hashes


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_streamed_and_whole_answers_agree_on_tool_calls(finish):
    """One ChoiceBuilder serves both paths: the non-streamed choice carries the calls the streamed
    deltas carried, also when max_tokens cut the answer after them (it finishes `length` then)."""
    from server.api_response import ChoiceBuilder
    from server.wire import Chunk

    text = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arg')  # the second call cut off
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    chunks = [Chunk(0, p, (1,), finish_reason=finish if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    builder = ChoiceBuilder(0, chat=True, tools=ToolChoice("auto"))
    events = [e for c in chunks for e in builder.add(c)]
    streamed_content, streamed_calls = assemble([e["delta"] for e in events])
    whole = builder.whole()
    assert [c["function"]["name"] for c in streamed_calls] == ["get_weather"]
    assert whole["message"]["tool_calls"] == streamed_calls and whole["message"]["content"] == streamed_content
    assert whole["finish_reason"] == events[-1]["finish_reason"] == ("tool_calls" if finish == "stop" else "length")
