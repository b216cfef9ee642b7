"""The engine's offline throughput on a ShareGPT-like workload, read through the engine's public
step timing (``LLMEngine.step_timings``, ``engine.step_timing``), and its floor.

Workload: N requests (seeded log-normal lengths: prompts clipped to [32, 1024] tokens, outputs
to [32, 512]), random token ids, greedy, ``ignore_eos``, all queued at once and stepped to the
end, after an untimed warm-up pass (the first 64 requests, 8 output tokens each) that compiles
the kernel variants the run meets. Each step's timing gives its host time, its rows, the tokens
it computed over how much context, and whether it replayed a decode CUDA graph (and, on CUDA,
that replay's device time). Steady decode steps: CUDA-graph steps right after another one (an
overlapped step's time includes waiting for the step before it) with at least 15/16 of
``max_num_seqs`` rows. The floor of the run (``floor.workload_floor``) sums each step's floors
from the matmul rates and the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from benchmarks import floor
from benchmarks._common import log
from benchmarks.hardware import l2_cache_bytes, matmul_rates, wall_s
from engine import LLM, SamplingParams
from engine.loader import dummy_config
from engine.outputs import RequestOutput
from engine.step_timing import StepTiming

WARMUP_REQUESTS, WARMUP_TOKENS = 64, 8  # the untimed warm-up pass
PROGRESS_EVERY_S = 5.0

Requests = list[tuple[list[int], int]]  # (prompt token ids, output tokens)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The model, device and engine limits of the 1,000-request workload."""
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=2048)


def prompt_vocab(model: str) -> int:
    """Token ids random prompts draw from: a dummy preset's vocabulary, else the first 1,000
    (ids every real tokenizer has)."""
    if model.startswith("dummy:"):
        return dummy_config(model.removeprefix("dummy:")).vocab_size
    return 1000


def make_requests(n: int, vocab: int, seed: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int]) -> Requests:
    """ShareGPT-like: log-normal lengths (medians ~1/4 of each range's top), clipped."""
    rng = np.random.default_rng(seed)
    p_lo, p_hi = prompt_range
    o_lo, o_hi = output_range
    prompt_lens = np.clip(rng.lognormal(math.log(p_hi / 4), 0.8, n), p_lo, p_hi).astype(int)
    output_lens = np.clip(rng.lognormal(math.log(o_hi / 3), 0.7, n), o_lo, o_hi).astype(int)
    return [(rng.integers(0, vocab, size=int(p)).tolist(), int(o))
            for p, o in zip(prompt_lens, output_lens, strict=True)]


def run_requests(llm: LLM, requests: Requests) -> list[RequestOutput]:
    """Queue every request (greedy, ``ignore_eos``) and step the engine until all are done,
    logging progress every few seconds; outputs in request order."""
    engine = llm.engine
    ids = [f"offline-{i}" for i in range(len(requests))]
    for request_id, (prompt, out) in zip(ids, requests, strict=True):
        engine.add_request(request_id, prompt,
                           SamplingParams(temperature=0, max_tokens=out, ignore_eos=True),
                           final_only=True)
    finished: dict[str, RequestOutput] = {}
    steps, last_log = 0, time.perf_counter()
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
        if time.perf_counter() - last_log > PROGRESS_EVERY_S:
            last_log = time.perf_counter()
            stats = engine.stats()
            log(f"  engine: {len(finished)}/{len(requests)} requests done, {steps} steps, "
                f"{stats.num_requests_running} running, {stats.num_requests_waiting} waiting")
    return [finished[request_id] for request_id in ids]


def engine_warmup(llm: LLM, requests: Requests, device: torch.device) -> float:
    """An untimed pass over the first requests with short outputs, so that the kernel variants
    the run meets are compiled (Triton JIT, cuBLAS heuristics) outside the timed window;
    returns its seconds."""
    batch = [(prompt, WARMUP_TOKENS) for prompt, _ in requests[:WARMUP_REQUESTS]]
    return wall_s(lambda: run_requests(llm, batch), device)[0]


def steady_decode_steps(timings: list[StepTiming], max_rows: int) -> list[int]:
    """Indices of the steady decode steps (module docstring)."""
    return [i for i, t in enumerate(timings)
            if i and t.graph_size is not None and timings[i - 1].graph_size is not None
            and t.rows >= max_rows * 15 // 16]


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def summarise_steps(timings: list[StepTiming], max_rows: int) -> dict:
    """The run's step counts and times, its steady decode steps (host time, their graph
    replays' device time, rows, context per row) and each step's work for the floor."""
    graph_time = sum(t.host_s for t in timings if t.graph_size is not None)
    full = [timings[i] for i in steady_decode_steps(timings, max_rows)]
    in_situ = [t.graph_device_s for t in full]
    return {
        "steps": len(timings),
        "graph_steps": sum(t.graph_size is not None for t in timings),
        "eager_steps": sum(t.graph_size is None and t.rows > 0 for t in timings),
        "full_decode_steps": len(full), "graph_steps_seconds": graph_time,
        "eager_steps_seconds": sum(t.host_s for t in timings) - graph_time,
        "full_decode_step_median_s": _median([t.host_s for t in full]),
        # the same steps' graph replays, timed on the device as they ran
        "full_decode_graph_median_s": _median([s for s in in_situ if s is not None]),
        "full_decode_step_median_rows": int(np.median([t.rows for t in full])) if full else None,
        "full_decode_step_median_ctx": int(np.median([t.context_tokens // t.rows
                                                      for t in full])) if full else None,
        "step_work": [(t.tokens_computed, t.context_tokens) for t in timings],
        "step_rows": [t.rows for t in timings],
    }


def engine_throughput(llm: LLM, requests: Requests, device: torch.device) -> dict:
    """Warm up, then run every request with the engine's step timing on; the run's tokens per
    second and :func:`summarise_steps` of its steps."""
    warmup_s = engine_warmup(llm, requests, device)
    engine = llm.engine
    preemptions0 = engine.scheduler.num_preemptions
    engine.step_timings = []
    try:
        elapsed, outs = wall_s(lambda: run_requests(llm, requests), device)
        timings = engine.step_timings
    finally:
        engine.step_timings = None
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(o for _, o in requests), "ignore_eos: every request runs to max"
    prompt_tokens = sum(len(p) for p, _ in requests)
    steps = summarise_steps(timings, engine.config.max_num_seqs)
    return {
        "seconds": elapsed, "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / elapsed,
        **{key: steps.pop(key) for key in ("steps", "graph_steps", "eager_steps")},
        "num_preemptions": engine.scheduler.num_preemptions - preemptions0,
        "warmup_seconds": warmup_s, **steps,
    }


def workload_floor(llm: LLM, et: dict, rates: floor.Rates, copy_bw: float,
                   l2_bytes: int) -> dict:
    """``floor.workload_floor`` of the steps of the throughput run ``et``
    (:func:`engine_throughput`)."""
    model = llm.engine.runner.model
    return floor.workload_floor(
        floor.WeightSplit.of(model),
        floor.kv_bytes_per_token(model, llm.engine.runner.kv_cache.element_size()),
        et["step_work"], et["step_rows"], et["output_tokens"], et["seconds"], rates, copy_bw,
        l2_bytes)


def measure_throughput(llm: LLM, requests: Requests, copy_bw: float, device: torch.device,
                       sync_baseline: bool) -> dict:
    """``engine_throughput`` (its floor on CUDA; again with overlapped scheduling toggled when
    ``sync_baseline``), as gpu_e2e.json's fields."""
    log(f"throughput: {len(requests)} requests, prompts mean "
        f"{np.mean([len(p) for p, _ in requests]):.0f} tokens, outputs mean "
        f"{np.mean([o for _, o in requests]):.0f} tokens")
    engine = llm.engine
    et = engine_throughput(llm, requests, device)
    result = {"engine_throughput": et, "async_scheduling": engine.async_scheduling}
    log(f"engine: {et['output_tokens']} output tokens in {et['seconds']:.1f}s = "
        f"{et['output_tokens_per_s']:.0f} tok/s ({et['steps']} steps, {et['graph_steps']} "
        f"graph, {et['num_preemptions']} preemptions; warm-up pass before it "
        f"{et['warmup_seconds']:.1f}s; overlapped scheduling "
        f"{'on' if engine.async_scheduling else 'off'})")
    if device.type == "cuda":
        result["floor"] = workload_floor(llm, et, matmul_rates(llm, device), copy_bw,
                                         l2_cache_bytes(device))
        log(f"floor of these steps: {result['floor']}")
    if sync_baseline:
        engine.async_scheduling = not engine.async_scheduling
        try:
            other = engine_throughput(llm, requests, device)
        finally:
            engine.async_scheduling = not engine.async_scheduling
        result["engine_throughput_other_mode"] = other
        log(f"the same with overlapped scheduling toggled: "
            f"{other['output_tokens_per_s']:.0f} tok/s")
    return result
