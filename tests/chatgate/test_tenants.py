"""Tenant isolation of the prefix cache and the tenant limits (429 +
Retry-After), warm system prompts."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import httpx
import openai
import websockets
from chatgate_testlib import KEYS, WARM_PROMPT, auth

MODEL = "smollm2"


def sdk(server, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0,
                         timeout=120)


def ask(client, system: str, user: str, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": system},
                               {"role": "user", "content": user}],
        temperature=0, max_tokens=2, **kw)


def test_tenants_do_not_share_cached_prefixes(server):
    alice, bob = sdk(server, "alice"), sdk(server, "bob")
    system = f"[{uuid.uuid4().hex}] " + "You are a very careful and thorough assistant. " * 12
    a1 = ask(alice, system, "Hello")
    assert a1.usage.prompt_tokens > 100
    assert a1.usage.prompt_tokens_details.cached_tokens == 0
    # same long system prompt (and same user message) from another tenant: no hit
    b1 = ask(bob, system, "Hello", extra_body={"cache_salt": "anything"})
    assert b1.usage.prompt_tokens == a1.usage.prompt_tokens
    assert b1.usage.prompt_tokens_details.cached_tokens == 0
    # a second session of the same tenant hits
    a2 = ask(alice, system, "Good morning", extra_body={"session_id": uuid.uuid4().hex})
    assert a2.usage.prompt_tokens_details.cached_tokens >= a1.usage.prompt_tokens - 40
    b2 = ask(bob, system, "Good evening")
    assert b2.usage.prompt_tokens_details.cached_tokens >= b1.usage.prompt_tokens - 40
    alice.close()
    bob.close()


def test_warm_system_prompt_is_cached_from_the_first_request(server):
    r = ask(sdk(server, "alice"), WARM_PROMPT, "Hi")
    assert r.usage.prompt_tokens_details.cached_tokens >= 32
    # ... for its tenant only
    r = ask(sdk(server, "bob"), WARM_PROMPT, "Hi")
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def _is_429(r: httpx.Response) -> bool:
    if r.status_code != 429:
        return False
    body = r.json()
    assert body["error"]["type"] == "rate_limit_error"
    assert int(r.headers["Retry-After"]) >= 1
    return True


def test_requests_per_minute_limit(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    statuses = []
    for _ in range(4):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth("limited"),
                       timeout=60)
        statuses.append(r.status_code)
    assert statuses[:3] == [200, 200, 200]
    assert _is_429(r)
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    # the SDK sees a RateLimitError
    try:
        sdk(server, "limited").chat.completions.create(model=MODEL, messages=body["messages"],
                                                       max_tokens=1)
    except openai.RateLimitError as e:
        assert e.status_code == 429
    else:
        raise AssertionError("expected a RateLimitError")
    # other tenants are not affected
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth("bob"),
                   timeout=60)
    assert r.status_code == 200


def test_concurrent_streams_limit(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write an essay."}],
            "max_tokens": 300, "ignore_eos": True, "stream": True}
    started = threading.Event()
    release = threading.Event()

    def long_stream():
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          headers=auth("single"), timeout=60) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                started.set()
                if release.is_set():
                    break

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        assert started.wait(60)
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False},
                       headers=auth("single"), timeout=60)
        assert _is_429(r)
        assert "concurrent" in r.json()["error"]["message"]

        async def ws_try():
            async with websockets.connect(
                    server.ws_url, subprotocols=["chatgate", f"bearer.{KEYS['single']}"]) as ws:
                await ws.send(json.dumps({"type": "session.create"}))
                await ws.recv()
                await ws.send(json.dumps({"type": "message", "content": "hi"}))
                return json.loads(await ws.recv())

        ev = asyncio.run(ws_try())
        assert ev["type"] == "error" and ev["code"] == "rate_limit_exceeded"
        assert ev["retry_after"] >= 1
    finally:
        release.set()
        t.join(60)
    deadline = time.monotonic() + 10
    while True:  # the slot comes back once the stream is gone
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={**body, "stream": False, "max_tokens": 1}, headers=auth("single"),
                       timeout=60)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200


def test_tokens_per_minute_limit(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello to me."}],
            "max_tokens": 20, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth("tokens"),
                   timeout=60)
    assert r.status_code == 200
    assert r.json()["usage"]["total_tokens"] >= 40  # over the tenant's 40 tokens per minute
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth("tokens"),
                   timeout=60)
    assert _is_429(r)
    assert "tokens per minute" in r.json()["error"]["message"]
