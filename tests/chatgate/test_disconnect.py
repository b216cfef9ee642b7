"""A client that goes away (SSE or WebSocket) aborts its engine request; its
blocks are back within 1 s and other streams are unaffected."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
from chatgate_testlib import KEYS, REPLICA_ID, auth

LONG = {"model": "smollm2", "messages": [{"role": "user", "content": "Write a long essay."}],
        "max_tokens": 500, "ignore_eos": True, "stream": True, "temperature": 0}
OTHER_TOKENS = 60


async def _other_stream(client: httpx.AsyncClient, url: str) -> dict:
    """A concurrent stream that must finish normally with its full token count."""
    body = {**LONG, "max_tokens": OTHER_TOKENS,
            "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "stream_options": {"include_usage": True}}
    usage, finish, text = None, None, ""
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers=auth("bob")) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            if obj["choices"]:
                text += obj["choices"][0]["delta"].get("content") or ""
                finish = obj["choices"][0]["finish_reason"] or finish
            if obj.get("usage"):
                usage = obj["usage"]
    return {"usage": usage, "finish": finish, "text": text}


async def _wait_running(server, at_most: int, timeout: float = 1.0) -> float:
    t0 = time.monotonic()
    while True:
        s = await asyncio.to_thread(server.engine_stats)
        if s["num_requests_running"] + s["num_requests_waiting"] <= at_most:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"request not aborted within {timeout}s: {s}")
        await asyncio.sleep(0.02)


async def test_closing_an_sse_stream_aborts_the_request(server):
    async with httpx.AsyncClient(timeout=120) as client:
        other = asyncio.create_task(_other_stream(client, server.url))
        async with client.stream("POST", server.url + "/v1/chat/completions", json=LONG,
                                 headers=auth("alice")) as r:
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                if n >= 6:
                    break
            during = await asyncio.to_thread(server.engine_stats)
            assert during["num_requests_running"] >= 1
        # response closed: the engine request must be gone within 1 s
        assert not other.done(), "the other stream should still be running"
        await _wait_running(server, at_most=1, timeout=1.0)
        after = await asyncio.to_thread(server.engine_stats)
        assert after["num_blocks_used"] < during["num_blocks_used"] + 8
        res = await other
    assert res["finish"] == "length"
    assert res["usage"]["completion_tokens"] == OTHER_TOKENS
    server.assert_no_leak()


async def test_closing_a_websocket_aborts_the_request(server):
    import websockets

    async with httpx.AsyncClient(timeout=120) as client:
        other = asyncio.create_task(_other_stream(client, server.url))
        ws = await websockets.connect(server.ws_url,
                                      subprotocols=["chatgate", f"bearer.{KEYS['alice']}"])
        await ws.send(json.dumps({"type": "session.create"}))
        json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "message", "content": "Write a long essay.",
                                  "params": {"max_tokens": 500, "ignore_eos": True}}))
        deltas = 0
        while deltas < 5:
            ev = json.loads(await ws.recv())
            assert ev["type"] == "delta", ev
            deltas += 1
        assert (await asyncio.to_thread(server.engine_stats))["num_requests_running"] >= 1
        await ws.close()
        assert not other.done()
        await _wait_running(server, at_most=1, timeout=1.0)
        res = await other
    assert res["finish"] == "length"
    assert res["usage"]["completion_tokens"] == OTHER_TOKENS
    server.assert_no_leak()


async def test_metrics_see_the_abort(server):
    m0 = await asyncio.to_thread(server.metrics)
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", server.url + "/v1/chat/completions", json=LONG,
                                 headers=auth("alice")) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content":"' in line and \
                        '"content":""' not in line:
                    break
    await _wait_running(server, at_most=0, timeout=1.0)
    m1 = await asyncio.to_thread(server.metrics)
    assert m1["chatgate:num_requests_running"] == 0
    key = ('chatgate:request_success_total{finished_reason="abort",model_name="smollm2",'
           f'replica="{REPLICA_ID}"}}')
    assert m1.get(key, 0) >= m0.get(key, 0) + 1


async def test_a_non_streaming_client_that_leaves_aborts_too(server):
    body = {**LONG, "stream": False}
    async with httpx.AsyncClient(timeout=120) as client:
        task = asyncio.create_task(client.post(server.url + "/v1/chat/completions", json=body,
                                               headers=auth("alice")))
        deadline = time.monotonic() + 30
        while (await asyncio.to_thread(server.engine_stats))["num_requests_running"] == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        task.cancel()  # closes the connection mid-request
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await _wait_running(server, at_most=0, timeout=1.0)
    server.assert_no_leak()


def _log_since(server, offset: int) -> str:
    with open(server.log_path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


async def _stored_messages(server, sid: str, count: int) -> list[dict]:
    """The session's stored messages once there are ``count`` (the store is written as the
    server sees the disconnect)."""
    deadline = time.monotonic() + 30
    while True:
        r = await asyncio.to_thread(httpx.get, f"{server.url}/v1/sessions/{sid}",
                                    headers=auth("alice"))
        messages = r.json().get("messages", []) if r.status_code == 200 else []
        if len(messages) >= count or time.monotonic() > deadline:
            return messages
        await asyncio.sleep(0.05)


async def test_a_websocket_turn_cut_by_a_disconnect_is_stored_as_a_pair(server):
    import websockets

    ws = await websockets.connect(server.ws_url,
                                  subprotocols=["chatgate", f"bearer.{KEYS['alice']}"])
    await ws.send(json.dumps({"type": "session.create"}))
    sid = json.loads(await ws.recv())["id"]
    await ws.send(json.dumps({"type": "message", "content": "Write a long essay.",
                              "params": {"max_tokens": 500, "ignore_eos": True}}))
    text = ""
    while len(text) < 20:
        ev = json.loads(await ws.recv())
        assert ev["type"] == "delta", ev
        text += ev["text"]
    await ws.close()
    await _wait_running(server, at_most=0, timeout=5.0)
    messages = await _stored_messages(server, sid, 2)
    assert [m["role"] for m in messages] == ["user", "assistant"], messages
    assert messages[1]["content"].startswith(text) and messages[1]["cut"] is True
    server.assert_no_leak()


async def test_an_sse_session_turn_cut_by_a_disconnect_is_stored_as_a_pair(server):
    sid = f"cut-sse-{time.monotonic_ns()}"
    body = {**LONG, "session_id": sid}
    text = ""
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", server.url + "/v1/chat/completions", json=body,
                                 headers=auth("alice")) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                if len(text) >= 20:
                    break
    await _wait_running(server, at_most=0, timeout=5.0)
    messages = await _stored_messages(server, sid, 2)
    assert [m["role"] for m in messages] == ["user", "assistant"], messages
    assert messages[0] == LONG["messages"][0]
    assert messages[1]["content"].startswith(text) and messages[1]["cut"] is True
    server.assert_no_leak()


async def test_clients_that_go_away_are_not_logged_as_errors(server):
    """A WebSocket client that closes its session and socket (as a browser tab does), one
    that leaves mid-answer, and an SSE client that leaves mid-stream: no ERROR, no
    traceback in the server's log."""
    import websockets

    offset = server.log_path.stat().st_size
    protocols = ["chatgate", f"bearer.{KEYS['alice']}"]
    async with websockets.connect(server.ws_url, subprotocols=protocols) as ws:
        await ws.send(json.dumps({"type": "session.create"}))
        json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "message", "content": "Hi",
                                  "params": {"max_tokens": 2}}))
        while json.loads(await ws.recv())["type"] != "done":
            pass
        await ws.send(json.dumps({"type": "session.close"}))
    async with websockets.connect(server.ws_url, subprotocols=protocols) as ws:
        await ws.send(json.dumps({"type": "session.create"}))
        json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "message", "content": "Write a long essay.",
                                  "params": {"max_tokens": 500, "ignore_eos": True}}))
        assert json.loads(await ws.recv())["type"] == "delta"
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", server.url + "/v1/chat/completions", json=LONG,
                                 headers=auth("alice")) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break
    await _wait_running(server, at_most=0, timeout=5.0)
    log = _log_since(server, offset)
    assert " ERROR " not in log and "Traceback" not in log, log
