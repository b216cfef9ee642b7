"""The gateway against its own Redis (AOF on, like docker compose) that is stopped and
restarted: the gateway stays up and answers 503 ``store_unavailable`` while Redis is down,
then reconnects; the sessions survive the Redis restart through the AOF."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time

import httpx
import pytest
import redis
import websockets
from chatgate_testlib import Server, free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server"),
]


class PrivateRedis:
    def __init__(self, tmp_path) -> None:
        self.port = free_port()
        self.dir = tmp_path / "redis"
        self.dir.mkdir()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return
            except redis.RedisError:
                pass
            assert time.monotonic() < deadline, "private redis did not start"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)


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
