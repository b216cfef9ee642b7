"""Soak: a real ``chatgate serve`` under N minutes of mixed load, watched for leaks.

``--concurrency`` clients (closed loop, asyncio + httpx, SSE) each repeat: a session turn
(``session_id``; a session gets up to 4 turns, then is deleted and a new one starts), a plain
turn, or a turn it abandons after a random number of chunks (an abort). Every minute it prints
the gateway's and the engine process's RSS and open file descriptors (from ``/proc``), the KV
blocks in use and pinned (``/healthz``), and that minute's requests, aborts and errors (any
non-200 answer or error event). At the end, with the load stopped and every session deleted,
it checks that no KV block is still in use. Results: ``soak.txt``, ``soak.json``, ``soak.png``.

    python benchmarks/soak.py --minutes 30                  # SmolLM2 on CPU, concurrency 32
    python benchmarks/soak.py --quick                       # smoke run: 2 x 5 s, 2 clients
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import httpx  # noqa: E402

from benchmarks._common import (  # noqa: E402
    ROOT,
    Run,
    Tee,
    add_out_argument,
    free_port,
    machine_info,
    table,
    wait_until_ok,
)
from benchmarks.serving import TOPICS  # noqa: E402

JSON = {"Content-Type": "application/json"}


@dataclass
class Minute:
    minute: int
    gateway_rss_mib: float
    engine_rss_mib: float
    gateway_fds: int
    engine_fds: int
    blocks_used: int
    blocks_pinned: int
    requests: int
    aborts: int
    errors: int


@dataclass
class Counters:
    requests: int = 0
    aborts: int = 0
    errors: int = 0
    messages: list[str] = field(default_factory=list)


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def engine_pid(gateway_pid: int) -> int:
    """The gateway's child that runs ``engine.core``."""
    children = Path(f"/proc/{gateway_pid}/task/{gateway_pid}/children").read_text().split()
    for child in children:
        if b"engine.core" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise RuntimeError(f"no engine process under pid {gateway_pid}")


async def one_turn(client: httpx.AsyncClient, url: str, messages: list[dict],
                   session_id: str | None, abort_after: int | None, args: argparse.Namespace,
                   counters: Counters) -> str | None:
    """Stream one chat turn; the answer's text, or None if it was abandoned or failed."""
    body: dict = {"model": args.served_model, "messages": messages, "stream": True,
                  "max_tokens": args.max_tokens, "temperature": 0.7}
    if session_id is not None:
        body["session_id"] = session_id
    text, chunks = [], 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error']}")
                for choice in event["choices"]:
                    text.append(choice["delta"].get("content") or "")
                chunks += 1
                if abort_after is not None and chunks >= abort_after:
                    counters.aborts += 1
                    return None
    except Exception as e:  # noqa: BLE001 - every failure is counted and the client goes on
        counters.errors += 1
        counters.messages.append(f"{type(e).__name__}: {e}")
        return None
    counters.requests += 1
    return "".join(text)


async def client_loop(worker: int, url: str, args: argparse.Namespace, counters: Counters,
                      stop: asyncio.Event) -> None:
    rng = random.Random(worker)
    system = "You are a concise assistant. " * 20
    session: list[dict] = []
    session_id: str | None = None
    async with httpx.AsyncClient(timeout=120, headers=JSON) as client:
        while not stop.is_set():
            user = {"role": "user", "content": f"Tell me about {rng.choice(TOPICS)}."}
            kind = rng.random()
            if kind < args.abort_fraction:
                await one_turn(client, url, [{"role": "system", "content": system}, user], None,
                               rng.randint(1, args.max_tokens), args, counters)
            elif kind < args.abort_fraction + args.session_fraction:
                if session_id is None:
                    session_id, session = uuid.uuid4().hex, [{"role": "system",
                                                              "content": system}]
                session.append(user)
                answer = await one_turn(client, url, session, session_id, None, args, counters)
                if answer is None or len(session) >= 8:  # 4 turns, then a fresh session
                    r = await client.delete(f"{url}/v1/sessions/{session_id}")
                    if r.status_code not in (200, 404):
                        counters.errors += 1
                        counters.messages.append(f"DELETE session: HTTP {r.status_code}")
                    session_id, session = None, []
                else:
                    session.append({"role": "assistant", "content": answer})
            else:
                await one_turn(client, url, [{"role": "system", "content": system}, user], None,
                               None, args, counters)


def engine_stats(url: str) -> dict:
    return httpx.get(url + "/healthz", timeout=30).json()["engine"]


async def soak(url: str, gateway: int, engine: int, args: argparse.Namespace,
               log: Tee) -> list[Minute]:
    counters, stop = Counters(), asyncio.Event()
    tasks = [asyncio.create_task(client_loop(i, url, args, counters, stop))
             for i in range(args.concurrency)]
    minutes: list[Minute] = []
    last = Counters()
    for minute in range(1, args.minutes + 1):
        await asyncio.sleep(args.interval)
        stats = await asyncio.to_thread(engine_stats, url)
        row = Minute(minute, proc_rss_mib(gateway), proc_rss_mib(engine), proc_fds(gateway),
                     proc_fds(engine), stats["num_blocks_used"], stats["num_pinned_blocks"],
                     counters.requests - last.requests, counters.aborts - last.aborts,
                     counters.errors - last.errors)
        last = Counters(counters.requests, counters.aborts, counters.errors)
        minutes.append(row)
        log(f"  min {minute:3d}: RSS gateway {row.gateway_rss_mib:7.1f} MiB, engine "
            f"{row.engine_rss_mib:7.1f} MiB; fds {row.gateway_fds}/{row.engine_fds}; blocks "
            f"used {row.blocks_used} (pinned {row.blocks_pinned}); requests {row.requests}, "
            f"aborts {row.aborts}, errors {row.errors}")
        for message in counters.messages[-row.errors:] if row.errors else []:
            log(f"    error: {message}")
    stop.set()
    await asyncio.gather(*tasks)
    return minutes


def plot(minutes: list[Minute], rss_ax, fds_ax, blocks_ax) -> None:
    x = [m.minute for m in minutes]
    rss_ax.plot(x, [m.gateway_rss_mib for m in minutes], label="gateway")
    rss_ax.plot(x, [m.engine_rss_mib for m in minutes], label="engine")
    rss_ax.set(title="RSS (MiB)", xlabel="minute", ylim=(0, None))
    fds_ax.plot(x, [m.gateway_fds for m in minutes], label="gateway")
    fds_ax.plot(x, [m.engine_fds for m in minutes], label="engine")
    fds_ax.set(title="open file descriptors", xlabel="minute", ylim=(0, None))
    blocks_ax.plot(x, [m.blocks_used for m in minutes], label="in use")
    blocks_ax.plot(x, [m.blocks_pinned for m in minutes], label="pinned by sessions")
    blocks_ax.plot(x, [m.errors for m in minutes], label="errors / min")
    blocks_ax.set(title="KV blocks, errors", xlabel="minute", ylim=(0, None))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=int, default=30)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--session-fraction", type=float, default=0.5)
    p.add_argument("--abort-fraction", type=float, default=0.2)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--redis-url", default=None, help="default: the in-process session store")
    add_out_argument(p)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 samples 5 s apart")
    args = p.parse_args(argv)
    args.interval = 60.0
    if args.quick:
        args.minutes, args.interval, args.concurrency, args.max_tokens = 2, 5.0, 2, 4
    return args


def report(run: Run, minutes: list[Minute], leaked: int, argv: list[str] | None) -> None:
    """The per-minute table, the summary line, the raw JSON and the plot."""
    rows = [[m.minute, f"{m.gateway_rss_mib:.0f}", f"{m.engine_rss_mib:.0f}", m.gateway_fds,
             m.engine_fds, m.blocks_used, m.blocks_pinned, m.requests, m.aborts, m.errors]
            for m in minutes]
    run(table(rows, ["min", "gw RSS MiB", "engine RSS MiB", "gw fds", "engine fds",
                     "blocks used", "pinned", "requests", "aborts", "errors"]))
    first, end = minutes[0], minutes[-1]
    run(f"RSS gateway {first.gateway_rss_mib:.0f} -> {end.gateway_rss_mib:.0f} MiB, engine "
        f"{first.engine_rss_mib:.0f} -> {end.engine_rss_mib:.0f} MiB; fds "
        f"{first.gateway_fds}/{first.engine_fds} -> {end.gateway_fds}/{end.engine_fds}; "
        f"requests {sum(m.requests for m in minutes)}, aborts {sum(m.aborts for m in minutes)}, "
        f"errors {sum(m.errors for m in minutes)}; KV blocks in use after the load and every "
        f"session deleted: {leaked}")
    run.write_json({"argv": sys.argv[1:] if argv is None else argv, "machine": machine_info(),
                    "minutes": [asdict(m) for m in minutes], "blocks_in_use_at_end": leaked},
                   indent=1)
    run.plot("soak.png", functools.partial(plot, minutes), ncols=3, figsize=(15, 4))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args.out, "soak", argv=argv)
    port = free_port()
    cmd = [sys.executable, "-m", "chatgate.cli", "serve", "--port", str(port), "--model",
           args.model, "--log-level", "warning"]
    if args.redis_url:
        prefix = f"soak-{uuid.uuid4().hex[:8]}"
        cmd += ["--redis-url", args.redis_url, "--redis-prefix", prefix]
        run(f"session store: Redis at {args.redis_url}, key prefix {prefix}")
    server_log = Path(tempfile.gettempdir()) / "soak_server.log"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=server_log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ok(url + "/healthz", proc, 600, server_log, poll_s=1)
        engine = engine_pid(proc.pid)
        args.served_model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        run(f"server up (gateway pid {proc.pid}, engine pid {engine}); {args.minutes} min at "
            f"concurrency {args.concurrency}, {args.max_tokens} tokens a turn")
        minutes = asyncio.run(soak(url, proc.pid, engine, args, run))
        for s in httpx.get(url + "/v1/sessions", timeout=30).json()["data"]:
            httpx.delete(f"{url}/v1/sessions/{s['id']}", headers=JSON, timeout=30)
        time.sleep(2)
        final = engine_stats(url)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    leaked = final["num_blocks_used"]
    report(run, minutes, leaked, argv)
    run.close()
    return 0 if leaked == 0 and not any(m.errors for m in minutes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
