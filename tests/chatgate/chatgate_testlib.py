"""Helpers for the gateway tests: real ``chatgate serve`` subprocesses on free loopback ports,
backed by the real engine (SmolLM2-135M on CPU) and the real Redis at 127.0.0.1:6379 (unique
key prefix per run, deleted afterwards)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("CHATGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
START_TIMEOUT_S = 300

KEYS = {
    "alice": "sk-alice-0123456789",
    "bob": "sk-bob-0123456789",
    "limited": "sk-limited-0123456789",
    "single": "sk-single-0123456789",
    "tokens": "sk-tokens-0123456789",
}
WARM_PROMPT = "You are Warmy, a concise assistant for chatgate's warm-up test. " * 4
ALLOWED_ORIGIN = "http://allowed.example"
MAX_MODEL_LEN = 1024
REPLICA_ID = "replica-under-test"
MAX_REQUEST_BYTES = 65536
WS_MAX_MESSAGE_BYTES = 16384


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Server:
    """One ``python -m chatgate serve`` process."""

    def __init__(self, args: list[str], log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    def start(self) -> Server:
        env = dict(os.environ)
        extra = os.environ.get("CHATGATE_TEST_PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, str(REPO),
                                                        env.get("PYTHONPATH")) if p)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chatgate", "serve", "--port", str(self.port), *self.args],
            cwd=str(REPO), stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chatgate exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"chatgate did not become ready:\n{self.log()}")

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-6000:]
        return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if getattr(self, "_log", None):
            self._log.close()

    # -------------------------------------------------------------- helpers
    def health(self) -> dict:
        r = httpx.get(self.url + "/healthz", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def engine_stats(self) -> dict:
        return self.health()["engine"]

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: ``name{labels}`` → value, plus ``name`` → sum."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, val = line.rpartition(" ")
            out[key] = float(val)
            name = key.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(val) if name != key else float(val)
        return out

    def wait_idle(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = self.engine_stats()
            if s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle: {s}")
            time.sleep(0.05)

    def assert_no_leak(self) -> None:
        """Nothing running, and every used block is held by a pinned session."""
        s = self.wait_idle()
        assert s["num_blocks_used"] <= s["num_pinned_blocks"], s


class PrivateRedis:
    """A ``redis-server`` of the test's own on a free port, with AOF (``appendfsync always``),
    that the test may stop, kill and restart (the shared one on 6379 is never touched)."""

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

    def kill(self) -> None:
        """SIGKILL: no shutdown save; only what the AOF already holds survives."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=20)


def redis_delete_prefix(prefix: str) -> None:
    r = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(r.scan_iter(match=f"{prefix}:*", count=500))
        if keys:
            r.delete(*keys)
    finally:
        r.close()



def auth(tenant: str) -> dict[str, str]:
    """The tenant's key, and the JSON content type that every request with a body needs."""
    return {"Authorization": f"Bearer {KEYS[tenant]}", "Content-Type": "application/json"}
