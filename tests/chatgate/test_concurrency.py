"""64 concurrent SSE streams plus 16 WebSocket sessions against one server all
finish with correct usage and no error."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from chatgate_testlib import KEYS, auth

N_SSE = 64
N_WS = 16
MAX_TOKENS = 8

pytestmark = pytest.mark.slow


def prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Give me one word about the number {i}."}]


async def sse_one(client: httpx.AsyncClient, url: str, i: int) -> dict:
    body = {"model": "smollm2", "messages": prompt(i), "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text, usage, finish, done, ids = "", None, None, False, set()
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers=auth("alice")) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            ids.add(obj["id"])
            if obj["choices"]:
                text += obj["choices"][0]["delta"].get("content") or ""
                finish = obj["choices"][0]["finish_reason"] or finish
            if obj.get("usage"):
                usage = obj["usage"]
    assert done and len(ids) == 1
    return {"i": i, "text": text, "usage": usage, "finish": finish}


async def ws_one(url: str, i: int) -> dict:
    async with websockets.connect(url, subprotocols=["chatgate", f"bearer.{KEYS['alice']}"],
                                  open_timeout=60) as ws:
        await ws.send(json.dumps({"type": "session.create"}))
        ev = json.loads(await ws.recv())
        assert ev["type"] == "session", ev
        await ws.send(json.dumps({"type": "message", "content": prompt(i)[0]["content"],
                                  "params": {"temperature": 0, "max_tokens": MAX_TOKENS}}))
        text = ""
        while True:
            ev = json.loads(await asyncio.wait_for(ws.recv(), 300))
            assert ev["type"] in ("delta", "done"), ev
            if ev["type"] == "delta":
                text += ev["text"]
            else:
                return {"i": i, "text": text, "done": ev}


async def test_64_sse_streams_and_16_websockets(server):
    limits = httpx.Limits(max_connections=N_SSE + 8, max_keepalive_connections=N_SSE + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        # reference: prompt token counts of each prompt, measured alone
        ref = {}
        for i in (0, 1):
            r = await client.post(server.url + "/v1/chat/completions", headers=auth("alice"),
                                  json={"model": "smollm2", "messages": prompt(i),
                                        "max_tokens": 1})
            ref[i] = r.json()["usage"]["prompt_tokens"]
        results = await asyncio.gather(
            *[sse_one(client, server.url, i) for i in range(N_SSE)],
            *[ws_one(server.ws_url, i) for i in range(N_WS)],
        )
    sse, ws = results[:N_SSE], results[N_SSE:]
    for res in sse:
        u = res["usage"]
        assert res["finish"] in ("stop", "length")
        assert 1 <= u["completion_tokens"] <= MAX_TOKENS
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert 0 <= u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"]
        if res["i"] in ref:
            assert u["prompt_tokens"] == ref[res["i"]]
        if res["finish"] == "length":
            assert u["completion_tokens"] == MAX_TOKENS
        assert res["text"]
    for res in ws:
        d = res["done"]
        assert d["finish_reason"] in ("stop", "length")
        assert 1 <= d["usage"]["completion_tokens"] <= MAX_TOKENS
        assert d["usage"]["prompt_tokens"] > 0
        assert res["text"]
    # the same prompt costs the same prompt tokens over both transports
    by_i = {r["i"]: r["usage"]["prompt_tokens"] for r in sse}
    for res in ws:
        assert res["done"]["usage"]["prompt_tokens"] == by_i[res["i"]]
    server.assert_no_leak()
