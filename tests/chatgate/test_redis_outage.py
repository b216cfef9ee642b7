"""The gateway against its own Redis (AOF on, like docker compose) that is stopped and
restarted: the gateway stays up and answers 503 ``store_unavailable`` while Redis is down,
then reconnects; the sessions survive the Redis restart through the AOF."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import pytest
import websockets
from chatgate_testlib import PrivateRedis, Server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


def test_gateway_survives_a_redis_restart(tmp_path):
    rds = PrivateRedis(tmp_path)
    rds.start()
    srv = None
    try:
        srv = Server(["--redis-url", rds.url, "--max-model-len", "512"],
                     tmp_path / "gw.log").start()
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi!"}],
                "max_tokens": 4, "temperature": 0, "session_id": "survivor"}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200
        assert len(httpx.get(srv.url + "/v1/sessions/survivor").json()["messages"]) == 2

        rds.stop()
        r = httpx.get(srv.url + "/v1/sessions", timeout=30)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "store_unavailable"
        assert httpx.get(srv.url + "/healthz", timeout=30).json()["session_store_ok"] is False

        async def ws_while_down():
            async with websockets.connect(srv.ws_url) as ws:
                await ws.send(json.dumps({"type": "session.create"}))
                ev = json.loads(await ws.recv())
                assert ev["type"] == "error" and ev["code"] == "store_unavailable"
                await ws.send(json.dumps({"type": "nope"}))  # the socket stays open
                assert json.loads(await ws.recv())["code"] == "unknown_event"

        asyncio.run(ws_while_down())

        rds.start()  # same dir: the AOF brings the data back
        deadline = time.monotonic() + 20
        while True:
            r = httpx.get(srv.url + "/v1/sessions/survivor", timeout=30)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200
        assert [m["role"] for m in r.json()["messages"]] == ["user", "assistant"]
        assert srv.health()["session_store_ok"] is True
        srv.assert_no_leak()
    finally:
        if srv is not None:
            srv.stop()
        rds.stop()
