"""CPU weight quantization (``--quantization``): speed and quality of each mode against float32,
same prompts, same run.

- **quality**: float32 greedy-decodes ``--max-tokens`` tokens for each of 16 chat prompts;
  then each mode is teacher-forced along those float32 outputs (the prompt plus the first ``t``
  output tokens, greedy, one token, for every ``t``) and the share of positions where its
  argmax equals float32's is reported (the prefix cache makes the forced prompts cheap).
- **speed**: offline decode, ``ignore_eos``, batch 1 (one request) and batch 32 (32 requests at
  once): output tokens/s and the ratio to float32.

    python benchmarks/quantization.py            # float32 vs int8 (a few minutes on 2 cores)
    python benchmarks/quantization.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks._common import DEFAULT_OUT, machine_info, open_log, plt, ratio, table  # noqa: E402

PROMPTS = [
    "What is the capital of France?", "Write a short poem about the sea and the stars.",
    "Explain paged attention in one paragraph.", "List three prime numbers and say why.",
    "Write a Python function that reverses a linked list.", "Hi!",
    "Summarise the plot of Romeo and Juliet in two sentences.", "Give me a haiku about GPUs.",
    "What is 17 * 23? Show your steps.", "Describe a cat to someone who has never seen one.",
    "What is the difference between TCP and UDP?", "Why is the sky blue? Answer briefly.",
    "Translate 'good morning, my friend' into Spanish and German.",
    "Write a SQL query that counts orders per customer and explain it.",
    "What are the main causes of inflation?", "How do vaccines train the immune system?",
]


def chats(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(n)]


def decode_speed(llm, batch: int, tokens: int) -> float:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.chat(chats(batch), SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.chat(chats(batch), params)
    wall = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def forced_argmax(llm, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    """Each position's greedy token given the float32 prefix before it."""
    from engine import SamplingParams

    forced = [p + o[:t] for p, o in zip(prompts, outputs, strict=True) for t in range(len(o))]
    outs = llm.generate(forced, SamplingParams(temperature=0.0, max_tokens=1))
    flat = [o.outputs[0].token_ids[0] for o in outs]
    result, i = [], 0
    for o in outputs:
        result.append(flat[i:i + len(o)])
        i += len(o)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--modes", default="int8", help="comma-separated quantization modes")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--speed-tokens", type=int, default=48)
    ap.add_argument("--quick", action="store_true", help="a tiny run (smoke test)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.quick:
        args.max_tokens, args.speed_tokens = 4, 4
    log, stem = open_log(args.out, "quantization", args.quick, argv)  # creates args.out

    from engine import LLM, SamplingParams

    modes = ["float32"] + [m for m in args.modes.split(",") if m]
    n_prompts = 2 if args.quick else len(PROMPTS)
    batches = (1, 4) if args.quick else (1, 32)
    results: dict[str, dict] = {}
    reference: list[list[int]] = []
    prompt_ids: list[list[int]] = []
    for mode in modes:
        log(f"== {mode}")
        llm = LLM(args.model, max_model_len=1024,
                  quantization=None if mode == "float32" else mode)
        row: dict = {}
        if mode == "float32":
            prompt_ids = [llm.engine.render_chat(c) for c in chats(n_prompts)]
            outs = llm.generate(prompt_ids, SamplingParams(temperature=0.0,
                                                           max_tokens=args.max_tokens))
            reference = [o.outputs[0].token_ids for o in outs]
        start = time.perf_counter()
        forced = forced_argmax(llm, prompt_ids, reference)
        agree = sum(a == b for f, r in zip(forced, reference, strict=True)
                    for a, b in zip(f, r, strict=True))
        total = sum(len(r) for r in reference)
        row["argmax_agreement"] = agree / total
        log(f"  teacher-forced argmax = float32's: {agree}/{total} "
            f"({time.perf_counter() - start:.0f} s)")
        for b in batches:
            row[f"tok_s_{b}"] = decode_speed(llm, b, args.speed_tokens)
            log(f"  decode batch {b}: {row[f'tok_s_{b}']:.1f} tok/s")
        results[mode] = row
        del llm

    base = results["float32"]
    rows = [[m, f"{r['argmax_agreement']:.1%}"]
            + [f"{r[f'tok_s_{b}']:.1f} ({ratio(r[f'tok_s_{b}'], base[f'tok_s_{b}']):.2f}x)"
               for b in batches] for m, r in results.items()]
    log(table(rows, ["mode", "argmax = float32"] + [f"batch {b} tok/s" for b in batches]))
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"argv": sys.argv[1:] if argv is None else argv, "machine": machine_info(),
         "results": results}, indent=1))
    pyplot = plt() if not args.quick else None
    if pyplot is not None:
        fig, ax = pyplot.subplots(figsize=(6, 3.5))
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            ax.bar([j + i * width for j in range(len(batches))],
                   [results[mode][f"tok_s_{b}"] for b in batches], width, label=mode)
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(batches))],
                      [f"batch {b}" for b in batches])
        ax.set_ylabel("decode tokens/s (CPU)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / f"{stem}.png", dpi=120)
    log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
