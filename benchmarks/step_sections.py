"""Where a step's host time goes: the sections of ``LLMEngine.step`` timed on structured.py's
workload, (a) under its JSON schema and (b) unconstrained with the same token counts, with the
sampler's draw graphs (``engine/draw_graphs.py``) on and off in turn in one process.

Each section is timed by wrapping the engine's method of that name (``_read_inflight``,
``execute``, ...; ``submit(job)`` sending a mask job to the grammar worker, ``wait(job)``
waiting for its end, ``stream_wait`` queueing the device's wait for the masks (eager draws:
a draw graph holds its own), ``capture`` a draw graph's first use), as ms per step, and how
many reads of a step's tokens took over 1 ms (a read waits for the draw, which waits for its
masks). A profiling aid: the wrappers add a little time to every section.

    python benchmarks/step_sections.py --device cuda --dtype bfloat16 \
        --model dummy:smollm2-135m --tokenizer DIR --repeat 3

On the CPU (no graphs) both modes draw eagerly. Log: ``step_sections.txt``.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks._common import DEFAULT_OUT, open_log  # noqa: E402
from benchmarks.structured import SCHEMA, conversations  # noqa: E402

TIMES: collections.defaultdict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()
READS: list[float] = []  # each read of a step's tokens, seconds
READ_AT: list[float] = []  # when each read of a step's tokens ended (perf_counter)
SENT: list[float] = []  # when each mask job was sent
JOBS: list[tuple[float, float]] = []  # each job's (received, done) in the worker
STALLS: list = []  # (start, end) CUDA events around each device wait for masks


def timed(fn: Callable, label: str, durations: list[float] | None = None) -> Callable:
    """``fn``, its time added to ``label``'s section (and each call's to ``durations``)."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - start
            TIMES[label] += took
            CALLS[label] += 1
            if durations is not None:
                durations.append(took)
    return wrapper


def instrument(engine: Any) -> None:
    """Time the sections of ``engine``'s steps (wrappers on its objects, not on their
    classes)."""
    for name in ("step", "_masks", "_apply_tokens", "_launch_draw", "_commit", "_draw"):
        setattr(engine, name, timed(getattr(engine, name), name))
    engine._read_inflight = timed(engine._read_inflight, "_read_inflight", READS)
    for name in ("execute", "host_metadata", "keep_sampled"):
        setattr(engine.runner, name, timed(getattr(engine.runner, name), name))
    engine.scheduler.schedule = timed(engine.scheduler.schedule, "schedule")
    if engine.draw_graphs is not None:
        engine.draw_graphs.draw = timed(engine.draw_graphs.draw, "graphdraw")
        engine.draw_graphs._capture = timed(engine.draw_graphs._capture, "capture")
    grammars = engine._grammars()
    worker = grammars.start()
    submit = timed(worker.submit, "submit(job)")

    def submit_at(job: Any) -> None:
        SENT.append(time.perf_counter())
        submit(job)
    worker.submit = submit_at
    inner_wait = timed(worker.wait, "wait(job)")

    def wait(number: int, job_error: bool = True) -> None:
        inner_wait(number, job_error)
        if len(JOBS) < len(SENT):
            JOBS.append(worker.last_job_times)
    worker.wait = wait
    read = engine._read_inflight

    def read_at() -> Any:
        try:
            return read()
        finally:
            READ_AT.append(time.perf_counter())
    engine._read_inflight = read_at
    signal = worker.signal
    if signal is not None:  # the eager draws' waits for masks, timed on the device
        import torch
        stream_wait = timed(signal.stream_wait, "stream_wait")

        def timed_stream_wait(bits: int) -> None:
            if torch.cuda.is_current_stream_capturing():  # a draw graph's own wait
                return stream_wait(bits)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            stream_wait(bits)
            end.record()
            STALLS.append((start, end))
        signal.stream_wait = timed_stream_wait


def job_latencies(log: Callable[[str], None]) -> None:
    """The mask jobs' path, medians over a run: from the read of a step's tokens to the job
    sent, from sent to received by the worker, the worker's work (accept + fill), and the
    device's wait for the masks."""
    def median_ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:.3f}" if values else "-"

    reads = [max((r for r in READ_AT if r <= sent), default=None) for sent in SENT]
    to_send = [sent - r for sent, r in zip(SENT, reads, strict=True) if r is not None]
    pairs = list(zip(SENT, JOBS, strict=False))
    to_worker = [received - sent for sent, (received, _) in pairs]
    busy = [done - received for received, done in JOBS]
    if STALLS:
        import torch
        torch.cuda.synchronize()
    stalls = [start.elapsed_time(end) / 1e3 for start, end in STALLS]
    log(f"   mask job, median ms: read->sent {median_ms(to_send)}, sent->worker "
        f"{median_ms(to_worker)}, worker accept+fill {median_ms(busy)}, device waits for "
        f"masks {median_ms(stalls)} (sum {sum(stalls) * 1e3:.1f} ms over {len(stalls)})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smoke run: 4 requests, once")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.repeat = 4, 1
    log, _ = open_log(args.out, "step_sections", args.quick, argv)

    import torch

    from engine import LLM, SamplingParams
    from engine.structured_output import StructuredOutput

    llm = LLM(args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
              async_scheduling=True)
    engine = llm.engine
    instrument(engine)
    convs = conversations(args.num_requests)
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))

    def params(seed: int, **kw: Any) -> SamplingParams:
        return SamplingParams(temperature=0.7, seed=seed, **kw)

    def run(label: str, plist: list[SamplingParams]) -> list:
        for record in (TIMES, CALLS, READS, READ_AT, SENT, JOBS, STALLS):
            record.clear()
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.chat(convs, plist)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = CALLS["step"]
        log(f"{label}: {tokens} tokens {wall * 1e3:.1f} ms = {tokens / wall:.0f} tok/s; "
            f"{steps} steps, {wall / steps * 1e3:.3f} ms/step")
        for name in sorted(TIMES, key=lambda k: -TIMES[k]):
            log(f"   {name:16s} {TIMES[name] / steps * 1e3:7.3f} ms/step  (calls {CALLS[name]})")
        if READS:
            long = [w for w in READS if w > 1e-3]
            log(f"   reads of tokens over 1 ms: {len(long)} of {len(READS)}, "
                f"{sum(long) * 1e3:.1f} ms in all, longest {max(READS) * 1e3:.2f} ms")
        if SENT:
            job_latencies(log)
        return outs

    llm.chat(convs[:2], params(0, max_tokens=8, structured=spec))  # compiles the grammar
    graphs = engine.draw_graphs
    for _ in range(args.repeat):
        for mode in ("graphs", "eager"):
            engine.draw_graphs = graphs if mode == "graphs" else None
            outs = run(f"(a) schema {mode}", [params(i, max_tokens=128, structured=spec)
                                              for i in range(len(convs))])
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            run(f"(b) free {mode}", [params(i, max_tokens=n, ignore_eos=True)
                                     for i, n in enumerate(lengths)])
    log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
