"""Tensor parallelism (``--tensor-parallel-size N``): correctness against one rank, offline
throughput of ``gpu_e2e.py``'s workload against its floor, and the decode step with 1 and N
ranks. One call runs everything and prints a short table last.

    python benchmarks/tensor_parallel.py --tensor-parallel-size 2          # 2 H200s, 8B shapes
    python benchmarks/tensor_parallel.py --tensor-parallel-size 2 \\
        --model dummy:llama-3.1-70b --single-rank none                   # does not fit one GPU
    python benchmarks/tensor_parallel.py --quick --device cpu --dtype float32 \\
        --model dummy:/path/config.json                                  # Gloo smoke test

- Correctness: ``--correct-prompts`` random-token prompts, greedy, float32 weights from the
  same seed: N ranks must give the single rank's tokens (all-reduce sums may differ from one
  GEMM's in the last bits, so a near-tie could flip: each divergence is reported).
- Throughput: ``offline_throughput.make_requests`` (ShareGPT-like lengths, ``ignore_eos``), all
  submitted at once after an untimed warm-up pass; on CUDA its floor is that of one rank's shard
  of every step at one GPU's measured GEMM rate and copy bandwidth
  (``offline_throughput.workload_floor``): the ranks run in parallel, and the all-reduces count
  as overhead.
- Decode step: ``--decode-batch`` rows (and 1 row) at ``--decode-ctx`` tokens of context,
  median wall time of engine steps (host work and all-reduces included), 1 rank and N ranks.

Writes ``tensor_parallel.json`` (and a plot) to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import hardware, hf_reference  # noqa: E402
from benchmarks import offline_throughput as offline  # noqa: E402
from benchmarks._common import add_out_argument, open_log, save_figure, table  # noqa: E402

TARGET_BATCH1 = 0.6  # decode step at batch 1: N ranks / 1 rank, at most


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensor-parallel-size", type=int, default=2)
    offline.add_workload_args(ap)
    ap.add_argument("--correct-prompts", type=int, default=8)
    ap.add_argument("--correct-tokens", type=int, default=32)
    ap.add_argument("--decode-batch", type=int, default=256)
    ap.add_argument("--decode-ctx", type=int, default=1024)
    ap.add_argument("--single-rank", choices=("all", "none"), default="all",
                    help="none: the model does not fit one device (no correctness check, no "
                         "single-rank decode step)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.num_requests, args.correct_prompts, args.correct_tokens = 6, 2, 4
        args.decode_batch, args.decode_ctx, args.max_num_seqs = 4, 32, 8
        args.max_model_len = 256
    return args


def engine(args, ranks: int, dtype: str | None = None, **extra):
    from engine import LLM

    return LLM(args.model, device=args.device, dtype=dtype or args.dtype, seed=args.seed,
               tensor_parallel_size=ranks, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               max_model_len=args.max_model_len, enable_prefix_caching=False, **extra)


def release(llm) -> None:
    device = llm.engine.runner.device
    llm.engine.shutdown()
    del llm
    hardware.release_memory(device)


def greedy_tokens(args, ranks: int, prompts: list[list[int]]) -> list[list[int]]:
    from engine import SamplingParams

    llm = engine(args, ranks, "float32")
    params = SamplingParams(temperature=0, max_tokens=args.correct_tokens, ignore_eos=True)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        release(llm)


def decode_step_s(llm, batch: int, ctx: int, steps: int = 16) -> float:
    """Median wall time of an engine step with ``batch`` rows decoding at ``ctx`` tokens."""
    from engine import SamplingParams

    eng = llm.engine
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    ids = [f"decode-{i}" for i in range(batch)]
    for rid in ids:
        eng.add_request(rid, rng.integers(0, eng.vocab_size, ctx).tolist(), params)
    started: set[str] = set()
    while len(started) < batch:  # prefills done: every row has its first token
        started |= {o.request_id for o in eng.step() if o.outputs[0].token_ids}
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        hardware.sync(eng.runner.device)
        times.append(time.perf_counter() - t)
    for rid in ids:
        eng.abort(rid)
    return float(np.median(times))


def run(args, log) -> dict:
    n = args.tensor_parallel_size
    vocab = offline.prompt_vocab(args.model)
    prompts = hf_reference.correctness_prompts(args)
    raw: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    if args.single_rank == "all":
        single, split = greedy_tokens(args, 1, prompts), greedy_tokens(args, n, prompts)
        raw["correctness"] = {"equal": sum(a == b for a, b in zip(single, split, strict=True)),
                              "prompts": len(prompts)}
        log(f"float32 greedy, {n} ranks vs 1: {raw['correctness']}")
    steps: dict[int, dict[int, float]] = {}
    for ranks in ([1, n] if args.single_rank == "all" else [n]):
        llm = engine(args, ranks)
        steps[ranks] = {b: decode_step_s(llm, b, args.decode_ctx)
                        for b in (1, args.decode_batch)}
        log(f"decode step, {ranks} rank(s), ctx {args.decode_ctx}: "
            f"{ {b: round(s * 1e3, 2) for b, s in steps[ranks].items()} } ms")
        if ranks == n:
            prompt_range, output_range = ((8, 64), (4, 32)) if args.quick else ((32, 1024),
                                                                                (32, 512))
            requests = offline.make_requests(args.num_requests, vocab, args.seed, prompt_range,
                                             output_range)
            device = llm.engine.runner.device
            et = offline.engine_throughput(llm, requests, device)
            raw["throughput"] = {k: v for k, v in et.items()
                                 if k not in ("step_work", "step_rows")}
            log(f"throughput, {n} ranks: {et['output_tokens_per_s']:.0f} tok/s "
                f"({et['seconds']:.1f} s, {et['steps']} steps)")
            if device.type == "cuda":
                raw["floor"] = offline.workload_floor(llm, et, hardware.matmul_rates(llm, device),
                                                      hardware.copy_bandwidth(device),
                                                      hardware.l2_cache_bytes(device))
                log(f"floor of these steps (one rank's shard): {raw['floor']}")
        release(llm)
    raw["decode_step_s"] = {str(r): {str(b): s for b, s in v.items()} for r, v in steps.items()}
    return raw


def summary(raw: dict, args) -> list[list]:
    n = args.tensor_parallel_size
    rows = []
    if "correctness" in raw:
        c = raw["correctness"]
        rows.append(["float32 greedy = 1 rank", f"{c['equal']}/{c['prompts']}", "equal"])
    steps = raw["decode_step_s"]
    for batch in (1, args.decode_batch):
        mine = steps[str(n)][str(batch)]
        if "1" in steps:
            ratio = mine / steps["1"][str(batch)]
            target = f"<= {TARGET_BATCH1}" if batch == 1 else ""
            verdict = ("met" if ratio <= TARGET_BATCH1 else "MISSED") if batch == 1 else ""
            rows.append([f"decode step batch {batch} (ms): {n} ranks / 1",
                         f"{mine * 1e3:.2f} / {steps['1'][str(batch)] * 1e3:.2f} = {ratio:.2f}",
                         f"{target} {verdict}".strip()])
        else:
            rows.append([f"decode step batch {batch} (ms), {n} ranks", f"{mine * 1e3:.2f}", ""])
    tp = raw["throughput"]
    floor = raw.get("floor")
    rows.append([f"throughput, {n} ranks (tok/s)", f"{tp['output_tokens_per_s']:.0f}",
                 f"{floor['fraction']:.0%} of its floor" if floor else "(floor: CUDA only)"])
    return rows


def plot(raw: dict, args, ax) -> None:
    batches = [str(b) for b in (1, args.decode_batch)]
    for i, (ranks, by_batch) in enumerate(raw["decode_step_s"].items()):
        ax.bar([j + 0.4 * i for j in range(len(batches))],
               [by_batch[b] * 1e3 for b in batches], width=0.4, label=f"{ranks} rank(s)")
    ax.set_xticks([j + 0.2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set(ylabel="decode step (ms)", title=f"{args.model}, context {args.decode_ctx}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log, stem = open_log(args.out, "tensor_parallel", args.quick, argv)
    raw = run(args, log)
    rows = summary(raw, args)
    (args.out / f"{stem}.json").write_text(json.dumps(raw, indent=1))
    save_figure(args.out / f"{stem}.png", functools.partial(plot, raw, args), figsize=(6, 4))
    log("")
    log(table(rows, ["figure", "measured", "target"]))
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
