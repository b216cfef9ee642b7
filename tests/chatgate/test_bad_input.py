"""Bad input, each case tested; the server stays up and no block leaks."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from chatgate_testlib import (
    ALLOWED_ORIGIN,
    KEYS,
    MAX_MODEL_LEN,
    MAX_REQUEST_BYTES,
    WS_MAX_MESSAGE_BYTES,
    auth,
)

MODEL = "smollm2"
OK_MESSAGES = [{"role": "user", "content": "Hi"}]


def post(server, body, *, tenant="alice", raw: bytes | None = None, headers=None):
    h = {**auth(tenant), **(headers or {})}
    if raw is not None:
        h.setdefault("Content-Type", "application/json")
        return httpx.post(server.url + "/v1/chat/completions", content=raw, headers=h,
                          timeout=60)
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=h, timeout=60)


def assert_error(r: httpx.Response, status: int, param: str | None = None,
                 contains: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err
    if contains is not None:
        assert contains in err["message"], err
    return err


@pytest.fixture(autouse=True)
def _server_stays_up_and_leaks_nothing(server):
    yield
    assert server.health()["status"] == "ok"
    server.assert_no_leak()


def test_malformed_json(server):
    assert_error(post(server, None, raw=b'{"model": "smollm2", "messages": [}'), 400)
    assert_error(post(server, None, raw=b"[1, 2]"), 400)
    assert_error(post(server, None, raw=b"\xff\xfe"), 400)


@pytest.mark.parametrize("messages", [None, [], "hello"])
def test_missing_or_empty_messages(server, messages):
    body = {"model": MODEL}
    if messages is not None:
        body["messages"] = messages
    assert_error(post(server, body), 400, param="messages")


def test_unknown_role(server):
    err = assert_error(post(server, {"model": MODEL, "messages": [
        {"role": "wizard", "content": "abracadabra"}]}), 400, param="messages.0.role")
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("content", [42, {"text": "hi"}, ["hi"], True])
def test_non_string_content(server, content):
    assert_error(post(server, {"model": MODEL, "messages": [
        {"role": "user", "content": content}]}), 400, param="messages.0.content")


def test_prompt_over_max_model_len(server):
    long = "hello " * (MAX_MODEL_LEN + 50)
    err = assert_error(post(server, {"model": MODEL, "messages": [
        {"role": "user", "content": long}]}), 400, contains=str(MAX_MODEL_LEN))
    assert err["code"] == "context_length_exceeded"
    # prompt fits but prompt + max_tokens does not
    mid = "hello " * (MAX_MODEL_LEN // 2)
    assert_error(post(server, {"model": MODEL, "max_tokens": MAX_MODEL_LEN,
                               "messages": [{"role": "user", "content": mid}]}), 400,
                 contains=str(MAX_MODEL_LEN))
    # streaming requests are refused the same way, before the stream starts
    assert_error(post(server, {"model": MODEL, "stream": True, "messages": [
        {"role": "user", "content": long}]}), 400, contains=str(MAX_MODEL_LEN))


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", -5), ("max_completion_tokens", 0),
    ("temperature", -1), ("temperature", 3),
    ("top_p", 0), ("top_p", 1.5),
    ("n", 0),
    ("stop", ["a", "b", "c", "d", "e"]),
    ("stop", [""]),
    ("top_logprobs", 25),
])
def test_out_of_range_parameters(server, field, value):
    assert_error(post(server, {"model": MODEL, "messages": OK_MESSAGES, field: value}), 400,
                 param=field)


def test_unknown_model_is_404(server):
    err = assert_error(post(server, {"model": "gpt-17", "messages": OK_MESSAGES}), 404,
                       param="model")
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong"},
                                     {"Authorization": "Basic abc"}])
def test_missing_or_wrong_api_key_is_401(server, headers):
    for method, path in [("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", "/v1/sessions")]:
        r = httpx.request(method, server.url + path, headers=headers,
                          json={"model": MODEL, "messages": OK_MESSAGES}, timeout=30)
        err = assert_error(r, 401)
        assert err["code"] == "invalid_api_key"


def test_another_tenants_session_is_404(server):
    sid = "alice-private-session"
    r = post(server, {"model": MODEL, "messages": OK_MESSAGES, "max_tokens": 2,
                      "session_id": sid})
    assert r.status_code == 200
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{server.url}/v1/sessions/{sid}", headers=auth("bob"))
        assert_error(r, 404)
    assert sid not in [s["id"] for s in httpx.get(
        server.url + "/v1/sessions", headers=auth("bob")).json()["data"]]

    async def ws_resume():
        async with websockets.connect(
                server.ws_url, subprotocols=["chatgate", f"bearer.{KEYS['bob']}"]) as ws:
            await ws.send(json.dumps({"type": "session.resume", "session_id": sid}))
            return json.loads(await ws.recv())

    ev = asyncio.run(ws_resume())
    assert ev["type"] == "error" and ev["code"] == "session_not_found"
    # still there for its owner
    r = httpx.get(f"{server.url}/v1/sessions/{sid}", headers=auth("alice"))
    assert r.status_code == 200 and len(r.json()["messages"]) == 2
    assert httpx.delete(f"{server.url}/v1/sessions/{sid}", headers=auth("alice")).status_code \
        == 200


def test_invalid_session_id(server):
    assert_error(post(server, {"model": MODEL, "messages": OK_MESSAGES,
                               "session_id": "has spaces/and slashes"}), 400,
                 param="session_id")


def test_oversized_http_body_is_413(server):
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * MAX_REQUEST_BYTES}]}
    err = assert_error(post(server, big), 413)
    assert str(MAX_REQUEST_BYTES) in err["message"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(MAX_REQUEST_BYTES // 4096 + 2):
            yield b" " * 4096

    r = httpx.post(server.url + "/v1/chat/completions", content=chunks(),
                   headers={**auth("alice"), "Content-Type": "application/json"}, timeout=30)
    assert_error(r, 413)


async def _ws(server, **kw):
    return await websockets.connect(server.ws_url,
                                    subprotocols=["chatgate", f"bearer.{KEYS['alice']}"], **kw)


async def _next(ws, timeout=30):
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def test_websocket_frame_over_the_size_limit(server):
    async with await _ws(server) as ws:
        await ws.send(json.dumps({"type": "message", "content": "x" * WS_MAX_MESSAGE_BYTES}))
        ev = await _next(ws)
        assert ev["type"] == "error" and ev["code"] == "message_too_large"
        assert str(WS_MAX_MESSAGE_BYTES) in ev["message"]
        await ws.send(json.dumps({"type": "session.create"}))
        assert (await _next(ws))["type"] == "session"  # socket still open


async def test_unknown_websocket_event_keeps_the_socket_open(server):
    async with await _ws(server) as ws:
        await ws.send(json.dumps({"type": "teleport", "where": "mars"}))
        ev = await _next(ws)
        assert ev == {"type": "error", "code": "unknown_event",
                      "message": "Unknown event type 'teleport'."}
        for bad in ["not json", "[1,2]", json.dumps({"no": "type"})]:
            await ws.send(bad)
            ev = await _next(ws)
            assert ev["type"] == "error" and ev["code"] in ("invalid_json", "invalid_event")
        # bad message params and messages without a session
        await ws.send(json.dumps({"type": "message", "content": "hi"}))
        assert (await _next(ws))["code"] == "no_session"
        await ws.send(json.dumps({"type": "session.create"}))
        assert (await _next(ws))["type"] == "session"
        for params in [{"temperature": 3}, {"top_p": 0}, {"max_tokens": 0},
                       {"stop": ["a", "b", "c", "d", "e"]}, {"bogus": 1}]:
            await ws.send(json.dumps({"type": "message", "content": "hi", "params": params}))
            ev = await _next(ws)
            assert ev["type"] == "error" and ev["code"] == "invalid_params", (params, ev)
        await ws.send(json.dumps({"type": "message", "content": 5}))
        assert (await _next(ws))["code"] == "invalid_params"
        await ws.send(json.dumps({"type": "message", "content": "hello " * MAX_MODEL_LEN}))
        ev = await _next(ws)
        assert ev["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in ev["message"]
        await ws.send(json.dumps({"type": "message", "content": "Say hi",
                                  "params": {"max_tokens": 2}}))
        while (ev := await _next(ws))["type"] != "done":
            assert ev["type"] == "delta"


async def test_websocket_from_disallowed_origin_is_refused(server):
    with pytest.raises(websockets.exceptions.InvalidStatus) as e:
        await _ws(server, origin="http://evil.example")
    assert e.value.response.status_code == 403
    for origin in (ALLOWED_ORIGIN, server.url):  # the allowlist, and same-origin pages
        async with await _ws(server, origin=origin) as ws:
            await ws.send(json.dumps({"type": "session.create"}))
            assert (await _next(ws))["type"] == "session"


async def test_websocket_wrong_key_is_refused(server):
    with pytest.raises(websockets.exceptions.InvalidStatus) as e:
        await websockets.connect(server.ws_url, subprotocols=["chatgate", "bearer.sk-nope"])
    assert e.value.response.status_code == 403
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps({"type": "session.create"}))
        ev = await _next(ws)
        assert ev["type"] == "error" and ev["code"] == "unauthorized"
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            await _next(ws)
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": "sk-nope"}))
        ev = await _next(ws)
        assert ev["code"] == "unauthorized"


@pytest.mark.parametrize("method,path,allow", [
    ("GET", "/v1/chat/completions", "POST"),
    ("PUT", "/v1/chat/completions", "POST"),
    ("GET", "/v1/completions", "POST"),
    ("POST", "/v1/models", "GET, HEAD"),
    ("DELETE", "/v1/sessions", "GET, HEAD"),
    ("PUT", "/v1/sessions/abc", "GET, HEAD, DELETE"),
    ("POST", "/healthz", "GET, HEAD"),
])
def test_a_wrong_method_is_405_naming_the_allowed_ones(server, method, path, allow):
    r = httpx.request(method, server.url + path, headers=auth("alice"), timeout=30)
    err = assert_error(r, 405)
    assert err["type"] == "invalid_request_error"
    assert set(r.headers["allow"].split(", ")) == set(allow.split(", "))


def test_completions_errors_name_the_prompt(server):
    url = server.url + "/v1/completions"
    long = {"model": MODEL, "prompt": "hello " * (MAX_MODEL_LEN + 50)}
    err = assert_error(httpx.post(url, json=long, headers=auth("alice"), timeout=60), 400,
                       param="prompt")
    assert err["code"] == "context_length_exceeded" and "messages" not in err["message"]
    too_many = {"model": MODEL, "prompt": "hello", "max_tokens": MAX_MODEL_LEN}
    err = assert_error(httpx.post(url, json=too_many, headers=auth("alice"), timeout=60), 400,
                       param="prompt")
    assert err["code"] == "context_length_exceeded" and "messages" not in err["message"]
    bad_id = {"model": MODEL, "prompt": [1, 10**9]}
    assert_error(httpx.post(url, json=bad_id, headers=auth("alice"), timeout=60), 400,
                 param="prompt")


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
def test_seeds_at_the_ends_of_the_signed_64_bit_range_are_served(server, seed):
    r = post(server, {"model": MODEL, "messages": OK_MESSAGES, "max_tokens": 2,
                      "temperature": 1.0, "seed": seed})
    assert r.status_code == 200, r.text


async def test_http_and_websocket_refuse_the_same_oversized_max_tokens(server):
    mid = "hello " * (MAX_MODEL_LEN // 2)
    http = assert_error(post(server, {"model": MODEL, "max_tokens": MAX_MODEL_LEN,
                                      "messages": [{"role": "user", "content": mid}]}), 400)
    async with await _ws(server) as ws:
        await ws.send(json.dumps({"type": "session.create"}))
        assert (await _next(ws))["type"] == "session"
        await ws.send(json.dumps({"type": "message", "content": mid,
                                  "params": {"max_tokens": MAX_MODEL_LEN}}))
        ev = await _next(ws)
    assert ev["type"] == "error" and ev["code"] == http["code"] == "context_length_exceeded"
    assert ev["message"] == http["message"]
