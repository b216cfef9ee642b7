"""``chatgate serve`` runs the engine in a child process: it starts with it, reports its startup
error, ends every open stream cleanly within 1 s when it dies (SSE error event, WebSocket
``error`` frame, /healthz 503, then a non-zero exit), and leaves no process behind on SIGTERM
or a Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest
import websockets
from chatgate_testlib import REDIS_URL, Server, redis_delete_prefix

from chatgate.server import SHUTDOWN_TIMEOUT_S

LONG = {"model": "smollm2", "messages": [{"role": "user", "content": "Write a long essay."}],
        "max_tokens": 2000, "ignore_eos": True, "stream": True, "temperature": 0}


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def alive(pid: int) -> bool:
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def engine_pid(server: Server) -> int:
    (pid,) = [p for p in children(server.proc.pid) if "engine.core" in cmdline(p)]
    return pid


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid):
        assert time.monotonic() < deadline, f"process {pid} ({cmdline(pid)}) still running"
        time.sleep(0.05)


@pytest.fixture
def own_server(tmp_path: Path):
    srv = Server(["--num-kv-blocks", "256", "--max-model-len", "4096"], tmp_path / "server.log")
    srv.start()
    yield srv
    srv.stop()


async def _first_tokens_sse(client: httpx.AsyncClient, url: str, lines: list[str],
                            started: asyncio.Event) -> float:
    """Read an SSE stream to its end; return when it ended (monotonic)."""
    async with client.stream("POST", url + "/v1/chat/completions", json=LONG) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) >= 3:
                    started.set()
    return time.monotonic()


@pytest.mark.asyncio
async def test_a_dead_engine_ends_every_stream_and_the_server(own_server: Server) -> None:
    pid = engine_pid(own_server)
    lines: list[str] = []
    started = asyncio.Event()
    async with httpx.AsyncClient(timeout=60) as client:
        sse = asyncio.create_task(_first_tokens_sse(client, own_server.url, lines, started))
        ws = await websockets.connect(own_server.ws_url)
        await ws.send(json.dumps({"type": "session.create"}))
        assert json.loads(await ws.recv())["type"] == "session"
        await ws.send(json.dumps({"type": "message", "content": "Tell me a long story.",
                                  "params": {"max_tokens": 2000, "ignore_eos": True}}))
        assert json.loads(await ws.recv())["type"] == "delta"
        await asyncio.wait_for(started.wait(), 60)

        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        sse_ended = await asyncio.wait_for(sse, 5)
        while (event := json.loads(await asyncio.wait_for(ws.recv(), 5)))["type"] == "delta":
            pass
        ws_error_at = time.monotonic()
        health = await client.get(own_server.url + "/healthz")

    assert sse_ended - killed < 1.0 and ws_error_at - killed < 1.0
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["code"] == "engine_unavailable" and "exited" in error["message"]
    assert event["type"] == "error" and event["code"] == "engine_unavailable"
    assert health.status_code == 503 and health.json()["status"] == "engine_dead"
    assert own_server.proc.wait(timeout=30) != 0  # the server exits, non-zero
    await ws.close()


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_stopping_the_server_leaves_no_process(own_server: Server, how: str) -> None:
    server_pid = own_server.proc.pid
    pid = engine_pid(own_server)
    if how == "sigterm":
        own_server.proc.terminate()
    else:  # a terminal's Ctrl-C reaches every process of the foreground group
        os.kill(server_pid, signal.SIGINT)
        os.kill(pid, signal.SIGINT)  # the engine ignores it and is stopped by the gateway
    # uvicorn shuts down in order; a clean shutdown exits 0, however it was asked for
    assert own_server.proc.wait(timeout=60) == 0
    assert "Application shutdown complete" in own_server.log()
    assert "Traceback" not in own_server.log()
    wait_gone(pid, timeout=5)


def test_a_startup_failure_prints_the_engine_error(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    srv = Server(["--model", "/no/such/model"], log)
    with pytest.raises(RuntimeError, match="exited with"):
        srv.start()
    srv.stop()
    text = log.read_text()
    assert "is not a known model name or an existing model path" in text
    assert "EngineStartupError" in text
    assert srv.proc.returncode != 0


def test_killing_the_gateway_takes_the_engine_down(own_server: Server) -> None:
    pid = engine_pid(own_server)
    own_server.proc.send_signal(signal.SIGKILL)
    own_server.proc.wait()
    wait_gone(pid, timeout=5)


def test_a_tensor_parallel_server_answers_and_a_dead_worker_stops_it(tmp_path: Path) -> None:
    """``--tensor-parallel-size 3`` (SmolLM2 over three Gloo ranks) answers as one process
    does; when a worker dies the engine process fails its requests and exits, the gateway
    reports the engine dead and exits non-zero, and no worker is left behind."""
    srv = Server(["--tensor-parallel-size", "3", "--quantization", "none",
                  "--num-kv-blocks", "256", "--max-model-len", "2048"], tmp_path / "tp.log")
    srv.start()
    try:
        engine = engine_pid(srv)
        workers = children(engine)
        assert len(workers) >= 2  # ranks 1 and 2 (and the spawn helper, if any)
        body = {"model": "smollm2", "temperature": 0, "max_tokens": 12,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        answer = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120).json()
        assert "Paris" in answer["choices"][0]["message"]["content"]

        rank = [p for p in workers if "spawn_main" in cmdline(p)][-1]  # not resource_tracker
        os.kill(rank, signal.SIGKILL)
        assert srv.proc.wait(timeout=60) != 0
        assert "a tensor-parallel worker exited; the engine stops" in srv.log()
        for pid in [engine, *workers]:
            wait_gone(pid, timeout=15)
    finally:
        srv.stop()


def test_sigterm_ends_streams_that_outlast_the_grace_period_with_an_in_band_503(
        tiny_model: str, tmp_path: Path) -> None:
    """Streams still open ``STREAM_GRACE_S`` after SIGTERM end with a 503
    ``server_shutting_down`` error chunk and ``[DONE]`` (their requests aborted), before
    uvicorn's graceful timeout would cancel them: exit code 0, no error logged."""
    srv = Server(["--model", tiny_model, "--served-model-name", "tiny", "--max-num-seqs", "1"],
                 tmp_path / "server.log").start()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 3000, "ignore_eos": True, "stream": True}
    try:
        async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> list[str]:
            async with client.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                lines = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        started.set()
                return lines

        async def terminate_during_streams() -> tuple[list[list[str]], float]:
            started = asyncio.Event()
            async with httpx.AsyncClient(timeout=120) as client:
                # one runs, three wait: 12,000 tokens, far longer than the grace period
                streams = [asyncio.create_task(stream(client, started)) for _ in range(4)]
                await started.wait()
                began = time.monotonic()
                srv.proc.terminate()
                ended = await asyncio.gather(*streams)
                return ended, time.monotonic() - began

        ended, seconds = asyncio.run(terminate_during_streams())
        assert srv.proc.wait(timeout=60) == 0, srv.log()
        cut = [lines for lines in ended if "server_shutting_down" in "".join(lines[-2:-1])]
        assert cut, ended
        for lines in ended:
            assert lines[-1] == "[DONE]"
        for lines in cut:
            error = json.loads(lines[-2])["error"]
            assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
        assert seconds < SHUTDOWN_TIMEOUT_S
        log = srv.log()
        assert f"ended {len(cut)} open stream(s)" in log
        assert "Traceback" not in log and " ERROR " not in log, log
    finally:
        srv.stop()


def test_a_session_turn_ended_by_shutdown_is_stored_as_cut(tiny_model: str,
                                                            tmp_path: Path) -> None:
    """A session turn still streaming when the shutdown grace period ends keeps its user
    message and the answer so far, marked cut, as a turn its client cancelled does."""
    prefix = f"chatgate-test-{uuid.uuid4().hex[:12]}"
    flags = ["--model", tiny_model, "--served-model-name", "tiny", "--redis-url", REDIS_URL,
             "--redis-prefix", prefix]
    sid = "cut-by-shutdown"
    body = {"model": "tiny", "session_id": sid, "max_tokens": 3900, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": "Tell me a story."}]}
    srv = Server(flags, tmp_path / "first.log").start()
    try:
        text, events, terminated = "", [], False
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body,
                          timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if "choices" in line:
                    text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    if text and not terminated:
                        srv.proc.terminate()  # with the answer under way
                        terminated = True
        assert srv.proc.wait(timeout=60) == 0, srv.log()
        assert "server_shutting_down" in events[-2] and events[-1] == "[DONE]", events[-2:]
    finally:
        srv.stop()
    srv = Server(flags, tmp_path / "second.log").start()
    try:
        messages = httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=30).json()["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"], messages
        assert messages[1]["content"].startswith(text) and messages[1]["cut"] is True
    finally:
        srv.stop()
        redis_delete_prefix(prefix)


async def _load(url: str, ws_url: str, streams: int) -> None:
    """``streams`` SSE and as many WebSocket turns at once, each read to its end (or until
    the server goes away)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 64, "ignore_eos": True, "stream": True}

    async def sse(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_lines():
                pass

    async def ws_turn() -> None:
        async with websockets.connect(ws_url) as ws:
            await ws.send(json.dumps({"type": "session.create"}))
            await ws.send(json.dumps({"type": "message", "content": "Tell me a story.",
                                      "params": {"max_tokens": 64, "ignore_eos": True}}))
            while json.loads(await ws.recv())["type"] not in ("done", "error"):
                pass

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*[sse(client) for _ in range(streams)],
                             *[ws_turn() for _ in range(streams)], return_exceptions=True)


@pytest.mark.parametrize("when,to", [("during", "gateway"), ("right_after", "gateway"),
                                     ("during", "process_group")])
def test_sigterm_during_and_right_after_load_shuts_down_cleanly(tiny_model: str, tmp_path: Path,
                                                                 when: str, to: str) -> None:
    """Whatever the engine's queue holds, SIGTERM ends the gateway with exit code 0, no error
    logged, and the engine process stopped and reaped; also when the signal reaches the
    engine process too (a supervisor that signals the whole process group)."""
    srv = Server(["--model", tiny_model, "--served-model-name", "tiny",
                  "--max-num-seqs", "4"], tmp_path / "server.log").start()
    try:
        pid = engine_pid(srv)

        async def load_then_terminate() -> None:
            load = asyncio.create_task(_load(srv.url, srv.ws_url, streams=12))
            if when == "during":
                while (await asyncio.to_thread(srv.engine_stats))["num_requests_waiting"] == 0:
                    await asyncio.sleep(0.02)
            else:
                await load
            if to == "process_group":
                os.kill(pid, signal.SIGTERM)
            srv.proc.terminate()
            await load

        asyncio.run(load_then_terminate())
        assert srv.proc.wait(timeout=60) == 0, srv.log()
        log = srv.log()
        assert "Application shutdown complete" in log
        assert "Traceback" not in log and " ERROR " not in log, log
        wait_gone(pid, timeout=5)
    finally:
        srv.stop()
