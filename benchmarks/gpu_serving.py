"""Serving at engine speed: the same chat requests through ``chatgate serve`` (SSE and the
WebSocket protocol) and through ``LLM.chat`` directly, in one run, with the ratio to direct.

Per model (``--models``), in this order:

1. **direct**: ``LLM.chat`` in this process on every request at once, at most ``C`` sequences in
   flight (the scheduler's ``max_num_seqs``), after an untimed warm-up. Throughput only: direct
   calls return when everything is done.
2. **server**: ``python -m chatgate serve`` on a free loopback port with the same engine flags
   (``--code REF`` also serves the code at git ref ``REF`` beside it, on another port), then a
   closed-loop load at each concurrency ``C`` over SSE (``/v1/chat/completions``,
   ``stream: true``) and over the WebSocket (``session.create`` → ``message`` → ``done`` →
   ``session.close``). The load generator runs in ``--client-procs`` processes (aiohttp), so the
   client is not the bottleneck; each request's TTFT and chunk gaps (ITL) are timed where the
   bytes arrive, and its token count is read from the server's usage. With
   ``--api-server-count 1,2,4`` the server runs once per count (N front-end processes sharing
   one engine), one after the other; its paths are named ``sse xN`` / ``ws xN`` (N > 1); so
   with ``--stream-interval 1,4`` (deltas of N tokens: paths ``sse iN``), for each count.
   With ``--step-profile`` the servers log at debug level, and each level's engine steps
   (those with at least 80 % of ``C`` running) are summed up from the server's log per kind
   (with a prompt, decode only): count, mean milliseconds and mean host milliseconds of each
   section of the step (``engine.step_timing``). ``--server-args`` adds ``chatgate serve``
   flags (e.g. ``--admission-batch 1``).
3. **multi-turn** (``--turns-sessions``): sessions × turns over SSE with a shared system prompt,
   each session sending its turns one after another (the answer of each turn goes into the next
   turn's messages), once with ``session_id`` (pinned KV) and once without (prefix cache
   only); TTFT per turn; on the server of the last ``--api-server-count``.

Every request has the same sampling (``--temperature``, a seed per request, ``--output-len``
tokens with ``ignore_eos``), so every path generates the same number of tokens; the script
checks that it did.

    python benchmarks/gpu_serving.py                                     # the H200 run
    python benchmarks/gpu_serving.py --device cpu --dtype float32 --models smollm2 \\
        --num-requests 32 --output-len 48 --concurrency 1,16,32 --transports sse \\
        --code acc0bc2 --turns-sessions 0                                # CPU vs older code
    python benchmarks/gpu_serving.py --concurrency 256 --client-procs 4 \
        --api-server-count 1,2,4                                         # front-end counts
    python benchmarks/gpu_serving.py --models dummy:smollm2-135m --concurrency 256 \
        --turns-sessions 0 --step-profile                  # the served engine's steps
    python benchmarks/gpu_serving.py --quick                             # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import io
import json
import multiprocessing
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks._common import (  # noqa: E402
    ROOT,
    Tee,
    add_out_argument,
    free_port,
    machine_info,
    percentile,
    ratio,
    save_figure,
    table,
    wait_until_ok,
)
from benchmarks.serving import TOPICS  # noqa: E402

STYLES = ["Explain {t} to a ten-year-old.",
          "Write a detailed essay about {t}, with an introduction, three sections and a "
          "conclusion. Use concrete examples and define every technical term you use.",
          "Give me five facts about {t}.",
          "I am studying {t} for an exam tomorrow. Summarise the key ideas, list the common "
          "misconceptions, and suggest three practice questions with short answers.",
          "What is {t}?"]
SYSTEM_SENTENCE = ("You are the support assistant of a company that builds streaming chat "
                   "gateways; answer precisely, cite the relevant part of the manual, and keep "
                   "a friendly, professional tone. ")


def chat_requests(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    return [[{"role": "user", "content":
              f"[{i}] " + rng.choice(STYLES).format(t=rng.choice(TOPICS))}] for i in range(n)]


# -- results -------------------------------------------------------------------------------------

@dataclass
class Request:
    """One timed request (monotonic clock, shared by every process of this machine)."""

    start: float
    end: float = float("nan")
    ttft: float = float("nan")
    gaps: list[float] = field(default_factory=list)  # between content chunks
    tokens: int = 0
    prompt: int = 0
    cached: int = 0
    error: str = ""


@dataclass
class Level:
    model: str
    path: str  # direct | sse | ws | sse <ref> ...
    concurrency: int
    requests: int
    tokens: int
    errors: int
    wall_s: float
    tok_s: float
    ttft_p50: float = float("nan")
    ttft_p99: float = float("nan")
    itl_p50: float = float("nan")
    itl_p99: float = float("nan")
    tokens_per_chunk: float = float("nan")
    frontend_us_per_chunk: float = float("nan")  # gateway processes' CPU time per chunk
    # the engine process's loop over the level (/metrics' engine_* counters; NaN where the
    # served code has none): time per step, share of steps with a prompt, seconds in steps
    # per second of the level
    engine_ms_per_step: float = float("nan")
    engine_prompt_share: float = float("nan")
    engine_busy: float = float("nan")
    steps: dict[str, dict[str, float]] = field(default_factory=dict)  # --step-profile

    @property
    def frontend_us_per_token(self) -> float:
        return ratio(self.frontend_us_per_chunk, self.tokens_per_chunk)


def summarize(model: str, path: str, concurrency: int, results: list[Request],
              expected_tokens: int) -> Level:
    ok = [r for r in results if not r.error]
    wrong = [r for r in ok if r.tokens != expected_tokens]
    errors = len(results) - len(ok) + len(wrong)
    wall = max(r.end for r in results) - min(r.start for r in results)
    tokens = sum(r.tokens for r in ok)
    gaps = [g for r in ok for g in r.gaps]
    chunks = sum(len(r.gaps) + 1 for r in ok)
    return Level(model, path, concurrency, len(results), tokens, errors, wall, tokens / wall,
                 percentile([r.ttft for r in ok], 50), percentile([r.ttft for r in ok], 99),
                 percentile(gaps, 50), percentile(gaps, 99), tokens / chunks if chunks else 0)


# The engine process's step line at debug level (engine.core)
STEP_LINE = re.compile(r"step ([\d.]+) ms \((.*?)\): (\d+) prefill \+ (\d+) decode tokens, "
                       r"(\d+) running")


def step_profile(log_text: str, min_running: int) -> dict[str, dict[str, float]]:
    """Per kind of step ("prompt": with prompt tokens, "decode": without) among the step lines
    of ``log_text`` with at least ``min_running`` sequences running: the count, the mean
    milliseconds, prompt tokens and decode rows, and each section's mean host milliseconds."""
    kinds: dict[str, list[tuple[float, dict[str, float], int, int]]] = {"prompt": [],
                                                                          "decode": []}
    for match in STEP_LINE.finditer(log_text):
        ms, sections, prefill, decode, running = match.groups()
        if int(running) < min_running:
            continue
        parts = sections.split()
        named = {parts[i]: float(parts[i + 1]) for i in range(0, len(parts) - 1, 2)}
        kinds["prompt" if int(prefill) else "decode"].append(
            (float(ms), named, int(prefill), int(decode)))
    profile = {}
    for kind, steps in kinds.items():
        if not steps:
            continue
        names = dict.fromkeys(name for _, named, _, _ in steps for name in named)
        profile[kind] = {
            "steps": len(steps), "ms": statistics.mean(s[0] for s in steps),
            "prompt_tokens": statistics.mean(s[2] for s in steps),
            "decode_rows": statistics.mean(s[3] for s in steps),
            **{name: statistics.mean(s[1].get(name, 0.0) for s in steps) for name in names}}
    return profile


# -- the load generator (runs in client processes) -----------------------------------------------

def _sse_body(model: str, messages: list[dict], args: dict, seed: int,
              session_id: str | None = None) -> dict:
    body = {"model": model, "messages": messages, "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": args["output_len"],
            "temperature": args["temperature"], "seed": seed, "ignore_eos": True}
    if session_id is not None:
        body["session_id"] = session_id
    return body


async def _sse_request(http, url: str, body: dict) -> tuple[Request, str]:
    """One streamed chat completion; returns its timing and its text."""
    r = Request(time.monotonic())
    text, last = [], None
    try:
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r, ""
            async for raw in resp.content:
                if not raw.startswith(b"data: {"):
                    continue
                now = time.monotonic()
                event = json.loads(raw[6:])
                if "error" in event:
                    r.error = event["error"]["message"]
                    break
                if event["choices"] and event["choices"][0]["delta"].get("content"):
                    text.append(event["choices"][0]["delta"]["content"])
                    if last is None:
                        r.ttft = now - r.start
                    else:
                        r.gaps.append(now - last)
                    last = now
                if event.get("usage"):
                    r.tokens = event["usage"]["completion_tokens"]
                    r.prompt = event["usage"]["prompt_tokens"]
                    r.cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    except Exception as e:  # noqa: BLE001 - counted as an error
        r.error = f"{type(e).__name__}: {e}"
    r.end = time.monotonic()
    return r, "".join(text)


async def _ws_request(ws, messages: list[dict], args: dict, seed: int) -> Request:
    """One answer over an open WebSocket: session.create, message, deltas, done, close."""
    r = Request(time.monotonic())
    last = None
    await ws.send_json({"type": "session.create"})
    created = await ws.receive_json()
    if created.get("type") != "session":
        r.error, r.end = str(created), time.monotonic()
        return r
    await ws.send_json({"type": "message", "content": messages[-1]["content"], "params": {
        "max_tokens": args["output_len"], "temperature": args["temperature"], "seed": seed,
        "ignore_eos": True}})
    while True:
        event = await ws.receive_json()
        now = time.monotonic()
        if event["type"] == "delta":
            if last is None:
                r.ttft = now - r.start
            else:
                r.gaps.append(now - last)
            last = now
        elif event["type"] == "done":
            r.tokens = event["usage"]["completion_tokens"]
            r.prompt = event["usage"]["prompt_tokens"]
            r.cached = event["usage"]["cached_tokens"]
            break
        else:
            r.error = str(event)
            break
    r.end = time.monotonic()
    await ws.send_json({"type": "session.close"})
    await ws.receive_json()
    return r


async def _run_load(job: dict) -> list[dict]:
    import aiohttp

    url, args, concurrency = job["url"], job["args"], job["concurrency"]
    queue = list(reversed(job["indices"]))
    requests = job["requests"]
    results: list[Request] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        async def worker() -> None:
            ws = None
            if job["transport"] == "ws":
                ws = await http.ws_connect(url.replace("http", "ws", 1) + "/v1/ws",
                                           max_msg_size=0)
            while queue:
                i = queue.pop()
                if ws is None:
                    r, _ = await _sse_request(http, url,
                                              _sse_body(job["model"], requests[i], args, i))
                else:
                    r = await _ws_request(ws, requests[i], args, i)
                results.append(r)
            if ws is not None:
                await ws.close()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [asdict(r) for r in results]


async def _run_sessions(job: dict) -> list[dict]:
    """Each session's turns one after another; rows of (turn index, Request)."""
    import aiohttp

    url, args = job["url"], job["args"]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    rows = []
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        async def session(s: int) -> None:
            messages = [{"role": "system", "content": job["system"]}]
            for t in range(args["turns"]):
                messages.append({"role": "user", "content":
                                 f"{job['tag']} conversation {s}, question {t}: tell me about "
                                 f"{TOPICS[(s + t) % len(TOPICS)]}."})
                seed = s * 100 + t
                sid = f"{job['tag']}-{s}" if job["use_session"] else None
                body = _sse_body(job["model"], messages, {**args, "output_len":
                                 args["turn_tokens"]}, seed, sid)
                r, text = await _sse_request(http, url, body)
                rows.append({"turn": t, **asdict(r)})
                messages.append({"role": "assistant", "content": text})

        await asyncio.gather(*(session(s) for s in job["sessions"]))
    return rows


def _client_process(job: dict) -> list[dict]:
    runner = _run_sessions if job["kind"] == "sessions" else _run_load
    return asyncio.run(runner(job))


def run_clients(jobs: list[dict]) -> list[dict]:
    """Run each job in its own process: forked, so that they find this module's functions
    even when it was loaded from a path (as the tests do); they never touch torch, which is
    what makes forking a process that ran torch unsafe."""
    if len(jobs) == 1:
        return _client_process(jobs[0])
    with multiprocessing.get_context("fork").Pool(len(jobs)) as pool:
        return [row for rows in pool.map(_client_process, jobs) for row in rows]


def load(url: str, model: str, transport: str, requests: list[list[dict]], concurrency: int,
         args: argparse.Namespace) -> list[Request]:
    procs = max(1, min(args.client_procs, concurrency))
    shared = {"output_len": args.output_len, "temperature": args.temperature}
    jobs = [{"kind": "load", "url": url, "model": model, "transport": transport,
             "requests": requests, "indices": list(range(p, len(requests), procs)),
             "concurrency": len(range(p, concurrency, procs)), "args": shared}
            for p in range(procs)]
    return [Request(**row) for row in run_clients(jobs)]


# -- servers -------------------------------------------------------------------------------------

class Server:
    """``python -m chatgate serve`` from ``code`` (a source tree), on a free port."""

    def __init__(self, code: Path, flags: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = os.pathsep.join(p for p in (str(code), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        self.log_path = log
        self.log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chatgate", "serve", "--port", str(self.port), *flags],
            cwd=code, env=env, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def gateway_cpu_s(self) -> float:
        """CPU seconds (user + system) the gateway's processes have used: the server process
        and its front-ends, not the engine process."""
        ticks = 0
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"engine.core" in cmd or b"resource_tracker" in cmd:
                    continue
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
                todo += [int(c) for c in
                         Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            except OSError:
                continue
        return ticks / os.sysconf("SC_CLK_TCK")

    def engine_loop(self) -> tuple[float, float, float]:
        """The engine loop's counters from /metrics, once the engine has gone idle (its last
        stats snapshot): steps, steps with a prompt, seconds in steps (NaN where absent)."""
        names = ("steps", "prompt_steps", "step_seconds")
        values = {}
        for _ in range(100):
            text = httpx.get(self.url + "/metrics", timeout=30).text
            values = {sample.name: sample.value
                      for family in text_string_to_metric_families(text)
                      for sample in family.samples}
            if values.get("chatgate:num_requests_running", 0) == 0:
                break
            time.sleep(0.05)
        return tuple(values.get(f"chatgate:engine_{n}_total", float("nan")) for n in names)

    def wait_ready(self, timeout: float = 900) -> None:
        wait_until_ok(self.url + "/healthz", self.proc, timeout, Path(self.log.name))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def checkout(ref: str, into: Path) -> Path:
    """The tracked files of ``ref`` in a folder (``git archive``)."""
    archive = subprocess.run(["git", "archive", "--format=tar", ref], cwd=ROOT, check=True,
                             capture_output=True).stdout
    folder = into / f"code-{ref}"
    folder.mkdir()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder


# -- the run -------------------------------------------------------------------------------------

def engine_flags(model: str, args: argparse.Namespace) -> list[str]:
    flags = ["--model", model, "--max-num-seqs", str(max(args.concurrency)),
             "--max-model-len", str(args.max_model_len),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.device:
        flags += ["--device", args.device]
    if args.dtype:
        flags += ["--dtype", args.dtype]
    if args.num_kv_blocks:
        flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.tokenizer:
        flags += ["--tokenizer", args.tokenizer]
    if args.step_profile:
        flags += ["--log-level", "debug"]
    return flags + shlex.split(args.server_args)


def _direct_levels(model: str, requests: list[list[dict]],
                   args: argparse.Namespace) -> list[Level]:
    from engine import LLM, SamplingParams

    llm = LLM(model=model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
              max_num_seqs=max(args.concurrency), max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens,
              num_kv_blocks=args.num_kv_blocks)
    params = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.output_len,
                             ignore_eos=True) for i in range(len(requests))]
    warm = requests[:args.warmup]
    llm.chat(warm, [SamplingParams(max_tokens=8, ignore_eos=True)] * len(warm))
    engine, counts = llm.engine, {"steps": 0, "prompt": 0}
    step = engine.step

    def counted_step() -> list:  # the steps LLM.chat takes, as the serving loop counts them
        prefill = engine.num_prefill_tokens
        outputs = step()
        counts["steps"] += 1
        counts["prompt"] += int(engine.num_prefill_tokens > prefill)
        return outputs

    engine.step = counted_step
    levels = []
    for c in sorted(args.concurrency, reverse=True):
        engine.scheduler.max_num_seqs = c  # at most c sequences in flight
        counts.update(steps=0, prompt=0)
        start = time.monotonic()
        outs = llm.chat(requests, params)  # returns once every token is on the host
        wall = time.monotonic() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        errors = sum(len(o.outputs[0].token_ids) != args.output_len for o in outs)
        levels.append(Level(model, "direct", c, len(requests), tokens, errors, wall,
                            tokens / wall, engine_ms_per_step=ratio(wall * 1e3, counts["steps"]),
                            engine_prompt_share=ratio(counts["prompt"], counts["steps"])))
    return levels


def direct(model: str, args: argparse.Namespace, log: Tee) -> list[Level]:
    """``LLM.chat`` in a child process (this script again, ``--direct-out``), so that all its
    memory is gone before the server starts."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "direct.json"
        subprocess.run([sys.executable, str(Path(__file__).resolve()), *args.argv,
                        "--models", model, "--direct-out", str(out)], check=True)
        levels = [Level(**row) for row in json.loads(out.read_text())]
    for level in levels:
        log(f"  direct   C={level.concurrency:<4} {level.tok_s:9.0f} tok/s  "
            f"({level.wall_s:.1f} s, {level.engine_ms_per_step:.2f} ms/step, "
            f"{level.engine_prompt_share:.0%} with a prompt)")
    return levels


def multi_turn(model: str, url: str, args: argparse.Namespace) -> dict:
    system = SYSTEM_SENTENCE * max(1, args.system_tokens // 40)
    shared = {"output_len": args.turn_tokens, "turn_tokens": args.turn_tokens,
              "temperature": args.temperature, "turns": args.turns}
    out = {}
    for use_session in (False, True):
        tag = f"{'pinned' if use_session else 'prefix'}-{time.monotonic_ns()}"
        procs = max(1, min(args.client_procs, args.turns_sessions))
        jobs = [{"kind": "sessions", "url": url, "model": model, "tag": tag, "system": system,
                 "use_session": use_session, "args": shared,
                 "sessions": list(range(p, args.turns_sessions, procs))} for p in range(procs)]
        rows = run_clients(jobs)
        later = [r for r in rows if r["turn"] > 0 and not r["error"]]
        out["session_id" if use_session else "no session_id"] = {
            "errors": sum(1 for r in rows if r["error"]),
            "ttft_by_turn_p50": [percentile([r["ttft"] for r in rows
                                             if r["turn"] == t and not r["error"]], 50)
                                 for t in range(args.turns)],
            "ttft_later_p50": percentile([r["ttft"] for r in later], 50),
            "ttft_later_p99": percentile([r["ttft"] for r in later], 99),
            "computed_fraction_later": ratio(sum(r["prompt"] - r["cached"] for r in later),
                                             sum(r["prompt"] for r in later)),
        }
    return out


def serve_and_load(model: str, requests: list[list[dict]], args: argparse.Namespace,
                   codes: dict[str, Path], log: Tee) -> tuple[list[Level], dict]:
    """Every ``--api-server-count`` and ``--stream-interval`` in turn: its servers (one per
    code), the load at each concurrency and transport; then the multi-turn run on the last
    server."""
    levels: list[Level] = []
    turns: dict = {}
    variants = [(count, interval) for count in args.api_server_count
                for interval in args.stream_interval]
    for k, (count, interval) in enumerate(variants):
        served, turns = _serve_variant(model, requests, args, codes, log, count, interval,
                                       k == len(variants) - 1)
        levels += served
    return levels, turns


def _serve_variant(model: str, requests: list[list[dict]], args: argparse.Namespace,
                   codes: dict[str, Path], log: Tee, count: int, interval: int,
                   with_turns: bool) -> tuple[list[Level], dict]:
    servers = {}
    flags = engine_flags(model, args)
    suffix = ""
    if count > 1:  # an older --code without the flag runs at count 1 only
        flags += ["--api-server-count", str(count)]
        suffix += f" x{count}"
    if interval > 1:  # the same for --stream-interval
        flags += ["--stream-interval", str(interval)]
        suffix += f" i{interval}"
    try:
        for name, code in codes.items():
            log_name = f"gpu_serving_server_{name}{suffix.replace(' ', '_')}.log"
            servers[name] = Server(code, flags, args.out / log_name)
        for server in servers.values():
            server.wait_ready()
        for server in servers.values():  # warm-up: kernels compiled, graphs used
            load(server.url, model, "sse", requests[:args.warmup],
                 min(args.warmup, max(args.concurrency)), args)
        levels = []
        for c in sorted(args.concurrency, reverse=True):
            for transport in args.transports:
                for name, server in servers.items():
                    path = (transport if name == "new" else f"{transport} {name}") + suffix
                    cpu, loop = server.gateway_cpu_s(), server.engine_loop()
                    mark = server.log_path.stat().st_size
                    results = load(server.url, model, transport, requests,
                                   c, args)
                    level = summarize(model, path, c, results, args.output_len)
                    if args.step_profile:
                        with server.log_path.open("rb") as f:
                            f.seek(mark)
                            text = f.read().decode(errors="replace")
                        level.steps = step_profile(text, int(0.8 * c))
                    chunks = sum(len(r.gaps) + 1 for r in results if not r.error)
                    level.frontend_us_per_chunk = ratio(
                        (server.gateway_cpu_s() - cpu) * 1e6, chunks)
                    steps, prompt_steps, seconds = (
                        b - a for a, b in zip(loop, server.engine_loop(), strict=True))
                    level.engine_ms_per_step = ratio(seconds * 1e3, steps)
                    level.engine_prompt_share = ratio(prompt_steps, steps)
                    level.engine_busy = ratio(seconds, level.wall_s)
                    levels.append(level)
                    log(f"  {path:<8} C={c:<4} {level.tok_s:9.0f} tok/s  TTFT p50 "
                        f"{level.ttft_p50:.3f} s  ITL p50 {level.itl_p50 * 1000:.1f} ms  "
                        f"{level.tokens_per_chunk:.2f} tok/chunk  gateway "
                        f"{level.frontend_us_per_chunk:.0f} CPU-us/chunk  engine "
                        f"{level.engine_ms_per_step:.2f} ms/step ({level.engine_busy:.0%} busy, "
                        f"{level.engine_prompt_share:.0%} with a prompt)  errors {level.errors}")
                    for kind, row in level.steps.items():
                        log(f"    {kind} steps: " + ", ".join(
                            f"{k} {v:.0f}" if k in ("steps", "prompt_tokens", "decode_rows")
                            else f"{k} {v:.2f}" for k, v in row.items()))
        turns = {}
        if args.turns_sessions and with_turns:
            turns = multi_turn(model, servers["new"].url, args)
            for mode, row in turns.items():
                log(f"  multi-turn{suffix} {mode:<14} turns>=2 TTFT p50 "
                    f"{row['ttft_later_p50']:.3f} s p99 {row['ttft_later_p99']:.3f} s, prompt "
                    f"computed {row['computed_fraction_later']:.1%}; TTFT p50 by turn "
                    + " ".join(f"{v:.3f}" for v in row["ttft_by_turn_p50"])
                    + f"  errors {row['errors']}")
        return levels, turns
    finally:
        for server in servers.values():
            server.stop()


def plot(levels: list[Level], *axes) -> None:
    """Per model (sorted), two axes: output tokens/s, and the gateway's CPU time a token, by
    path and concurrency."""
    models = sorted({lv.model for lv in levels})
    for k, model in enumerate(models):
        rows = [lv for lv in levels if lv.model == model]
        paths = list(dict.fromkeys(lv.path for lv in rows))
        concs = sorted({lv.concurrency for lv in rows})
        width = 0.8 / len(paths)
        for ax, value, label in (
                (axes[2 * k], lambda lv: lv.tok_s, "output tokens/s"),
                (axes[2 * k + 1], lambda lv: lv.frontend_us_per_token,
                 "gateway CPU-us a token")):
            for j, p in enumerate(paths):
                ys = [next((value(lv) for lv in rows if lv.path == p and lv.concurrency == c),
                           0) for c in concs]
                ax.bar([i + j * width for i in range(len(concs))], ys, width, label=p)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(concs))])
            ax.set_xticklabels([f"C={c}" for c in concs])
            ax.set_ylabel(label)
            ax.set_title(model)


def side_by_side(levels: list[Level]) -> str:
    """Per model and concurrency: direct tok/s, then each served path's ratio to it."""
    paths = list(dict.fromkeys(lv.path for lv in levels if lv.path != "direct"))
    rows = []
    for model in dict.fromkeys(lv.model for lv in levels):
        for c in sorted({lv.concurrency for lv in levels if lv.model == model}):
            got = {lv.path: lv.tok_s for lv in levels
                   if lv.model == model and lv.concurrency == c}
            base = got.get("direct", float("nan"))
            rows.append([model, c, base, *(ratio(got.get(p, float("nan")), base)
                                           for p in paths)])
    return "ratio to direct\n" + table(rows, ["model", "C", "direct tok/s", *paths])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="dummy:llama-3.1-8b,smollm2")
    p.add_argument("--tokenizer", default=None, type=lambda path: str(Path(path).resolve()),
                   help="a tokenizer folder for every model (chatgate serve --tokenizer; "
                        "made absolute: a --code server runs in its own folder)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--transports", default="sse,ws")
    p.add_argument("--api-server-count", default="1",
                   help="comma-separated front-end process counts, each served in turn")
    p.add_argument("--stream-interval", default="1",
                   help="comma-separated stream intervals (tokens a delta), each served in turn")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--client-procs", type=int, default=8,
                   help="load-generator processes (each runs an asyncio client)")
    p.add_argument("--warmup", type=int, default=64, help="untimed requests before timing")
    p.add_argument("--code", default=None, metavar="REF",
                   help="also serve the code at this git ref, or in this folder (same flags, "
                        "same load)")
    p.add_argument("--no-direct", action="store_true")
    p.add_argument("--server-args", default="", help="more chatgate serve flags")
    p.add_argument("--step-profile", action="store_true",
                   help="the engine's steps per kind, from the servers' debug log")
    p.add_argument("--turns-sessions", type=int, default=128, help="0: no multi-turn run")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-tokens", type=int, default=48)
    p.add_argument("--system-tokens", type=int, default=1000)
    add_out_argument(p)
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--direct-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.num_requests, args.output_len, args.concurrency = 6, 4, "1,3"
        args.warmup, args.client_procs, args.turns_sessions, args.turns = 2, 2, 2, 2
        args.turn_tokens, args.system_tokens = 4, 80
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.api_server_count = [int(n) for n in args.api_server_count.split(",")]
    args.stream_interval = [int(n) for n in args.stream_interval.split(",")]
    args.transports = [t for t in args.transports.split(",") if t]
    args.models = [m for m in args.models.split(",") if m]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    requests = chat_requests(args.num_requests, seed=0)
    if args.direct_out is not None:  # the child process of ``direct``
        levels = _direct_levels(args.models[0], requests, args)
        args.direct_out.write_text(json.dumps([asdict(lv) for lv in levels]))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    log = Tee(args.out / "gpu_serving.txt")
    log("gpu_serving:", " ".join(args.argv))
    log(machine_info())
    levels: list[Level] = []
    turns: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        codes = {"new": ROOT}
        if args.code:  # a git ref, or a folder holding another tree (a machine without git)
            codes[Path(args.code).name] = (Path(args.code).resolve() if Path(args.code).is_dir()
                                           else checkout(args.code, Path(tmp)))
        for model in args.models:
            log(f"== {model}")
            if not args.no_direct:
                levels += direct(model, args, log)
            served, turns[model] = serve_and_load(model, requests, args, codes, log)
            levels += served
    rows = []
    for lv in levels:
        base = next((d.tok_s for d in levels if d.model == lv.model and d.path == "direct"
                     and d.concurrency == lv.concurrency), float("nan"))
        rows.append([lv.model, lv.path, lv.concurrency, lv.tok_s, ratio(lv.tok_s, base),
                     lv.ttft_p50, lv.ttft_p99, lv.itl_p50 * 1000, lv.itl_p99 * 1000,
                     lv.tokens_per_chunk, lv.frontend_us_per_chunk, lv.frontend_us_per_token,
                     lv.engine_ms_per_step,
                     lv.engine_prompt_share, lv.engine_busy, lv.errors])
    (args.out / "gpu_serving.json").write_text(json.dumps(
        {"argv": sys.argv[1:] if argv is None else argv, "machine": machine_info(),
         "levels": [asdict(lv) for lv in levels], "multi_turn": turns}, indent=1))
    if levels:
        models = len({lv.model for lv in levels})
        save_figure(args.out / "gpu_serving.png", functools.partial(plot, levels),
                    ncols=2 * models, figsize=(12 * models, 4), dpi=120)
    for model, modes in turns.items():
        for mode, row in modes.items():
            log(f"multi-turn {model} {mode}: turns>=2 TTFT p50 {row['ttft_later_p50']:.3f} s, "
                f"p99 {row['ttft_later_p99']:.3f} s, prompt computed "
                f"{row['computed_fraction_later']:.1%}, errors {row['errors']}")
    log(table(rows, ["model", "path", "C", "tok/s", "/direct", "TTFT p50 s", "TTFT p99 s",
                     "ITL p50 ms", "ITL p99 ms", "tok/chunk", "gw CPU-us/chunk",
                     "gw CPU-us/tok", "engine ms/step", "prompt steps", "engine busy", "errors"]))
    log(side_by_side(levels))
    log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
