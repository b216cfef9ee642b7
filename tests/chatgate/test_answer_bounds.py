"""What bounds an answer by default, against a real ``chatgate serve``: the server's
``--max-tokens`` for requests that leave ``max_tokens`` unset (HTTP chat, text completions,
WebSocket), capped to the room the prompt leaves; the repetition guard; and the default length
bounds of a JSON schema's integers and strings."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from chatgate_testlib import Server

from chatgate.cli import build_parser, settings_from_args
from engine.json_bounds import MAX_DIGITS, MAX_ITEMS, MAX_STRING_LENGTH
from engine.repetition import MIN_SPAN

MODEL = "smollm2"
DEFAULT_MAX_TOKENS = 8
MAX_MODEL_LEN = 1024
LOOP_PROMPT = "1, 1, 1, 1, 1, 1, 1, 1,"
CHAT_LOOP_PROMPT = "Repeat after me ten times: " + LOOP_PROMPT  # greedy: it loops


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = Server(["--max-model-len", str(MAX_MODEL_LEN),
                  "--max-tokens", str(DEFAULT_MAX_TOKENS)],
                 tmp_path_factory.mktemp("logs") / "server.log")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=300)


def chat(server: Server, content: str, **body: object) -> httpx.Response:
    return post(server, "/v1/chat/completions",
                {"messages": [{"role": "user", "content": content}], **body})


async def ws_answer(server: Server, content: str, params: dict) -> dict:
    """The ``done`` (or ``error``) event of one WebSocket message."""
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps({"type": "session.create"}))
        assert json.loads(await ws.recv())["type"] == "session"
        await ws.send(json.dumps({"type": "message", "content": content, "params": params}))
        while (event := json.loads(await asyncio.wait_for(ws.recv(), 300)))["type"] == "delta":
            pass
        return event


def test_the_max_tokens_flag_takes_a_count_or_none_for_all_the_room():
    def parse(*argv: str) -> int | None:
        return settings_from_args(build_parser().parse_args(["serve", *argv])).max_tokens

    assert parse() == 256
    assert parse("--max-tokens", "100") == 100
    assert parse("--max-tokens", "0") is None and parse("--max-tokens", "none") is None


def test_models_show_the_context_window_and_the_default_max_tokens(server):
    model = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert (model["max_model_len"], model["default_max_tokens"]) == (MAX_MODEL_LEN,
                                                                      DEFAULT_MAX_TOKENS)


def test_a_chat_without_max_tokens_stops_at_the_server_default(server):
    r = chat(server, "Tell me a long story.", ignore_eos=True, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_streamed_text_completion_with_null_max_tokens_stops_at_the_server_default(server):
    r = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": None,
                                         "ignore_eos": True, "stream": True,
                                         "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_the_default_is_capped_to_the_room_the_prompt_leaves_not_refused(server):
    room = 3
    r = post(server, "/v1/completions", {"prompt": [42] * (MAX_MODEL_LEN - room),
                                         "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == room


def test_an_explicit_max_tokens_overrides_the_default(server):
    r = chat(server, "Tell me a long story.", ignore_eos=True, max_tokens=DEFAULT_MAX_TOKENS + 5)
    assert r.json()["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS + 5


def test_an_oversized_max_tokens_is_still_refused(server):
    r = chat(server, "Hi", max_tokens=MAX_MODEL_LEN)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


async def test_a_websocket_message_without_max_tokens_stops_at_the_server_default(server):
    done = await ws_answer(server, "Tell me a long story.", {"ignore_eos": True})
    assert done["type"] == "done", done
    assert done["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
    assert done["finish_reason"] == "length"
    error = await ws_answer(server, "Hi", {"max_tokens": MAX_MODEL_LEN})
    assert error["code"] == "context_length_exceeded"


def test_a_looping_answer_ends_as_length_with_the_repetition_detail(server):
    r = post(server, "/v1/completions", {"prompt": LOOP_PROMPT, "temperature": 0,
                                         "ignore_eos": True, "max_tokens": MIN_SPAN + 30})
    choice = r.json()["choices"][0]
    assert (choice["finish_reason"], choice["finish_detail"]) == ("length", "repetition")
    assert r.json()["usage"]["completion_tokens"] == MIN_SPAN


async def test_a_looping_websocket_answer_ends_with_repetition(server):
    done = await ws_answer(server, CHAT_LOOP_PROMPT, {"temperature": 0, "ignore_eos": True,
                                                 "max_tokens": MIN_SPAN + 30})
    assert done["finish_reason"] == "repetition"
    assert done["usage"]["completion_tokens"] == MIN_SPAN


def schema_answer(server: Server, content: str, schema: dict, max_tokens: int) -> dict:
    r = chat(server, content, temperature=0, max_tokens=max_tokens, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": {
            "type": "object", "properties": schema, "required": list(schema),
            "additionalProperties": False}}})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return json.loads(choice["message"]["content"])


def test_an_unbounded_integer_ends_within_its_default_digits(server):
    value = schema_answer(server, 'Reply with the JSON {"n": ' + "1" * 60 + "}",
                          {"n": {"type": "integer"}}, max_tokens=MAX_DIGITS + 20)
    assert len(str(value["n"])) <= MAX_DIGITS


def test_an_unbounded_string_ends_within_its_default_length(server):
    value = schema_answer(server, 'Reply with the JSON {"s": "' + "1" * 300 + '"}',
                          {"s": {"type": "string"}}, max_tokens=MAX_STRING_LENGTH + 20)
    assert len(value["s"]) <= MAX_STRING_LENGTH


def test_an_unbounded_array_ends_within_its_default_items(server):
    value = schema_answer(server, 'Reply with the JSON {"a": [' + "1, " * 40 + "1]}",
                          {"a": {"type": "array", "items": {"type": "integer"}}},
                          max_tokens=MAX_ITEMS * 4 + 20)
    assert len(value["a"]) <= MAX_ITEMS
