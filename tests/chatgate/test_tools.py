"""Tool calling through the official ``openai`` SDK against a real ``chatgate serve`` with
SmolLM2: forced calls (``required``, a named function) decode to schema-valid arguments, the
result goes back as a ``tool`` message, streamed and not; and the ``auto`` parser on its own."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from chatgate.tools import ParsedCall, may_start_call, parse_auto

pytest.importorskip("xgrammar")

MODEL = "smollm2"


class WeatherArgs(BaseModel):
    city: str
    unit: Literal["celsius", "fahrenheit"]


class TimeArgs(BaseModel):
    timezone: str


def function(name: str, description: str, args: type[BaseModel]) -> dict:
    schema = args.model_json_schema()
    schema["additionalProperties"] = False
    return {"type": "function",
            "function": {"name": name, "description": description, "parameters": schema}}


TOOLS = [function("get_weather", "Current weather in a city", WeatherArgs),
         function("get_time", "Current time in a timezone", TimeArgs)]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def test_required_call_round_trip_gives_valid_arguments_then_an_answer(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in {"get_weather", "get_time"}
    (WeatherArgs if call.function.name == "get_weather" else TimeArgs).model_validate_json(
        call.function.arguments)

    followed = ASK + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id,
                       "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    answer = client.chat.completions.create(model=MODEL, messages=followed, tools=TOOLS,
                                            tool_choice="none", temperature=0, max_tokens=40)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_streamed_required_call_arrives_as_tool_call_deltas(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            tool_choice="required", temperature=0,
                                            max_tokens=80, stream=True)
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert calls
    for entry in calls.values():
        args = WeatherArgs if entry["name"] == "get_weather" else TimeArgs
        args.model_validate_json(entry["arguments"])


def test_a_named_function_is_the_one_called(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    TimeArgs.model_validate_json(call.function.arguments)


def test_auto_lets_the_model_answer_or_call_and_streams_the_same(client):
    kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 60}
    r = client.chat.completions.create(**kw)
    message, finish = r.choices[0].message, r.choices[0].finish_reason
    assert (finish == "tool_calls") == bool(message.tool_calls)
    assert message.content or message.tool_calls

    content, names = "", []
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        names += [d.function.name for d in delta.tool_calls or []]
    assert content == (message.content or "")
    assert names == [c.function.name for c in message.tool_calls or []]


@pytest.mark.parametrize("extra,message", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in tools"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_inconsistent_tool_requests_are_refused(client, extra, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                       extra_body=extra)
    assert message in e.value.body["message"]


def test_auto_parser_takes_known_well_formed_calls_out_of_the_text():
    names = {"get_weather"}
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    content, calls = parse_auto(text, names)
    assert content == "Let me check."
    assert calls == [ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')]

    only_call = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert parse_auto(only_call, names) == (None, [ParsedCall("get_weather", "{}")])
    for not_a_call in ('<tool_call>{"name": "get_weather", "arguments": {</tool_call>',
                       '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
                       "It is sunny."):
        assert parse_auto(not_a_call, names) == (not_a_call, [])

    assert may_start_call("  <tool") and may_start_call("<tool_call>{")
    assert not may_start_call("The weather") and not may_start_call("<b>")


# A Qwen2.5-style template: renders the tools, the calls and the tool messages itself.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for t in tools %}\n"
    "{{ t | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{%- for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture(scope="module")
def tool_template_tokenizer(tmp_path_factory):
    from engine.loader import load_tokenizer

    folder = tmp_path_factory.mktemp("tool-template-tokenizer")
    tok = load_tokenizer("smollm2")
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(folder)
    return folder


def test_a_template_that_renders_tools_gets_them_and_the_calls_natively(
        tool_template_tokenizer):
    from transformers import AutoTokenizer

    from chatgate.openai_models import ChatCompletionRequest
    from engine.chat import chat_text, supports_tools
    from engine.loader import load_tokenizer

    tok = AutoTokenizer.from_pretrained(tool_template_tokenizer)
    assert supports_tools(tok) and not supports_tools(load_tokenizer("smollm2"))
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    req = ChatCompletionRequest.model_validate({
        "model": MODEL, "tools": TOOLS, "messages": ASK + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]})
    text = chat_text(tok, req.template_messages(True), req.template_tools(True))
    assert text.startswith('<|im_start|>system\n# Tools\n<tools>{"type": "function", '
                           '"function": {"name": "get_weather"')
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text
    assert "You may call one or more functions" not in text  # not the system-prompt form

    fallback = chat_text(load_tokenizer("smollm2"), req.template_messages(False), None)
    assert "You may call one or more functions" in fallback
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in fallback


def test_forced_calls_work_through_a_template_that_renders_tools(tool_template_tokenizer,
                                                                 tmp_path):
    from chatgate_testlib import Server

    server = Server(["--tokenizer", str(tool_template_tokenizer), "--max-model-len", "1024"],
                    tmp_path / "server.log").start()
    try:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                          timeout=300)
        r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                      tool_choice={"type": "function",
                                                   "function": {"name": "get_weather"}},
                                      max_tokens=60)
        (call,) = r.choices[0].message.tool_calls
        WeatherArgs.model_validate_json(call.function.arguments)
        answer = c.chat.completions.create(
            model=MODEL, tools=TOOLS, max_tokens=20, temperature=0,
            messages=ASK + [r.choices[0].message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": call.id, "content": "18 C"}])
        assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    finally:
        server.stop()
