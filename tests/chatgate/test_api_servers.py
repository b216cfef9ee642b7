"""``chatgate serve --api-server-count 2``: two front-end processes accept on one port and share
one engine process. A keep-alive connection stays with the front-end that accepted it
(``X-Chatgate-Api-Server`` names it), so a test can send a session's turns to either one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from chatgate_testlib import REDIS_URL, Server, redis_delete_prefix
from prometheus_client.parser import text_string_to_metric_families
from test_gateway_process import mapped_heavy_libraries
from test_sessions import TURNS, check_reuse, recv_event, unique_system, ws_turn

from engine.launch import OPENMP_WAIT, openmp_wait

HEADER = "x-chatgate-api-server"
STREAM_INTERVAL = 3


def start_two_front_ends(log: Path, prefix: str | None) -> Server:
    """Two front-ends on Redis under ``prefix``, or (None) on the in-process store, streaming
    deltas of ``STREAM_INTERVAL`` tokens."""
    store = [] if prefix is None else ["--redis-url", REDIS_URL, "--redis-prefix", prefix]
    return Server(["--api-server-count", "2", *store, "--max-model-len", "1024",
                   "--stream-interval", str(STREAM_INTERVAL),
                   "--server-secret", "test-secret-0123456789abcdef"], log).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    prefix = f"chatgate-test-{uuid.uuid4().hex[:12]}"
    srv = start_two_front_ends(tmp_path_factory.mktemp("logs") / "server.log", prefix)
    try:
        yield srv
    finally:
        srv.stop()
        redis_delete_prefix(prefix)


@pytest.fixture()
def clients(server):
    """One keep-alive HTTP client per front-end, by index."""
    with front_end_clients(server) as found:
        yield found


@contextlib.contextmanager
def front_end_clients(server: Server) -> Iterator[dict[int, httpx.Client]]:
    found: dict[int, httpx.Client] = {}
    for _ in range(200):
        client = httpx.Client(base_url=server.url, timeout=120)
        index = int(client.get("/healthz").headers[HEADER])
        if index in found:
            client.close()
        else:
            found[index] = client
        if len(found) == 2:
            break
    try:
        assert sorted(found) == [0, 1], "every connection went to one front-end"
        yield found
    finally:
        for client in found.values():
            client.close()


def processes(root: int) -> dict[int, str]:
    """``root``'s descendants: pid -> command line."""
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for child in children:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                out[child] = f.read().replace(b"\0", b" ").decode()
            todo.append(child)
    return out


def sse_turn(client: httpx.Client, body: dict, deltas: list[str] | None = None
             ) -> tuple[str, dict]:
    """One streamed chat turn: its text and usage (and each content delta into ``deltas``)."""
    text, usage = "", None
    with client.stream("POST", "/v1/chat/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and (content := chunk["choices"][0]["delta"].get("content")):
                text += content
                if deltas is not None:
                    deltas.append(content)
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert usage is not None
    return text, usage


def test_both_front_ends_stream_sse(clients):
    for client in clients.values():
        text, usage = sse_turn(client, {"model": "smollm2", "max_tokens": 6, "temperature": 0,
                                        "messages": [{"role": "user", "content": "Hi"}]})
        assert text and usage["completion_tokens"] > 0


def test_every_front_end_streams_deltas_of_the_stream_interval(clients):
    """12 tokens: the first at once, then (a client that keeps up) groups of 3, so 5 content
    deltas at most where one a token would be 12."""
    for client in clients.values():
        deltas: list[str] = []
        _, usage = sse_turn(client, {"model": "smollm2", "max_tokens": 12, "temperature": 0,
                                     "ignore_eos": True,
                                     "messages": [{"role": "user", "content": "Count to 20."}]},
                            deltas)
        assert usage["completion_tokens"] == 12
        assert 1 < len(deltas) <= 1 + -(-11 // STREAM_INTERVAL), deltas


GATEWAY_SERIES = ("chatgate:request_success_total", "chatgate:time_to_first_token_seconds_count",
                  "chatgate:e2e_request_latency_seconds_count",
                  "chatgate:inter_token_latency_seconds_count",
                  "chatgate:generation_tokens_total", "chatgate:num_active_streams")


def gateway_series(client: httpx.Client) -> dict[str, float]:
    """The gateway's own series in one front-end's /metrics, each summed over its labels."""
    r = client.get("/metrics")
    assert r.status_code == 200
    found = dict.fromkeys(GATEWAY_SERIES, 0.0)
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] += sample.value
    return found


def test_a_scrape_of_either_front_end_counts_the_requests_of_both(clients):
    before = gateway_series(clients[0])
    tokens = 0
    for index, requests in ((0, 1), (1, 2)):
        for _ in range(requests):
            _, usage = sse_turn(clients[index], {
                "model": "smollm2", "max_tokens": 5, "temperature": 0,
                "messages": [{"role": "user", "content": "Count to three."}]})
            tokens += usage["completion_tokens"]
    deadline = time.monotonic() + 10  # a request is counted as its stream closes
    while True:
        after = {index: gateway_series(client) for index, client in clients.items()}
        done = after[0]["chatgate:request_success_total"] - before[
            "chatgate:request_success_total"]
        if done >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert after[0] == after[1]
    delta = {name: after[0][name] - before[name] for name in GATEWAY_SERIES}
    assert delta["chatgate:request_success_total"] == 3
    assert delta["chatgate:time_to_first_token_seconds_count"] == 3
    assert delta["chatgate:e2e_request_latency_seconds_count"] == 3
    assert delta["chatgate:generation_tokens_total"] == tokens
    assert 0 < delta["chatgate:inter_token_latency_seconds_count"] <= tokens - 3
    assert after[0]["chatgate:num_active_streams"] == 0


async def test_both_front_ends_serve_websocket_sessions(server):
    seen: set[int] = set()
    for _ in range(200):
        async with websockets.connect(server.ws_url, subprotocols=["chatgate"]) as ws:
            index = int(ws.response.headers[HEADER])
            if index in seen:
                continue
            seen.add(index)
            await ws.send(json.dumps({"type": "session.create"}))
            await recv_event(ws, {"session"})
            text, done = await ws_turn(ws, "Hi!")
            assert text and done["usage"]["completion_tokens"] > 0
        if seen == {0, 1}:
            return
    raise AssertionError(f"WebSocket connections reached only front-end {seen}")


def test_a_sessions_turns_alternating_front_ends_compute_only_the_new_tokens(clients):
    alternate_turns(clients)


def alternate_turns(clients: dict[int, httpx.Client]) -> str:
    """A session's turns over SSE, alternating front-ends, each computing only its new
    tokens, its history readable through either; the session id."""
    sid = f"alternate-{uuid.uuid4().hex}"
    messages = [{"role": "system", "content": unique_system()}]
    usages = []
    for i, turn in enumerate(TURNS):
        messages.append({"role": "user", "content": turn})
        text, usage = sse_turn(clients[i % 2], {
            "model": "smollm2", "messages": messages, "temperature": 0, "max_tokens": 12,
            "session_id": sid})
        messages.append({"role": "assistant", "content": text})
        usages.append({"prompt_tokens": usage["prompt_tokens"],
                       "completion_tokens": usage["completion_tokens"],
                       "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]})
    check_reuse(usages)
    for client in clients.values():
        assert client.get(f"/v1/sessions/{sid}").json()["messages"] == messages[1:]
    return sid


def test_a_concurrent_turn_on_the_other_front_end_gets_409(clients):
    sid = f"busy-{uuid.uuid4().hex}"
    body = {"model": "smollm2", "session_id": sid, "temperature": 0,
            "messages": [{"role": "user", "content": "Count from one to a hundred."}]}
    with clients[0].stream("POST", "/v1/chat/completions", json={
            **body, "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        busy = clients[1].post("/v1/chat/completions", json={**body, "max_tokens": 2})
        assert busy.status_code == 409, busy.text
        assert busy.json()["error"]["code"] == "session_busy"
        for _ in lines:
            pass
    # the lock went with the turn: the other front-end may take the next one
    after = clients[1].post("/v1/chat/completions", json={**body, "max_tokens": 2})
    assert after.status_code == 200, after.text


def test_a_turn_that_ended_on_one_front_end_leaves_its_session_free_on_the_other(clients):
    """The next turn, sent the moment the last one's end arrives, never finds the session
    busy: the lock is freed in the engine before the end is sent (streamed or not)."""
    sid = f"quick-{uuid.uuid4().hex}"
    body = {"model": "smollm2", "session_id": sid, "max_tokens": 1,
            "messages": [{"role": "user", "content": "Hi"}]}
    for i in range(40):
        if i % 4 < 2:
            sse_turn(clients[i % 2], body)
        else:
            r = clients[i % 2].post("/v1/chat/completions", json=body)
            assert r.status_code == 200, (i, r.text)


def test_the_engine_answers_an_unlock_once_the_session_is_free_for_the_other_clients():
    from engine.core import EngineCore
    from engine.ipc import LockSession, UnlockSession

    core = EngineCore(None, [None, None], [None, None], -1)  # type: ignore[arg-type]
    answers = core._answers
    for client, message in [(0, LockSession(1, "s")), (1, LockSession(2, "s")),
                            (1, UnlockSession(3, "s")), (1, LockSession(4, "s")),
                            (0, UnlockSession(5, "s")), (1, LockSession(6, "s"))]:
        core._handle(client, message)
    assert [(a.call_id, a.result) for a in answers[0]] == [(1, True), (5, True)]
    assert [(a.call_id, a.result) for a in answers[1]] == [
        (2, False), (3, False), (4, False), (6, True)]


def test_bad_input_is_refused_by_every_front_end(clients):
    for client in clients.values():
        bad_json = client.post("/v1/chat/completions", content=b"{",
                               headers={"Content-Type": "application/json"})
        no_messages = client.post("/v1/chat/completions",
                                  json={"model": "smollm2", "messages": []})
        too_long = client.post("/v1/chat/completions", json={
            "model": "smollm2", "max_tokens": 2000,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert (bad_json.status_code, no_messages.status_code, too_long.status_code) == (
            400, 400, 400)
        assert too_long.json()["error"]["code"] == "context_length_exceeded"


def test_no_front_end_process_maps_torch(server, clients):
    for client in clients.values():  # a chat turn on each first
        assert client.post("/v1/chat/completions", json={
            "model": "smollm2", "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi"}]}).status_code == 200
    children = processes(server.proc.pid)
    front_ends = [pid for pid, cmd in children.items() if "multiprocessing.spawn" in cmd]
    (engine,) = [pid for pid, cmd in children.items() if "engine.core" in cmd]
    assert len(front_ends) == 2
    for pid in [server.proc.pid, *front_ends]:
        assert mapped_heavy_libraries(pid) == set()
    assert any(name.startswith("libtorch") for name in mapped_heavy_libraries(engine))


def test_the_supervisors_engine_process_gets_the_openmp_wait_settings(server):
    """The engine the supervisor starts runs with the same OpenMP wait settings as one an
    ``AsyncEngine`` starts alone (engine.launch.engine_environment)."""
    (engine,) = [pid for pid, cmd in processes(server.proc.pid).items() if "engine.core" in cmd]
    environ = dict(item.split(b"=", 1)
                   for item in Path(f"/proc/{engine}/environ").read_bytes().split(b"\0")
                   if b"=" in item)
    expected = openmp_wait(os.environ) or os.environ  # a caller's own setting rules alone
    for name in OPENMP_WAIT:
        assert environ.get(name.encode()) == (
            expected[name].encode() if name in expected else None)


@pytest.mark.parametrize("victim", ["supervisor", "engine"])
def test_a_killed_supervisor_or_engine_takes_every_process_down(tmp_path, victim):
    prefix = f"chatgate-test-{uuid.uuid4().hex[:12]}"
    server = start_two_front_ends(tmp_path / "server.log", prefix)
    try:
        assert server.proc is not None
        children = processes(server.proc.pid)
        (engine,) = [pid for pid, cmd in children.items() if "engine.core" in cmd]
        os.kill(server.proc.pid if victim == "supervisor" else engine, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while any(Path(f"/proc/{pid}").exists() and not _zombie(pid) for pid in children):
            assert time.monotonic() < deadline, (victim, processes(server.proc.pid),
                                                 server.log())
            time.sleep(0.2)
        if victim == "engine":  # the supervisor exits too, with a failure status
            assert server.proc.wait(timeout=30) == 1
    finally:
        server.stop()
        redis_delete_prefix(prefix)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_without_redis_every_front_end_shares_the_supervisors_session_store(tmp_path):
    server = start_two_front_ends(tmp_path / "server.log", None)
    try:
        assert server.health()["session_store"] == "SharedSessionStore"
        with front_end_clients(server) as clients:
            sid = alternate_turns(clients)
            assert clients[0].delete(f"/v1/sessions/{sid}").status_code == 200
            assert clients[1].get(f"/v1/sessions/{sid}").status_code == 404
    finally:
        server.stop()


def test_the_count_comes_from_the_flag_else_the_environment_else_one(monkeypatch):
    from chatgate.cli import build_parser, settings_from_args

    def count(*argv: str) -> int:
        return settings_from_args(build_parser().parse_args(["serve", *argv])).api_server_count

    monkeypatch.delenv("CHATGATE_API_SERVER_COUNT", raising=False)
    assert count() == 1
    monkeypatch.setenv("CHATGATE_API_SERVER_COUNT", "3")
    assert (count(), count("--api-server-count", "2")) == (3, 2)
