"""A corpus of bad input over HTTP and WebSocket: each case gets its status (HTTP) or its
``error`` event (WebSocket, socket left open) with the expected ``code``, and the request after
it, on the same connection, is answered normally; no block leaks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import websockets
from chatgate_testlib import KEYS, MAX_MODEL_LEN, MAX_REQUEST_BYTES, WS_MAX_MESSAGE_BYTES

MODEL = "smollm2"
KEY = {"Authorization": f"Bearer {KEYS['alice']}"}
JSON_TYPE = {"Content-Type": "application/json"}
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def with_(**changes: Any) -> dict:
    """The good body with fields replaced (None: removed)."""
    body = {**GOOD, **changes}
    return {k: v for k, v in body.items() if v is not None}


def completion(**changes: Any) -> dict:
    """A good ``/v1/completions`` body with fields replaced."""
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **changes}


def message(content: Any, role: str = "user") -> dict:
    return with_(messages=[{"role": role, "content": content}])


@dataclass
class HTTPCase:
    """One request and the error it must get."""

    name: str
    status: int
    code: str | None
    body: Any = None  # JSON-encoded unless ``raw`` is given
    raw: bytes | Callable[[], Any] | None = None
    headers: dict[str, str] = field(default_factory=lambda: {**KEY, **JSON_TYPE})
    method: str = "POST"
    path: str = "/v1/chat/completions"


def chunks(total: int) -> Callable[[], Any]:
    def gen():  # no Content-Length: the limit is enforced while the body is read
        for _ in range(total // 4096 + 2):
            yield b" " * 4096
    return gen


BIG = MAX_REQUEST_BYTES + 1
HUGE = 2**70  # beyond the 64 bits that cross the engine's IPC
INT64_MAX = 2**63 - 1
HTTP_CASES = [
    # the body's JSON
    HTTPCase("truncated json", 400, "invalid_json", raw=b'{"model": "smollm2", "messages": ['),
    HTTPCase("trailing garbage", 400, "invalid_json", raw=json.dumps(GOOD).encode() + b" x"),
    HTTPCase("empty body", 400, "invalid_json", raw=b""),
    HTTPCase("NaN literal", 400, "invalid_json", raw=b'{"temperature": NaN}'),
    HTTPCase("single quotes", 400, "invalid_json", raw=b"{'model': 'smollm2'}"),
    HTTPCase("array body", 400, "invalid_json", raw=b"[1, 2]"),
    HTTPCase("string body", 400, "invalid_json", raw=b'"hello"'),
    HTTPCase("null body", 400, "invalid_json", raw=b"null"),
    HTTPCase("number body", 400, "invalid_json", raw=b"42"),
    HTTPCase("lone high surrogate", 400, "invalid_unicode",
             raw=b'{"model": "smollm2", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    HTTPCase("lone low surrogate", 400, "invalid_unicode",
             raw=b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\udc00"}]}'),
    HTTPCase("reversed surrogate pair", 400, "invalid_unicode",
             raw=b'{"model": "smollm2", "messages": [{"role": "user", '
                 b'"content": "\\ude00\\ud83d"}]}'),
    HTTPCase("surrogate in a key", 400, "invalid_unicode", raw=b'{"\\ud800": 1}'),
    HTTPCase("malformed utf-8", 400, "invalid_unicode",
             raw=b'{"model": "smollm2", "messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    HTTPCase("utf-8 encoded surrogate", 400, "invalid_unicode",
             raw=b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'),
    HTTPCase("utf-16 body", 400, "invalid_unicode", raw=json.dumps(GOOD).encode("utf-16")),
    HTTPCase("number beyond a double", 400, "invalid_value",
             raw=json.dumps(GOOD).replace('"max_tokens": 1', '"temperature": 1e400').encode()),
    HTTPCase("nested 10000 deep", 400, "json_too_deep", raw=deep(10000).encode()),
    HTTPCase("nested 33 deep in content", 400, "json_too_deep",
             raw=json.dumps(message("x")).replace('"x"', deep(33)).encode()),
    HTTPCase("deep object", 400, "json_too_deep", raw=(b'{"a":' * 40) + b"1" + b"}" * 40),
    # size
    HTTPCase("content-length over the limit", 413, "request_too_large",
             body=message("x" * BIG)),
    HTTPCase("chunked body over the limit", 413, "request_too_large", raw=chunks(BIG)),
    # content type and origin (cross-site writes)
    HTTPCase("text/plain", 415, "unsupported_media_type", body=GOOD,
             headers={**KEY, "Content-Type": "text/plain"}),
    HTTPCase("form-encoded", 415, "unsupported_media_type", body=GOOD,
             headers={**KEY, "Content-Type": "application/x-www-form-urlencoded"}),
    HTTPCase("multipart", 415, "unsupported_media_type", body=GOOD,
             headers={**KEY, "Content-Type": "multipart/form-data; boundary=x"}),
    HTTPCase("no content type", 415, "unsupported_media_type", body=GOOD, headers=KEY),
    HTTPCase("application/jsonx", 415, "unsupported_media_type", body=GOOD,
             headers={**KEY, "Content-Type": "application/jsonx"}),
    HTTPCase("text/json", 415, "unsupported_media_type", body=GOOD,
             headers={**KEY, "Content-Type": "text/json"}),
    HTTPCase("foreign origin", 403, "origin_not_allowed", body=GOOD,
             headers={**KEY, **JSON_TYPE, "Origin": "http://evil.example"}),
    HTTPCase("foreign origin, text/plain", 403, "origin_not_allowed", body=GOOD,
             headers={**KEY, "Content-Type": "text/plain", "Origin": "http://evil.example"}),
    HTTPCase("null origin", 403, "origin_not_allowed", body=GOOD,
             headers={**KEY, **JSON_TYPE, "Origin": "null"}),
    HTTPCase("look-alike origin", 403, "origin_not_allowed", body=GOOD,
             headers={**KEY, **JSON_TYPE, "Origin": "http://127.0.0.1.evil.example"}),
    HTTPCase("foreign origin on GET", 403, "origin_not_allowed", method="GET",
             path="/v1/models", headers={**KEY, "Origin": "http://evil.example"}),
    HTTPCase("foreign origin on DELETE", 403, "origin_not_allowed", method="DELETE",
             path="/v1/sessions/abc", headers={**KEY, **JSON_TYPE,
                                               "Origin": "http://evil.example"}),
    # authentication and routing
    HTTPCase("no api key", 401, "invalid_api_key", body=GOOD, headers=JSON_TYPE),
    HTTPCase("wrong api key", 401, "invalid_api_key", body=GOOD,
             headers={"Authorization": "Bearer sk-wrong", **JSON_TYPE}),
    HTTPCase("basic auth", 401, "invalid_api_key", body=GOOD,
             headers={"Authorization": "Basic YWxpY2U6eA==", **JSON_TYPE}),
    HTTPCase("unknown model", 404, "model_not_found", body=with_(model="gpt-9")),
    HTTPCase("unknown path", 404, None, method="GET", path="/v1/nothing-here"),
    HTTPCase("GET on chat completions", 405, None, method="GET", headers=KEY),
    HTTPCase("PUT on chat completions", 405, None, method="PUT", body=GOOD),
    HTTPCase("GET on text completions", 405, None, method="GET", path="/v1/completions",
             headers=KEY),
    HTTPCase("POST on models", 405, None, path="/v1/models", body=GOOD),
    HTTPCase("PUT on a session", 405, None, method="PUT", path="/v1/sessions/abc", body=GOOD),
    HTTPCase("unknown session", 404, "session_not_found", method="GET",
             path="/v1/sessions/no-such-session", headers=KEY),
    HTTPCase("delete unknown session", 404, "session_not_found", method="DELETE",
             path="/v1/sessions/no-such-session"),
    HTTPCase("body-less delete without content type", 404, "session_not_found",
             method="DELETE", path="/v1/sessions/no-such-session", headers=KEY),
    HTTPCase("delete with a text/plain body", 415, "unsupported_media_type", method="DELETE",
             path="/v1/sessions/no-such-session", raw=b"{}",
             headers={**KEY, "Content-Type": "text/plain"}),
    HTTPCase("foreign origin on body-less DELETE", 403, "origin_not_allowed", method="DELETE",
             path="/v1/sessions/abc", headers={**KEY, "Origin": "http://evil.example"}),
    HTTPCase("session id with a slash", 404, None, method="GET",
             path="/v1/sessions/a%2Fb", headers=KEY),
    # the request's fields
    HTTPCase("missing model", 400, "missing_required_parameter", body=with_(model=None)),
    HTTPCase("missing messages", 400, "missing_required_parameter", body=with_(messages=None)),
    HTTPCase("empty messages", 400, "invalid_value", body=with_(messages=[])),
    HTTPCase("messages as a string", 400, "invalid_value", body=with_(messages="hello")),
    HTTPCase("message without role", 400, "missing_required_parameter",
             body=with_(messages=[{"content": "hi"}])),
    HTTPCase("unknown role", 400, "invalid_value", body=message("hi", role="wizard")),
    HTTPCase("content is a number", 400, "invalid_value", body=message(42)),
    HTTPCase("content is an object", 400, "invalid_value", body=message({"text": "hi"})),
    HTTPCase("content is a list of strings", 400, "invalid_value", body=message(["hi"])),
    HTTPCase("content is a boolean", 400, "invalid_value", body=message(True)),
    HTTPCase("temperature below 0", 400, "invalid_value", body=with_(temperature=-1)),
    HTTPCase("temperature above 2", 400, "invalid_value", body=with_(temperature=3)),
    HTTPCase("temperature as text", 400, "invalid_value", body=with_(temperature="hot")),
    HTTPCase("top_p 0", 400, "invalid_value", body=with_(top_p=0)),
    HTTPCase("top_p above 1", 400, "invalid_value", body=with_(top_p=1.5)),
    HTTPCase("max_tokens 0", 400, "invalid_value", body=with_(max_tokens=0)),
    HTTPCase("max_tokens negative", 400, "invalid_value", body=with_(max_tokens=-5)),
    HTTPCase("max_tokens fractional", 400, "invalid_value", body=with_(max_tokens=1.5)),
    HTTPCase("max_tokens beyond the context", 400, "context_length_exceeded",
             body=with_(max_tokens=MAX_MODEL_LEN * 4)),
    HTTPCase("n 0", 400, "invalid_value", body=with_(n=0)),
    HTTPCase("n huge", 400, "invalid_value", body=with_(n=10_000)),
    HTTPCase("too many stop sequences", 400, "invalid_value",
             body=with_(stop=["a", "b", "c", "d", "e"])),
    HTTPCase("stop is a number", 400, "invalid_value", body=with_(stop=5)),
    HTTPCase("stop list of numbers", 400, "invalid_value", body=with_(stop=[1, 2])),
    HTTPCase("seed as text", 400, "invalid_value", body=with_(seed="abc")),
    # integers beyond signed 64 bits (what crosses the engine's IPC)
    HTTPCase("seed above 64 bits", 400, "invalid_value", body=with_(seed=HUGE)),
    HTTPCase("seed below 64 bits", 400, "invalid_value", body=with_(seed=-HUGE)),
    HTTPCase("seed one above int64", 400, "invalid_value", body=with_(seed=INT64_MAX + 1)),
    HTTPCase("seed one below int64", 400, "invalid_value", body=with_(seed=-INT64_MAX - 2)),
    HTTPCase("top_k above 64 bits", 400, "invalid_value", body=with_(top_k=HUGE)),
    HTTPCase("min_tokens above 64 bits", 400, "invalid_value", body=with_(min_tokens=HUGE)),
    HTTPCase("max_tokens above 64 bits", 400, "invalid_value", body=with_(max_tokens=HUGE)),
    HTTPCase("max_completion_tokens above 64 bits", 400, "invalid_value",
             body=with_(max_completion_tokens=HUGE)),
    HTTPCase("n above 64 bits", 400, "invalid_value", body=with_(n=HUGE)),
    HTTPCase("top_logprobs above 64 bits", 400, "invalid_value",
             body=with_(logprobs=True, top_logprobs=HUGE)),
    HTTPCase("logit_bias key above 64 bits", 400, "invalid_value",
             body=with_(logit_bias={str(HUGE): 1})),
    HTTPCase("logit_bias key below 64 bits", 400, "invalid_value",
             body=with_(logit_bias={str(-HUGE): 1})),
    HTTPCase("logit_bias value above 64 bits", 400, "invalid_value",
             body=with_(logit_bias={"1": HUGE})),
    HTTPCase("completion token id above 64 bits", 400, "invalid_value",
             path="/v1/completions", body=completion(prompt=[1, HUGE])),
    HTTPCase("completion token id below 64 bits", 400, "invalid_value",
             path="/v1/completions", body=completion(prompt=[[1], [-HUGE]])),
    HTTPCase("completion token id beyond the vocabulary", 400, "invalid_value",
             path="/v1/completions", body=completion(prompt=[INT64_MAX])),
    HTTPCase("completion seed above 64 bits", 400, "invalid_value",
             path="/v1/completions", body=completion(seed=HUGE)),
    HTTPCase("completion max_tokens above 64 bits", 400, "invalid_value",
             path="/v1/completions", body=completion(max_tokens=HUGE)),
    HTTPCase("completion best_of above 64 bits", 400, "invalid_value",
             path="/v1/completions", body=completion(best_of=HUGE)),
    HTTPCase("completion logprobs above 64 bits", 400, "unsupported_parameter",
             path="/v1/completions", body=completion(logprobs=HUGE)),
    HTTPCase("top_logprobs over 20", 400, "invalid_value",
             body=with_(logprobs=True, top_logprobs=50)),
    HTTPCase("stream as text", 400, "invalid_value", body=with_(stream="yes")),
    HTTPCase("logprobs as a number", 400, "invalid_value", body=with_(logprobs=1)),
    HTTPCase("prompt over max_model_len", 400, "context_length_exceeded",
             body=message("hello " * MAX_MODEL_LEN)),
    HTTPCase("session id with spaces", 400, "invalid_value",
             body=with_(session_id="has spaces/and slashes")),
    HTTPCase("session id too long", 400, "invalid_value", body=with_(session_id="s" * 200)),
    HTTPCase("empty session id", 400, "invalid_value", body=with_(session_id="")),
]


def send(client: httpx.Client, case: HTTPCase) -> httpx.Response:
    kw: dict[str, Any] = {"headers": case.headers}
    if callable(case.raw):
        kw["content"] = case.raw()
    elif case.raw is not None:
        kw["content"] = case.raw
    elif case.body is not None:
        kw["content"] = json.dumps(case.body).encode()
    return client.request(case.method, case.path, **kw)


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c.name for c in HTTP_CASES])
def test_http_bad_input(server, case: HTTPCase) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = send(client, case)
        assert r.status_code == case.status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["code"] == case.code, err
        ok = client.post("/v1/chat/completions", json=GOOD, headers=KEY)  # same connection
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    server.assert_no_leak()


@dataclass
class WSCase:
    """One frame (text, or bytes for a binary frame) and the ``error`` code it must get."""

    name: str
    frame: str | bytes
    code: str
    with_session: bool = True


def ws_message(content: Any, **params: Any) -> str:
    event: dict[str, Any] = {"type": "message", "content": content}
    if params:
        event["params"] = params
    return json.dumps(event)


WS_CASES = [
    WSCase("not json", "not json", "invalid_json"),
    WSCase("empty frame", "", "invalid_json"),
    WSCase("truncated json", '{"type": "message", ', "invalid_json"),
    WSCase("NaN literal", '{"type": "message", "content": NaN}', "invalid_json"),
    WSCase("array frame", "[1, 2]", "invalid_event"),
    WSCase("string frame", '"message"', "invalid_event"),
    WSCase("no type", json.dumps({"content": "hi"}), "invalid_event"),
    WSCase("type is a number", json.dumps({"type": 5}), "invalid_event"),
    WSCase("unknown type", json.dumps({"type": "teleport"}), "unknown_event"),
    WSCase("lone surrogate", '{"type": "message", "content": "a\\ud800b"}', "invalid_unicode"),
    WSCase("lone surrogate in params", '{"type": "message", "content": "hi", '
           '"params": {"stop": ["\\udfff"]}}', "invalid_unicode"),
    WSCase("binary malformed utf-8", b'{"type": "message", "content": "\xff"}',
           "invalid_unicode"),
    WSCase("nested 8000 deep", deep(8000), "json_too_deep"),
    WSCase("nested 40 deep content", ws_message("x").replace('"x"', deep(40)), "json_too_deep"),
    WSCase("frame over the limit", ws_message("x" * WS_MAX_MESSAGE_BYTES), "message_too_large"),
    WSCase("message without a session", ws_message("hi"), "no_session", with_session=False),
    WSCase("content is a number", ws_message(5), "invalid_params"),
    WSCase("content is a list", ws_message(["hi"]), "invalid_params"),
    WSCase("temperature above 2", ws_message("hi", temperature=3), "invalid_params"),
    WSCase("top_p 0", ws_message("hi", top_p=0), "invalid_params"),
    WSCase("max_tokens 0", ws_message("hi", max_tokens=0), "invalid_params"),
    WSCase("max_tokens beyond the context", ws_message("hi", max_tokens=MAX_MODEL_LEN * 4),
           "context_length_exceeded"),
    WSCase("max_tokens above 64 bits", ws_message("hi", max_tokens=HUGE), "invalid_params"),
    WSCase("seed above 64 bits", ws_message("hi", seed=HUGE), "invalid_params"),
    WSCase("seed below 64 bits", ws_message("hi", seed=-HUGE), "invalid_params"),
    WSCase("top_k above 64 bits", ws_message("hi", top_k=HUGE), "invalid_params"),
    WSCase("min_tokens above 64 bits", ws_message("hi", min_tokens=HUGE), "invalid_params"),
    WSCase("logit_bias key above 64 bits", ws_message("hi", logit_bias={str(HUGE): 1}),
           "invalid_params"),
    WSCase("logit_bias value above 64 bits", ws_message("hi", logit_bias={"1": HUGE}),
           "invalid_params"),
    WSCase("unknown param", ws_message("hi", bogus=1), "invalid_params"),
    WSCase("too many stops", ws_message("hi", stop=["a", "b", "c", "d", "e"]),
           "invalid_params"),
    WSCase("prompt over the context", ws_message("hello " * MAX_MODEL_LEN),
           "context_length_exceeded"),
    WSCase("resume an unknown session",
           json.dumps({"type": "session.resume", "session_id": "no-such-session"}),
           "session_not_found"),
]


async def next_event(ws: Any) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), 60))


@pytest.mark.parametrize("case", WS_CASES, ids=[c.name for c in WS_CASES])
async def test_websocket_bad_input(server, case: WSCase) -> None:
    async with websockets.connect(server.ws_url, max_size=None,
                                  subprotocols=["chatgate", f"bearer.{KEYS['alice']}"]) as ws:
        if case.with_session:
            await ws.send(json.dumps({"type": "session.create"}))
            assert (await next_event(ws))["type"] == "session"
        await ws.send(case.frame)
        event = await next_event(ws)
        assert event["type"] == "error" and event["code"] == case.code, event
        if not case.with_session:
            await ws.send(json.dumps({"type": "session.create"}))
            assert (await next_event(ws))["type"] == "session"
        await ws.send(ws_message("Say hi", max_tokens=1))  # the socket is still open and works
        while (event := await next_event(ws))["type"] != "done":
            assert event["type"] == "delta", event
    await asyncio.to_thread(server.assert_no_leak)

