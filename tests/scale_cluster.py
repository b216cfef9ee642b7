"""Test machinery: a scale-out deployment on loopback, shared by ``tests/scale``,
``tests/deploy`` and ``benchmarks/failover.py`` (tests/ is on pytest's path through
tests/conftest.py; the benchmark appends it):
one private ``redis-server`` on a free port, N ``chatgate serve`` replicas, and HAProxy running
``deploy/haproxy.cfg`` with the replicas in place of its ``server-template`` line.

Each replica is its own process group (gateway + engine process), so ``Replica.kill`` is a
replica's sudden death: SIGKILL to both, no shutdown code runs. Also here: one streamed chat turn
through the balancer (``stream_turn``), as a client sees it."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
HAPROXY_TEMPLATE = ROOT / "deploy" / "haproxy.cfg"
START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render_haproxy_config(template: str, servers: dict[str, str]) -> str:
    """``template`` with its ``server-template`` line replaced by one ``server NAME ADDRESS``
    line per entry of ``servers`` and its Docker DNS ``resolvers`` section dropped; everything
    else (hashing, health checks, timeouts) stays as written."""
    lines: list[str] = []
    in_resolvers = False
    for line in template.splitlines():
        if line.startswith("resolvers "):
            in_resolvers = True
            continue
        if in_resolvers:
            if line.strip() and not line[0].isspace():
                in_resolvers = False
            else:
                continue
        if line.strip().startswith("server-template "):
            indent = line[: len(line) - len(line.lstrip())]
            lines += [f"{indent}server {name} {address}" for name, address in servers.items()]
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"


class Replica:
    """One ``chatgate serve --replica-id ID`` on a fixed loopback port."""

    def __init__(self, replica_id: str, args: list[str], log_dir: Path) -> None:
        self.id = replica_id
        self.port = free_port()
        self.args = args
        self.log_path = log_dir / f"{replica_id}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "chatgate", "serve", "--host", "127.0.0.1",
                 "--port", str(self.port), "--replica-id", self.id, *self.args],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)

    def wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.id} exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"replica {self.id} did not become ready:\n{self.log()}")

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-4000:]
        return ""

    def kill(self) -> float:
        """SIGKILL the gateway and its engine process at once; returns the time.monotonic()
        of the kill."""
        assert self.proc is not None
        killed_at = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        return killed_at

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):  # an engine process left behind
            os.killpg(self.proc.pid, signal.SIGKILL)


class Cluster:
    """``n`` replicas + HAProxy + a private Redis, all on loopback. ``replica_args`` are extra
    ``chatgate serve`` flags for every replica."""

    def __init__(self, work_dir: Path, n: int = 3, replica_args: list[str] | None = None,
                 redis_prefix: str = "chatgate-scale") -> None:
        self.dir = work_dir
        self.redis_port = free_port()
        self.redis_prefix = redis_prefix
        self.lb_port = free_port()
        self.stats_port = free_port()
        args = ["--redis-url", self.redis_url, "--redis-prefix", redis_prefix,
                *(replica_args or [])]
        self.replicas = [Replica(f"r{i}", args, work_dir) for i in range(n)]
        self._redis: subprocess.Popen | None = None
        self._haproxy: subprocess.Popen | None = None

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.lb_port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.lb_port}/v1/ws"

    def replica(self, replica_id: str) -> Replica:
        return next(r for r in self.replicas if r.id == replica_id)

    def start(self) -> Cluster:
        """Start everything and wait until HAProxy sees every replica up; on failure, stop
        what was started."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self._redis = subprocess.Popen(
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "yes", "--appendfsync", "always",
             "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for r in self.replicas:
            r.launch()
        config = self.dir / "haproxy.cfg"
        config.write_text(render_haproxy_config(
            HAPROXY_TEMPLATE.read_text(), {r.id: f"127.0.0.1:{r.port}" for r in self.replicas}))
        env = {**os.environ, "CHATGATE_LB_BIND": f"127.0.0.1:{self.lb_port}",
               "HAPROXY_STATS_BIND": f"127.0.0.1:{self.stats_port}"}
        with (self.dir / "haproxy.log").open("ab") as log:
            self._haproxy = subprocess.Popen(["haproxy", "-db", "-f", str(config)], env=env,
                                             stdout=log, stderr=subprocess.STDOUT)
        for r in self.replicas:
            r.wait_ready()
        for r in self.replicas:
            self.wait_state(r.id, "UP")

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()
        for proc in (self._haproxy, self._redis):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=20)

    def server_states(self) -> dict[str, str]:
        """HAProxy's view: replica id → ``UP``, ``DOWN``, ... (from its CSV stats)."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {row["svname"]: row["status"].split()[0] for row in rows
                if row["pxname"] == "gateways" and row["svname"] not in ("FRONTEND", "BACKEND")}

    def wait_state(self, replica_id: str, state: str, timeout: float = 60.0) -> float:
        """Wait until HAProxy reports the replica in ``state``; returns time.monotonic()."""
        deadline = time.monotonic() + timeout
        while True:
            assert self._haproxy is not None
            if self._haproxy.poll() is not None:
                raise RuntimeError("haproxy exited:\n"
                                   + (self.dir / "haproxy.log").read_text(errors="replace"))
            seen = self.server_states().get(replica_id)
            if seen == state:
                return time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError(f"HAProxy reports {replica_id} {seen}, not {state}")
            time.sleep(0.05)


# ------------------------------------------------------------------ one turn, as a client sees it

@dataclass
class TurnResult:
    """One streamed chat turn. ``acknowledged``: the stream delivered its finish (the gateway
    stores a session turn before that), usage and ``[DONE]``."""

    replica: str | None = None
    status: int = 0
    answer: str = ""
    acknowledged: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    sent_at: float = 0.0
    first_content_at: float | None = None
    ended_at: float = 0.0
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        """Seconds from sending the turn to its first content."""
        return None if self.first_content_at is None else self.first_content_at - self.sent_at

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the replica computed (not served from its KV cache)."""
        return self.prompt_tokens - self.cached_tokens


@dataclass
class ChatSession:
    """A client's conversation: the messages of its acknowledged turns."""

    id: str
    messages: list[dict[str, str]] = field(default_factory=list)
    replicas: list[str | None] = field(default_factory=list)  # per turn, as answered


async def stream_turn(client: httpx.AsyncClient, url: str, session: ChatSession, user: str,
                      max_tokens: int, started: asyncio.Event | None = None,
                      ignore_eos: bool = True) -> TurnResult:
    """Send ``user`` as the session's next turn (SSE, ``X-Session-Id``, greedy) and read the
    stream to its end; an acknowledged turn is added to ``session.messages``. ``started`` is
    set at the first content delta. Never raises for a failed turn: the result says what
    happened."""
    messages = [*session.messages, {"role": "user", "content": user}]
    body = {"model": "smollm2", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
    result = TurnResult(sent_at=time.monotonic())
    finished = False
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"X-Session-Id": session.id}) as r:
            result.status = r.status_code
            result.replica = r.headers.get("x-chatgate-replica")
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        result.acknowledged = finished and result.error is None
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        result.error = event["error"].get("code") or "error"
                        continue
                    for choice in event["choices"]:
                        text = choice["delta"].get("content")
                        if text:
                            result.answer += text
                            if result.first_content_at is None:
                                result.first_content_at = time.monotonic()
                                if started is not None:
                                    started.set()
                        if choice.get("finish_reason"):
                            finished = True
                    if event.get("usage"):
                        result.prompt_tokens = event["usage"]["prompt_tokens"]
                        result.cached_tokens = event["usage"]["prompt_tokens_details"][
                            "cached_tokens"]
                        result.completion_tokens = event["usage"]["completion_tokens"]
                if not result.acknowledged and result.error is None:
                    result.error = "stream ended without [DONE]"
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    result.ended_at = time.monotonic()
    session.replicas.append(result.replica)
    if result.acknowledged:
        session.messages = [*messages, {"role": "assistant", "content": result.answer}]
    return result


def stored_messages(cluster: Cluster, session_id: str) -> list[dict[str, str]]:
    """The session's history as the shared Redis holds it (read through the balancer)."""
    r = httpx.get(f"{cluster.url}/v1/sessions/{session_id}", timeout=30)
    if r.status_code == 404:
        return []
    r.raise_for_status()
    return [{"role": m["role"], "content": m["content"]} for m in r.json()["messages"]]


def haproxy_available() -> bool:
    return shutil.which("haproxy") is not None

