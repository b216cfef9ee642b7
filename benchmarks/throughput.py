"""Offline throughput on this CPU: the engine against transformers ``generate``, same requests,
same weights, same run.

A fixed-seed set of requests with ShareGPT-like lengths squeezed into prompts 32–512 and
outputs 32–256 tokens (log-uniform: many short, a long tail), random token ids, ``ignore_eos``
so every request produces exactly its output length.

- engine: ``LLM("smollm2")`` (defaults: continuous batching, chunked prefill, paged KV; with
  ``--quantization`` its CPU weights in int8 or int4), every request submitted at once, greedy,
  ``max_tokens`` = the request's own output length.
- transformers: the same weights (``engine.loader.build_hf_model``, storage shared) and
  ``generate(do_sample=False)`` over the same requests in request order, in padded batches of
  16 (left padding + attention mask). A static batch must run until its longest member is done,
  so each batch generates ``min_new_tokens = max_new_tokens =`` its longest output length;
  only each request's *own* output length counts as useful tokens (the surplus is reported as
  padding waste). EOS is disabled as with ``ignore_eos``.

Tokens/s = useful output tokens / wall seconds. Because this 2-core machine is shared, the
CPU seconds of this process are reported too (tokens per CPU-second is much less sensitive to
other load), and with ``--repeats`` the two systems alternate.

    python benchmarks/throughput.py              # 64 requests (several minutes on 2 cores)
    python benchmarks/throughput.py --quick      # 8 short requests; the smoke test
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402

from benchmarks._common import (  # noqa: E402
    Run,
    Tee,
    add_out_argument,
    args_json,
    mean,
    ratio,
    uniformish_lengths,
)


def make_requests(n: int, seed: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], vocab: int) -> list[tuple[list[int], int]]:
    lengths = uniformish_lengths(n, seed, prompt_range, output_range)
    rng = random.Random(seed + 1)
    # avoid special tokens at the low end of the vocabulary
    return [([rng.randrange(100, vocab) for _ in range(p)], o) for p, o in lengths]


def run_engine(llm, requests: list[tuple[list[int], int]], log: Tee) -> dict:
    from engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in requests]
    engine = llm.engine
    before = llm.stats()
    w0, c0 = time.perf_counter(), time.process_time()
    ids = []
    for i, ((prompt, _), p) in enumerate(zip(requests, params, strict=True)):
        rid = f"tp{time.monotonic_ns()}-{i}"
        engine.add_request(rid, prompt, p, final_only=True)
        ids.append(rid)
    done: dict[str, int] = {}
    steps = 0
    last = w0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = len(out.outputs[0].token_ids)
        steps += 1
        now = time.perf_counter()
        if now - last > 10:
            s = llm.stats()
            decoded = s.num_decode_tokens_computed - before.num_decode_tokens_computed
            log(f"  engine: step {steps}, {len(done)}/{len(ids)} done, running "
                f"{s.num_requests_running}, {decoded} decode tokens, {now - w0:.0f} s")
            last = now
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    useful = sum(done[r] for r in ids)
    assert useful == sum(o for _, o in requests), (useful, sum(o for _, o in requests))
    after = llm.stats()
    return {"wall_s": wall, "cpu_s": cpu, "useful_tokens": useful, "generated_tokens": useful,
            "steps": steps, "preemptions": after.num_preemptions - before.num_preemptions,
            "prefill_tokens": after.num_prefill_tokens_computed
            - before.num_prefill_tokens_computed}


def run_hf(model, requests: list[tuple[list[int], int]], batch_size: int, log: Tee) -> dict:
    w0, c0 = time.perf_counter(), time.process_time()
    useful = generated = 0
    for b in range(0, len(requests), batch_size):
        batch = requests[b:b + batch_size]
        width = max(len(p) for p, _ in batch)
        new = max(o for _, o in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):
            input_ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        assert out.shape[1] == width + new, out.shape
        useful += sum(o for _, o in batch)
        generated += len(batch) * new
        log(f"  transformers: batch {b // batch_size + 1}/{-(-len(requests) // batch_size)} "
            f"({len(batch)} requests, prompt width {width}, {new} new tokens) in "
            f"{time.perf_counter() - t:.1f} s")
    return {"wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0,
            "useful_tokens": useful, "generated_tokens": generated}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-range", default="32,512")
    ap.add_argument("--output-range", default="32,256")
    ap.add_argument("--batch-size", type=int, default=16, help="transformers' padded batch")
    ap.add_argument("--repeats", type=int, default=1, help="alternate the two systems N times")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quantization", default=None, choices=["int8", "int4"],
                    help="the engine's CPU weights (transformers keeps float32)")
    ap.add_argument("--quick", action="store_true", help="a tiny run (smoke test)")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.num_requests, args.prompt_range, args.output_range = 8, "8,32", "4,12"
        args.batch_size = 4
    return args


def alternate(args: argparse.Namespace, llm, hf, requests: list, log: Tee) -> dict:
    """Each system's runs, ``--repeats`` times, the order alternating: {name: [run]}."""
    runs: dict[str, list[dict]] = {"engine": [], "transformers": []}
    for r in range(args.repeats):
        order = ("engine", "transformers") if r % 2 == 0 else ("transformers", "engine")
        for name in order:
            log(f"run {r + 1}/{args.repeats}: {name}")
            res = (run_engine(llm, requests, log) if name == "engine"
                   else run_hf(hf, requests, args.batch_size, log))
            res["tok_s"] = res["useful_tokens"] / res["wall_s"]
            res["tok_cpu_s"] = res["useful_tokens"] / res["cpu_s"]
            runs[name].append(res)
            log(f"  {name}: {res['useful_tokens']} tokens in {res['wall_s']:.1f} s wall "
                f"({res['tok_s']:.1f} tok/s), {res['cpu_s']:.1f} CPU-s "
                f"({res['tok_cpu_s']:.1f} tok/CPU-s)")
    return runs


def report(run: Run, args: argparse.Namespace, runs: dict, requests: list) -> None:
    """The bar plot and the table."""
    def agg(name: str, key: str) -> float:
        return mean(r[key] for r in runs[name])

    e_tps, h_tps = agg("engine", "tok_s"), agg("transformers", "tok_s")
    e_cps, h_cps = agg("engine", "tok_cpu_s"), agg("transformers", "tok_cpu_s")

    def bars(ax) -> None:
        names = ["engine (paged, continuous)", "transformers generate (batch 16)"]
        xs = range(2)
        ax.bar([x - 0.2 for x in xs], [e_tps, h_tps], width=0.4, label="tokens / wall s")
        ax.bar([x + 0.2 for x in xs], [e_cps, h_cps], width=0.4, label="tokens / CPU s")
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.set(ylabel="output tokens per second",
               title=f"offline throughput, {len(requests)} requests, SmolLM2-135M, CPU")

    run.plot(f"{run.stem}.png", bars, figsize=(6, 3.8))
    e, h = runs["engine"][-1], runs["transformers"][-1]
    run.section(f"offline throughput, {len(requests)} requests "
                f"({sum(o for _, o in requests)} useful output tokens), "
                f"mean of {args.repeats} run(s)", [
        ["output tokens/s (wall)", e_tps, h_tps, f"{ratio(e_tps, h_tps):.2f}×"],
        ["output tokens per CPU-second", e_cps, h_cps, f"{ratio(e_cps, h_cps):.2f}×"],
        ["wall seconds", agg("engine", "wall_s"), agg("transformers", "wall_s"),
         f"{ratio(agg('transformers', 'wall_s'), agg('engine', 'wall_s')):.2f}× faster"],
        ["tokens generated (incl. padding surplus)", e["generated_tokens"],
         h["generated_tokens"], ""],
    ], ["figure", "engine", "transformers", "engine / transformers"])
    verdict = "met" if ratio(e_tps, h_tps) >= 2 else "MISSED"
    run(f"target engine ≥ 2× transformers (wall tokens/s): {ratio(e_tps, h_tps):.2f}× — {verdict}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args.out, "throughput", quick=args.quick, argv=argv)

    from engine import LLM
    from engine.loader import build_hf_model, load_model

    run("loading the engine and the transformers model (same weights) ...")
    llm = LLM(args.model, seed=args.seed, quantization=args.quantization)
    hf = build_hf_model(load_model(args.model, torch.device("cpu"), torch.float32))
    hf.generation_config.eos_token_id = None  # run past EOS, like ignore_eos=True
    pr = tuple(int(x) for x in args.prompt_range.split(","))
    orr = tuple(int(x) for x in args.output_range.split(","))
    requests = make_requests(args.num_requests, args.seed, pr, orr, llm.engine.vocab_size)
    ps, os_ = [len(p) for p, _ in requests], [o for _, o in requests]
    run(f"{len(requests)} requests: prompt {min(ps)}–{max(ps)} (mean {mean(ps):.0f}), output "
        f"{min(os_)}–{max(os_)} (mean {mean(os_):.0f}); {sum(os_)} output tokens in all")

    # warm-up (one tiny request each, not timed)
    run_engine(llm, [(requests[0][0][:16], 2)], Tee(None))
    run_hf(hf, [(requests[0][0][:16], 2)], 1, Tee(None))

    runs = alternate(args, llm, hf, requests, run)
    run.write_json({"args": args_json(args), "runs": runs,
                    "requests": [[len(p), o] for p, o in requests]}, indent=1)
    report(run, args, runs, requests)
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
