"""Sessions live in Redis under the tenant's prefix with a TTL, survive a gateway
restart, and the next turn continues with the full history. Plus the ``SessionStore``
contract, for both implementations."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
import redis
import redis.asyncio as aioredis
import websockets
from chatgate_testlib import REDIS_URL, Server, redis_delete_prefix

from chatgate.sessions import MemorySessionStore, RedisSessionStore

TTL = 3600


# ------------------------------------------------------------------ store contract
@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        yield MemorySessionStore(TTL)
        return
    prefix = f"chatgate-unit-{uuid.uuid4().hex[:10]}"
    s = RedisSessionStore(REDIS_URL, TTL, prefix)
    try:
        yield s
    finally:
        await s.close()
        redis_delete_prefix(prefix)


async def test_store_round_trip(store):
    rec = await store.create("t1", "s1", "be nice")
    assert rec.id == "s1" and rec.system == "be nice" and rec.messages == []
    await store.append("t1", "s1", [{"role": "user", "content": "Hello   there\nfriend"}])
    await store.append("t1", "s1", [{"role": "assistant", "content": "Hi! ünïcödé ✓"}])
    got = await store.get("t1", "s1")
    assert got.messages == [{"role": "user", "content": "Hello   there\nfriend"},
                            {"role": "assistant", "content": "Hi! ünïcödé ✓"}]
    assert got.num_messages == 2 and got.title == "Hello there friend"
    assert got.system == "be nice" and got.updated >= got.created
    assert got.chat_messages()[0] == {"role": "system", "content": "be nice"}
    # tenant scoping
    assert await store.get("t2", "s1") is None
    assert await store.list("t2") == []
    assert not await store.delete("t2", "s1")
    await store.create("t1", "s2", None)
    ids = [r.id for r in await store.list("t1")]
    assert ids == ["s2", "s1"]  # most recently updated first
    # replace (regenerate / SSE upsert) keeps created, rewrites history
    rep = await store.replace("t1", "s1", "be brief", [{"role": "user", "content": "Q"}])
    assert rep.created == pytest.approx(got.created) and rep.num_messages == 1
    got = await store.get("t1", "s1")
    assert got.system == "be brief" and got.messages == [{"role": "user", "content": "Q"}]
    assert await store.delete("t1", "s1")
    assert await store.get("t1", "s1") is None
    assert [r.id for r in await store.list("t1")] == ["s2"]
    with pytest.raises(KeyError):
        await store.append("t1", "missing", [{"role": "user", "content": "x"}])


async def test_store_keeps_answer_stats_and_lists_by_scope(store):
    """An answer's usage, timings and finish reason are kept with it, and a reset of the
    session by ``create`` keeps its new scope; listing by scope returns that scope's sessions
    only."""
    answer = {"role": "assistant", "content": "Paris.", "finish_reason": "stop",
              "usage": {"prompt_tokens": 20, "cached_tokens": 16, "completion_tokens": 3},
              "timings": {"ttft_ms": 41.5, "tokens_per_s": 12.25}}
    await store.create("t1", "mine", None, scope="browser-1")
    await store.create("t1", "other", None, scope="browser-2")
    await store.create("t1", "sdk", None)
    await store.replace("t1", "mine", None, [{"role": "user", "content": "Capital?"}, answer])
    got = await store.get("t1", "mine")
    assert got.messages[1] == answer and got.scope == "browser-1"
    got.messages[1]["usage"]["cached_tokens"] = 0  # a copy: the stored answer is unchanged
    assert (await store.get("t1", "mine")).messages[1] == answer
    assert [r.id for r in await store.list("t1", scope="browser-1")] == ["mine"]
    assert [r.id for r in await store.list("t1", scope="browser-2")] == ["other"]
    assert {r.id for r in await store.list("t1")} == {"mine", "other", "sdk"}
    assert await store.list("t2", scope="browser-1") == []


async def test_memory_store_expires():
    s = MemorySessionStore(0.2)
    await s.create("t", "a", None)
    assert await s.get("t", "a") is not None
    await asyncio.sleep(0.3)
    assert await s.get("t", "a") is None
    assert await s.list("t") == []


async def test_redis_layout_ttl_and_transactions():
    prefix = f"chatgate-unit-{uuid.uuid4().hex[:10]}"
    s = RedisSessionStore(REDIS_URL, 100, prefix)
    r = aioredis.from_url(REDIS_URL, decode_responses=True)
    try:
        await s.create("acme", "x1", "sys")
        await s.append("acme", "x1", [{"role": "user", "content": "hi"}])
        meta = f"{prefix}:acme:session:x1"
        assert await r.type(meta) == "hash"
        assert await r.type(meta + ":messages") == "list"
        assert await r.type(f"{prefix}:acme:sessions") == "zset"
        for key in (meta, meta + ":messages", f"{prefix}:acme:sessions"):
            assert 0 < await r.ttl(key) <= 100
        await r.expire(meta, 5)
        await s.get("acme", "x1")  # use refreshes the TTL
        assert await r.ttl(meta) > 50
        # expired sessions drop out of the index
        await r.delete(meta, meta + ":messages")
        assert await s.list("acme") == []
        assert await r.zcard(f"{prefix}:acme:sessions") == 0
    finally:
        await s.close()
        await r.aclose()
        redis_delete_prefix(prefix)


# ------------------------------------------------------------------ gateway restart
async def _turn(ws, content: str) -> dict:
    await ws.send(json.dumps({"type": "message", "content": content,
                              "params": {"temperature": 0, "max_tokens": 10}}))
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), 120))
        if ev["type"] == "done":
            return ev
        assert ev["type"] == "delta", ev


@pytest.mark.slow
def test_history_survives_a_gateway_restart(tmp_path):
    prefix = f"chatgate-restart-{uuid.uuid4().hex[:10]}"
    args = ["--redis-url", REDIS_URL, "--redis-prefix", prefix, "--session-ttl", "600",
            "--max-model-len", "1024"]
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    first = Server(args, tmp_path / "first.log").start()
    try:
        async def conversation():
            async with websockets.connect(first.ws_url) as ws:
                await ws.send(json.dumps({"type": "session.create", "system": "Be brief."}))
                sid = json.loads(await ws.recv())["id"]
                d1 = await _turn(ws, "My favourite colour is green.")
                d2 = await _turn(ws, "What is two plus two?")
                return sid, d1, d2

        sid, d1, d2 = asyncio.run(conversation())
        meta_key = f"{prefix}:local:session:{sid}"
        meta = r.hgetall(meta_key)
        assert meta["system"] == "Be brief." and meta["num_messages"] == "4"
        assert meta["title"] == "My favourite colour is green."
        msgs = [json.loads(m) for m in r.lrange(meta_key + ":messages", 0, -1)]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
        for key in (meta_key, meta_key + ":messages", f"{prefix}:local:sessions"):
            assert 0 < r.ttl(key) <= 600
        assert r.zscore(f"{prefix}:local:sessions", sid) is not None
    finally:
        first.stop()

    second = Server(args + ["--session-idle-unpin", "1"], tmp_path / "second.log").start()
    try:
        async def resume():
            async with websockets.connect(second.ws_url) as ws:
                await ws.send(json.dumps({"type": "session.resume", "session_id": sid}))
                ev = json.loads(await ws.recv())
                assert ev["type"] == "session" and ev["messages"] == msgs
                return await _turn(ws, "What is my favourite colour?")

        d3 = asyncio.run(resume())
        history_tokens = d2["usage"]["prompt_tokens"] + d2["usage"]["completion_tokens"]
        # the new process re-prefills the whole history (no pin survived) ...
        assert d3["usage"]["prompt_tokens"] >= history_tokens
        assert d3["usage"]["cached_tokens"] < history_tokens - 16
        stored = httpx.get(f"{second.url}/v1/sessions/{sid}").json()
        assert len(stored["messages"]) == 6
        assert stored["messages"][:4] == msgs
        # ... and the idle session is unpinned after --session-idle-unpin, history kept
        assert second.engine_stats()["num_pinned_sessions"] >= 1
        deadline = time.monotonic() + 10
        while second.engine_stats()["num_pinned_sessions"] > 0:
            assert time.monotonic() < deadline, "idle session was not unpinned"
            time.sleep(0.2)
        assert len(httpx.get(f"{second.url}/v1/sessions/{sid}").json()["messages"]) == 6
    finally:
        second.stop()
        r.close()
        redis_delete_prefix(prefix)
