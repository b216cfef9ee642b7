"""Helpers of the browser tests: a real `chatgate serve` (SmolLM2 on CPU) on a free loopback
port, and HTTP GETs against it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


@contextmanager
def serve(tmp: Path, args: list[str]) -> Iterator[str]:
    """`chatgate serve` with ``args`` added; yields its base URL once /healthz answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "chatgate.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--model", "smollm2", "--device", "cpu",
           "--max-model-len", "2048", "--max-num-seqs", "4", "--log-level", "warning", *args]
    log_path = tmp / "server.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"chatgate serve exited ({proc.returncode}):\n"
                            f"{log_path.read_text()[-4000:]}")
            try:
                if get(base + "healthz")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"chatgate serve not ready in 300 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
