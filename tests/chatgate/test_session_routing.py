"""What a load balancer in front of several gateways relies on: every response names the
replica (``X-Chatgate-Replica``; ``/metrics`` labels its series with it), and a session may be
named in the routable places (``X-Session-Id`` header, WebSocket ``session`` query parameter)
as well as in the body, which must then agree."""

from __future__ import annotations

import json
import uuid

import httpx
import websockets
from chatgate_testlib import KEYS, REPLICA_ID, auth

BODY = {"model": "smollm2", "temperature": 0, "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}]}


def chat(server, body: dict, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body,
                      headers={**auth("alice"), **(headers or {})}, timeout=120)


def ws_connect(server, query: str = "", headers: dict[str, str] | None = None):
    return websockets.connect(server.ws_url + query, additional_headers=headers,
                              subprotocols=["chatgate", f"bearer.{KEYS['alice']}"])


async def next_event(ws, *skip: str) -> dict:
    while True:
        ev = json.loads(await ws.recv())
        if ev["type"] not in skip:
            return ev


def test_every_response_names_the_replica(server):
    ok = httpx.get(server.url + "/v1/models", headers=auth("alice"))
    refused = httpx.get(server.url + "/v1/models")
    unsupported = httpx.post(server.url + "/v1/chat/completions", content=b"x",
                             headers={"Content-Type": "text/plain"})
    assert (ok.status_code, refused.status_code, unsupported.status_code) == (200, 401, 415)
    for r in (ok, refused, unsupported, httpx.get(server.url + "/healthz")):
        assert r.headers["x-chatgate-replica"] == REPLICA_ID
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={**BODY, "stream": True}, headers=auth("alice"), timeout=120) as r:
        assert r.headers["x-chatgate-replica"] == REPLICA_ID
        assert r.read().endswith(b"data: [DONE]\n\n")


async def test_the_websocket_handshake_names_the_replica(server):
    async with ws_connect(server) as ws:
        assert ws.response.headers["X-Chatgate-Replica"] == REPLICA_ID


def test_metrics_series_carry_the_replica_label(server):
    assert chat(server, BODY).status_code == 200
    text = httpx.get(server.url + "/metrics").text
    series = [line for line in text.splitlines() if line.startswith("chatgate:")]
    assert any(s.startswith("chatgate:num_requests_running{") for s in series)
    assert any(s.startswith("chatgate:prompt_tokens_total{") for s in series)
    for s in series:
        assert f'replica="{REPLICA_ID}"' in s, s


def test_the_session_header_continues_a_session_like_the_body_field(server):
    sid = f"hdr-{uuid.uuid4().hex}"
    first = chat(server, BODY, {"X-Session-Id": sid})
    assert first.status_code == 200 and first.json()["session_id"] == sid
    answer = first.json()["choices"][0]["message"]["content"]
    follow = {**BODY, "session_id": sid, "messages": [
        *BODY["messages"], {"role": "assistant", "content": answer},
        {"role": "user", "content": "And?"}]}
    second = chat(server, follow, {"X-Session-Id": sid})
    assert second.status_code == 200, second.text
    usage = second.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= first.json()["usage"][
        "prompt_tokens"]
    stored = httpx.get(f"{server.url}/v1/sessions/{sid}",
                       headers={**auth("alice"), "X-Session-Id": sid}).json()
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"] * 2
    assert httpx.delete(f"{server.url}/v1/sessions/{sid}", headers=auth("alice"),
                        ).status_code == 200


def test_header_and_body_naming_different_sessions_is_a_400(server):
    r = chat(server, {**BODY, "session_id": "one"}, {"X-Session-Id": "two"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["code"], err["param"], err["type"]) == (
        "session_id_mismatch", "session_id", "invalid_request_error")
    assert "'one'" in err["message"] and "'two'" in err["message"]


def test_a_malformed_session_header_is_a_400(server):
    r = chat(server, BODY, {"X-Session-Id": "has spaces"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id"


def test_session_path_and_header_naming_different_sessions_is_a_400(server):
    r = httpx.get(f"{server.url}/v1/sessions/one", headers={**auth("alice"),
                                                           "X-Session-Id": "two"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "session_id_mismatch"


async def test_a_websocket_url_session_is_the_one_created_and_resumed(server):
    sid = f"ws-url-{uuid.uuid4().hex}"
    async with ws_connect(server, f"?session={sid}") as ws:
        await ws.send(json.dumps({"type": "session.create"}))
        assert (await next_event(ws))["id"] == sid
        await ws.send(json.dumps({"type": "message", "content": "Hi",
                                  "params": {"max_tokens": 2, "temperature": 0}}))
        assert (await next_event(ws, "delta"))["type"] == "done"
    async with ws_connect(server, f"?session={sid}") as ws:
        await ws.send(json.dumps({"type": "session.resume", "session_id": sid}))
        ev = await next_event(ws)
        assert ev["type"] == "session" and len(ev["messages"]) == 2
        await ws.send(json.dumps({"type": "session.resume", "session_id": "another"}))
        err = await next_event(ws)
        assert (err["type"], err["code"]) == ("error", "session_id_mismatch")
        await ws.send(json.dumps({"type": "session.close"}))  # the socket stayed open
        assert (await next_event(ws))["type"] == "session.closed"


async def test_a_websocket_handshake_naming_two_sessions_gets_an_error_event(server):
    async with ws_connect(server, "?session=one", {"X-Session-Id": "two"}) as ws:
        err = await next_event(ws)
        assert (err["type"], err["code"]) == ("error", "session_id_mismatch")
        await ws.send(json.dumps({"type": "session.resume", "session_id": "one"}))
        assert (await next_event(ws))["code"] == "session_id_mismatch"
