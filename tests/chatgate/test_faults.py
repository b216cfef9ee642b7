"""Faults against real processes (a real ``chatgate serve``, real sockets, a Redis of the test's
own): a client that stops reading, slow-loris clients, 100 concurrent aborts, and Redis
SIGKILLed in the middle of a session turn, then restarted from its AOF. (The engine process
killed mid-stream is in ``test_engine_process.py``.) A tiny random-weight model keeps the
engine fast, so the gateway is what is exercised."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import socket
import time

import httpx
import pytest
from chatgate_testlib import PrivateRedis, Server

from chatgate.middleware import UNFINISHED

pytestmark = pytest.mark.slow

SEND_TIMEOUT_S = 2
BODY_TIMEOUT_S = 2
JSON_TYPE = {"Content-Type": "application/json"}


def body(**kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 8, **kw}


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(["--model", tiny_model, "--served-model-name", "tiny", "--max-model-len", "4096",
                  "--send-timeout", str(SEND_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S)],
                 tmp_path_factory.mktemp("faults") / "server.log").start()
    try:
        yield srv
    finally:
        srv.stop()


def raw_request(port: int, payload: dict, rcvbuf: int | None = None) -> socket.socket:
    """An HTTP/1.1 POST on a raw socket (optionally with a small receive buffer)."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(payload).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_client_that_stops_reading_is_dropped_and_its_blocks_freed(server):
    """The reader takes the headers and then nothing: once the socket buffers (megabytes on
    loopback) are full, the gateway's send waits; after --send-timeout it drops the connection
    and the engine request is aborted long before its 8 x 4,000 tokens are done (each with 20
    top logprobs, so that the buffers fill fast)."""
    sock = raw_request(server.port, body(max_tokens=4000, ignore_eos=True, stream=True, n=8,
                                         logprobs=True, top_logprobs=20), rcvbuf=4096)
    try:
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        wait_for(lambda: server.engine_stats()["num_requests_running"] == 1, 60, "the stream")
        stats = wait_for(lambda: (s := server.engine_stats())["num_requests_running"] == 0
                         and s, 120, "the stalled stream to be dropped")
        assert stats["num_blocks_used"] == 0, stats
        sock.settimeout(30)
        received = b""
        while chunk := sock.recv(1 << 16):  # what was buffered, then the server's close
            received += chunk
        assert b"data: [DONE]" not in received  # dropped, not finished
        assert received.count(b'"content":') < 8 * 4000
    finally:
        sock.close()
    log = server.log()
    assert "the client read nothing" in log
    assert UNFINISHED not in log  # uvicorn's error for an unfinished response: the drop's own
    r = httpx.post(server.url + "/v1/chat/completions", json=body(), timeout=60)
    assert r.status_code == 200


def test_slow_loris_clients_do_not_block_others(server):
    """Clients trickling their headers hold only their own sockets: a normal request is
    answered meanwhile. A client trickling its body gets 408 after --body-timeout."""
    loris = []
    try:
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            loris.append(s)
        for _ in range(3):
            for s in loris:
                s.sendall(b"a")
            r = httpx.post(server.url + "/v1/chat/completions", json=body(), timeout=60)
            assert r.status_code == 200
            time.sleep(0.2)
    finally:
        for s in loris:
            s.close()

    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{")
        sock.settimeout(30)
        started = time.monotonic()
        answer = b""
        for _ in range(100):  # one byte at a time, far slower than the deadline allows
            try:
                sock.sendall(b" ")
            except OSError:
                break
            sock.settimeout(0.5)
            try:
                answer += sock.recv(4096)
            except TimeoutError:
                continue
            if b"\r\n\r\n" in answer:
                break
        head, _, rest = answer.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        sock.settimeout(30)
        while len(rest) < length:
            rest += sock.recv(4096)
        answer = head + b"\r\n\r\n" + rest
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b'"request_timeout"' in answer
        assert time.monotonic() - started < 60
    finally:
        sock.close()
    server.assert_no_leak()


async def test_100_concurrent_aborts_leak_nothing(server):
    rng = random.Random(0)

    async def abandoned(client: httpx.AsyncClient) -> None:
        stop_after = rng.randint(0, 6)
        async with client.stream("POST", server.url + "/v1/chat/completions",
                                 json=body(max_tokens=500, ignore_eos=True, stream=True)) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= stop_after:
                    break

    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(abandoned(client) for _ in range(100)))
    stats = await asyncio.to_thread(server.wait_idle, 30)
    assert stats["num_blocks_used"] == 0, stats
    r = await asyncio.to_thread(httpx.post, server.url + "/v1/chat/completions", json=body(),
                                timeout=60)
    assert r.status_code == 200


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_redis_killed_mid_turn_loses_nothing_acknowledged(tiny_model, tmp_path):
    """A session turn streaming when Redis is SIGKILLed ends with a store_unavailable error
    event, not a finish; plain turns go on; new session turns get 503 before generating.
    After Redis restarts from its AOF, the session holds exactly the turns that were
    acknowledged, and the next turn is stored again."""
    rds = PrivateRedis(tmp_path)
    rds.start()
    srv = None
    try:
        srv = Server(["--model", tiny_model, "--served-model-name", "tiny",
                      "--redis-url", rds.url, "--max-model-len", "4096"],
                     tmp_path / "gw.log").start()
        url = srv.url + "/v1/chat/completions"
        first = [{"role": "user", "content": "Hello there."}]
        r = httpx.post(url, json=body(messages=first, session_id="s1"), timeout=60)
        assert r.status_code == 200
        answer = r.json()["choices"][0]["message"]["content"]
        history = first + [{"role": "assistant", "content": answer},
                           {"role": "user", "content": "Go on."}]

        events = []
        with httpx.stream("POST", url, json=body(messages=history, session_id="s1", stream=True,
                                                 max_tokens=3000, ignore_eos=True),
                          timeout=120) as stream:
            lines = stream.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                if len(events) >= 3:
                    break
            rds.kill()
            plain = httpx.post(url, json=body(), timeout=60)  # no session: unaffected
            assert plain.status_code == 200
            events += [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert "error" in events[-1] and events[-1]["error"]["code"] == "store_unavailable"
        assert not any(c.get("finish_reason") for e in events for c in e.get("choices", []))

        r = httpx.post(url, json=body(messages=first, session_id="s2"), timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"

        rds.start()  # the same dir: the AOF brings back what was stored
        stored = wait_for(lambda: (g := httpx.get(srv.url + "/v1/sessions/s1", timeout=30))
                          .status_code == 200 and g.json(), 30, "the session store")
        assert stored["messages"] == first + [{"role": "assistant", "content": answer}]
        assert httpx.get(srv.url + "/v1/sessions/s2", timeout=30).status_code == 404

        r = httpx.post(url, json=body(messages=history, session_id="s1"), timeout=60)
        assert r.status_code == 200
        messages = httpx.get(srv.url + "/v1/sessions/s1", timeout=30).json()["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
        srv.assert_no_leak()
    finally:
        if srv is not None:
            srv.stop()
        rds.stop()
