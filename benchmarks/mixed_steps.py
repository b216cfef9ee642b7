"""Steps with a prompt chunk among decode rows, with the mixed CUDA graphs and without.

Engine only (no gateway), on CUDA. First the logits of such steps, through their mixed graph
and eagerly (the eager result goes on): the largest difference and the rows whose argmax
differs. Then a closed loop like a serving load: ``--num-requests`` requests of
``--output-len`` tokens (seeded sampling, ``ignore_eos``), ``--concurrency`` in flight, a new
one queued as each finishes, so the steps that admit prompts also carry decode rows; run with
the mixed graphs and with them off (eager), in turn, twice each, for each prompt length of
``--prompt-lens`` (random token ids, a few tokens apart). The first requests start together, so
they also end together; with ``--stagger`` they arrive one per step, as a served load's do, and
then nearly every step admits a prompt; a step profile of that loop comes first (per kind of
step: count, host and device ms, the step's sections).

    python benchmarks/mixed_steps.py --model dummy:smollm2-135m --tokenizer DIR   # on a GPU
    python benchmarks/mixed_steps.py --model dummy:smollm2-135m --tokenizer DIR --stagger
Results: ``mixed_steps.txt``/``.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402

from benchmarks._common import add_out_argument, open_log, table  # noqa: E402
from benchmarks.graph_check import GraphVsEager  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def check_logits(llm: LLM, prompts: list[list[int]], log) -> dict[str, float]:
    """Requests admitted eight at a time among decoding ones (greedy): each step that replays
    a mixed graph is run eagerly too."""
    engine = llm.engine
    with GraphVsEager(engine.runner, "mixed_graphs") as check:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"check{i}", prompt, SamplingParams(temperature=0, max_tokens=24,
                                                                    ignore_eos=True))
            if i % 8 == 7:
                engine.step()
        while engine.has_unfinished():
            engine.step()
    log(check.summary("mixed"))
    return {"steps": len(check.diffs), "max_logit_difference": max(check.diffs, default=0.0),
            "argmax_equal": check.agree, "rows": check.rows}


def closed_loop(llm: LLM, prompts: list[list[int]], args: argparse.Namespace, tag: str,
                stagger: bool = False) -> tuple[float, float]:
    """Output tokens per second and mean milliseconds per step of the closed loop. With
    ``stagger`` the first requests arrive one per step, as a served load's do, so that later
    nearly every step admits one prompt among its decode rows."""
    engine = llm.engine
    limit = min(args.concurrency, len(prompts))
    issued = 0

    def add() -> None:
        nonlocal issued
        engine.add_request(f"{tag}{issued}", prompts[issued], SamplingParams(
            temperature=0.8, seed=issued, max_tokens=args.output_len, ignore_eos=True))
        issued += 1

    start, tokens, steps = time.perf_counter(), 0, 0
    for _ in range(1 if stagger else limit):
        add()
    while engine.has_unfinished():
        steps += 1
        if stagger and issued < limit:
            add()
        for output in engine.step():
            tokens += len(output.outputs[0].token_ids)
            if output.finished and issued < len(prompts):
                add()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return tokens / wall, wall / steps * 1e3


def step_profile(llm: LLM, prompts: list[list[int]], args: argparse.Namespace, log) -> dict:
    """The staggered closed loop with step timing on: per kind of step (with a prompt chunk
    or decode rows only), the count and mean host, device and section milliseconds."""
    engine = llm.engine
    engine.step_timings = []
    closed_loop(llm, prompts, args, "profile", stagger=True)
    timings, engine.step_timings = engine.step_timings[args.concurrency:], None
    profile = {}
    for kind in ("prompt", "decode"):
        steps = [t for t in timings if (t.tokens_computed > t.rows) == (kind == "prompt")]
        if not steps:
            continue
        row = {"steps": len(steps),
               "host_ms": sum(t.host_s for t in steps) / len(steps) * 1e3,
               "device_ms": sum(t.device_s or 0.0 for t in steps) / len(steps) * 1e3,
               "decode_graph_share": sum(t.graph_size is not None for t in steps) / len(steps)}
        for t in steps:
            for name, seconds in t.sections.items():
                row[name] = row.get(name, 0.0) + seconds * 1e3 / len(steps)
        profile[kind] = row
        log(f"  {kind} steps: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    return profile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:smollm2-135m")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder for a dummy model")
    p.add_argument("--num-requests", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prompt-lens", default="40,1024")
    p.add_argument("--num-kv-blocks", type=int, default=40000)
    p.add_argument("--stagger", action="store_true",
                   help="the first requests arrive one per step (a served load's steady state); "
                        "with a step profile first")
    add_out_argument(p)
    args = p.parse_args(argv)
    log, stem = open_log(args.out, "mixed_steps", False, argv)
    llm = LLM(args.model, tokenizer=args.tokenizer, device="cuda", dtype="bfloat16",
              max_num_seqs=args.concurrency, num_kv_blocks=args.num_kv_blocks)
    graphs = llm.engine.runner.mixed_graphs
    if graphs is None:
        raise SystemExit("no mixed CUDA graphs (needs CUDA, without enforce_eager)")
    rng = random.Random(0)
    vocab = llm.engine.runner.model.vocab_size

    def prompts(length: int) -> list[list[int]]:
        return [[rng.randrange(1000, vocab - 1000) for _ in range(length + rng.randrange(8))]
                for _ in range(args.num_requests)]

    results: dict[str, object] = {"check": check_logits(llm, prompts(40)[:96], log)}
    if args.stagger:
        results["profile"] = step_profile(llm, prompts(40), args, log)
    rows = []
    for length in [int(x) for x in args.prompt_lens.split(",")]:
        chats = prompts(length)
        runs: dict[str, list[tuple[float, float]]] = {"graphs": [], "eager": []}
        for k, name in enumerate(["graphs", "graphs", "eager", "eager", "graphs"]):
            llm.engine.runner.mixed_graphs = graphs if name == "graphs" else None
            tok_s, step_ms = closed_loop(llm, chats, args, f"p{length}r{k}", args.stagger)
            if k:  # the first run warms up
                runs[name].append((tok_s, step_ms))
            log(f"  prompt ~{length}, {name}: {tok_s:.0f} tok/s, {step_ms:.2f} ms/step")
        llm.engine.runner.mixed_graphs = graphs
        mean = {name: sum(t for t, _ in r) / len(r) for name, r in runs.items()}
        results[f"prompt_{length}"] = runs
        rows.append([f"~{length}", f"{mean['graphs']:.0f}", f"{mean['eager']:.0f}",
                     f"{mean['graphs'] / mean['eager']:.2f}"])
    log(table(rows, ["prompt tokens", "mixed graphs tok/s", "eager tok/s", "ratio"]))
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
