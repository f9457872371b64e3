"""Tool calling: the parsers, and through `metroserve serve` with langchain-openai and the openai
client: required and named tool_choice enforced by the grammar, auto parsed by the hermes parser,
streamed and not, and a tool-call -> tool-result -> answer round trip through the chat template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from metroserve.services.tool_calls import ToolRequestError, parse_tool_request
from tests.stack import ServeStack

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
TIME_PARAMS = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}},
               "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
# A Hermes-style template (ChatML with a tools block, <tool_call> turns and tool responses).
TEMPLATE = """{%- if tools %}<|im_start|>system
You can call these tools:
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": \
{{ c.function.arguments }}}</tool_call>{% endfor %}{% elif m.role == 'tool' %}<tool_response>{{ m.content }}\
</tool_response>{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


# -- the parsers (no server) ----------------------------------------------------------------------


def test_hermes_parser():
    request = parse_tool_request({"tools": TOOLS}, "hermes")
    assert request is not None
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"timezone": "CET"}}</tool_call>')
    content, calls = request.parse(text)
    assert content == "Let me check. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"timezone": "CET"})]
    assert request.parse("No tools needed.") == ("No tools needed.", [])
    assert request.parse("<tool_call>not json</tool_call>")[1] == []
    assert request.may_start_call("Sure <tool_") == len("Sure ")  # a possible tag start is held back
    single = parse_tool_request({"tools": TOOLS, "parallel_tool_calls": False}, "hermes")
    assert single is not None and len(single.parse(text)[1]) == 1


def test_llama3_json_parser():
    request = parse_tool_request({"tools": TOOLS}, "llama3_json")
    assert request is not None
    content, calls = request.parse('<|python_tag|>{"name": "get_time", "parameters": {"timezone": "UTC"}}; '
                                   '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}')
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[0].arguments) == {"timezone": "UTC"}
    assert request.parse("Hello there") == ("Hello there", [])
    assert request.may_start_call('{"na') == 0 and request.may_start_call("Hi") == 2


@pytest.mark.parametrize("parser, mode", [("hermes", "auto"), ("llama3_json", "auto"), ("hermes", "required")])
def test_output_nested_past_the_parsers_limit_is_content(parser, mode):
    """A model may write brackets deeper than Python's json parser recurses: that text is content,
    not a call, and not a crash."""
    request = parse_tool_request({"tools": TOOLS, "tool_choice": mode}, parser)
    assert request is not None
    deep = '{"name": "get_time", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}"
    text = {"hermes": f"<tool_call>{deep}</tool_call>", "llama3_json": deep}[parser] if mode == "auto" else f"[{deep}]"
    assert request.parse(text) == (text, [])


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS}, "tool_choice"),  # auto without a parser
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}], "tool_choice": "auto"}, "tools"),
])
def test_bad_tool_requests_name_the_field(body, param):
    with pytest.raises(ToolRequestError) as err:
        parse_tool_request(body, "hermes" if body.get("tool_choice") == "auto" else None)
    assert err.value.param == param


# -- through the server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(smollm2_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve")
    (directory / "template.jinja").write_text(TEMPLATE)
    with ServeStack(smollm2_dir, workers=1, extra_args=["--tool-call-parser", "hermes", "--chat-template",
                                                        str(directory / "template.jinja")],
                    log_path=directory / "serve.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)


def _validate(call) -> None:
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.service
def test_langchain_bind_tools_required(stack):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city; unit is celsius or fahrenheit."""
        return f"18 degrees {unit} in {city}"

    from pydantic import SecretStr

    llm = ChatOpenAI(base_url=stack.base_url, api_key=SecretStr("unused"), model="", temperature=0,
                     max_completion_tokens=64)
    reply = llm.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    schema = get_weather.tool_call_schema
    assert isinstance(schema, type) and hasattr(schema, "model_json_schema")
    jsonschema.validate(reply.tool_calls[0]["args"], schema.model_json_schema())


@pytest.mark.service
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_are_valid(client, stream, tool_choice):
    kwargs = {"model": "", "messages": [{"role": "user", "content": "What time is it in Tokyo?"}], "tools": TOOLS,
              "tool_choice": tool_choice, "max_tokens": 96, "temperature": 0.7, "n": 2}
    if not stream:
        out = client.chat.completions.create(**kwargs)
        choices = [(c.message.tool_calls, c.finish_reason) for c in out.choices]
    else:
        calls: dict[int, list] = {0: [], 1: []}
        finish: dict[int, str] = {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                calls[c.index] += c.delta.tool_calls or []
                finish[c.index] = c.finish_reason or finish.get(c.index, "")
        choices = [(calls[i], finish[i]) for i in (0, 1)]
    for tool_calls, reason in choices:
        assert tool_calls and reason == "tool_calls"
        for call in tool_calls:
            _validate(call)
            assert call.id and call.type == "function"
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in tool_calls] == ["get_time"]


@pytest.mark.service
@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_hermes_calls(client, stream):
    """auto leaves the output free; a regex makes this small model write a Hermes call, which the parser reads."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}</tool_call>'
    kwargs = {"model": "", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
              "max_tokens": 64, "temperature": 0,
              "extra_body": {"structured_outputs": {"regex": "Checking\\. " + call.replace("{", "\\{")
                                                    .replace("}", "\\}")}}}
    if not stream:
        message = client.chat.completions.create(**kwargs).choices[0]
        content, calls, reason = message.message.content, message.message.tool_calls, message.finish_reason
    else:
        parts, calls, reason = [], [], None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                calls += c.delta.tool_calls or []
                reason = c.finish_reason or reason
        content = "".join(parts)
    assert content == "Checking. " and reason == "tool_calls"
    assert calls and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo", "unit": "celsius"}


@pytest.mark.service
def test_round_trip_through_the_chat_template(client, smollm2_dir):
    from metroserve.common.tokenizer import load_tokenizer

    question = {"role": "user", "content": "What is the weather in Oslo, in celsius?"}
    first = client.chat.completions.create(model="", messages=[question], tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=64, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    _validate(call)
    messages = [question,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "It is 18 degrees and sunny."}]
    answer = client.chat.completions.create(model="", messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=32, temperature=0, extra_body={"return_token_ids": True})
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
    prompt = load_tokenizer(smollm2_dir).decode((answer.model_extra or {})["prompt_token_ids"])
    assert "<tool_response>It is 18 degrees and sunny.</tool_response>" in prompt
    assert f'<tool_call>{{"name": "get_weather", "arguments": {call.function.arguments}}}</tool_call>' in prompt
