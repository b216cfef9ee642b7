"""The console of a real ``chatgate serve`` whose stderr is a log file, not a terminal: every line
of a start, a mix of requests and a SIGTERM in one format (the gateway's, uvicorn's and the
engine process's alike), no progress bars, a kernel build line only with a build (the suite
builds the kernels at its start), no ``nanobind: leaked`` dump at exit; ``--log-level debug``
keeps the detail."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from chatgate_testlib import Server
from websockets.sync.client import connect

LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                  r"[\w.]+: \S.*")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
          "required": ["city"], "additionalProperties": False}


def chat(url: str, stream: bool, **extra: object) -> None:
    with httpx.Client(timeout=120) as client:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Name a city."}],
                "max_tokens": 8, "stream": stream, **extra}
        r = client.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text


def websocket_turns(ws_url: str, turns: int) -> None:
    with connect(ws_url) as ws:
        ws.send(json.dumps({"type": "session.create"}))
        assert json.loads(ws.recv())["type"] == "session"
        for _ in range(turns):
            ws.send(json.dumps({"type": "message", "content": "Hi",
                                "params": {"max_tokens": 8}}))
            while (event := json.loads(ws.recv()))["type"] == "delta":
                pass
            assert event["type"] == "done", event


def serve_and_stop(args: list[str], log: Path, requests: int) -> list[str]:
    """The log lines of a server that answered ``requests`` requests (SSE, JSON, a JSON schema,
    WebSocket turns), then was stopped by SIGTERM."""
    srv = Server(args, log).start()
    try:
        sse, websocket = (requests - 1) // 2, (requests - 1) // 4
        for i in range(requests - 1 - websocket):
            chat(srv.url, stream=i < sse)
        chat(srv.url, stream=False, max_tokens=40, response_format={
            "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
        websocket_turns(srv.ws_url, websocket)
    finally:
        srv.proc.terminate()
        assert srv.proc.wait(timeout=60) == 0, srv.log()
        srv.stop()
    return log.read_text(errors="replace").splitlines()


def test_the_log_of_a_start_requests_and_sigterm_is_one_format_and_quiet(tmp_path: Path) -> None:
    lines = serve_and_stop([], tmp_path / "server.log", requests=20)
    odd = [line for line in lines if not LINE.fullmatch(line)]
    assert not odd, "lines not in the log format:\n" + "\n".join(odd[:30])
    text = "\n".join(lines)
    assert "uvicorn.error: Uvicorn running on" in text  # uvicorn's lines, in our format
    assert "engine.core: engine ready" in text  # the engine process's, too
    kernels = [line for line in lines if " INFO chatgate_kernels.cpu_native: " in line]
    assert not kernels or "fused CPU kernels built in" in kernels[-1], kernels  # a build only
    assert "nanobind" not in text


def test_debug_keeps_the_detail(tiny_model: str, tmp_path: Path) -> None:
    lines = serve_and_stop(["--model", tiny_model, "--log-level", "debug"],
                           tmp_path / "server.log", requests=4)
    text = "\n".join(lines)
    assert re.search(r" (DEBUG|INFO) chatgate_kernels\.cpu_native: fused CPU kernels "
                     r"(loaded from \S+|built) in ", text)
    assert re.search(r' INFO uvicorn\.access: 127\.0\.0\.1:\d+ - "POST /v1/chat/completions '
                     r'HTTP/1\.1" 200', text)
    assert re.search(r" DEBUG engine\.", text)
    assert "nanobind" not in text
