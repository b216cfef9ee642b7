"""CPU weight quantization (``--quantization``): speed and quality of each mode against float32,
same prompts, same run.

- **quality**: float32 greedy-decodes ``--max-tokens`` tokens for each of 16 chat prompts;
  then each mode is teacher-forced along those float32 outputs (the prompt plus the first ``t``
  output tokens, greedy, one token, for every ``t``) and the share of positions where its
  argmax equals float32's is reported (the prefix cache makes the forced prompts cheap).
- **perplexity** of each mode on a fixed text (the project's ``docs/architecture.md``, its
  first ``--ppl-tokens`` tokens in windows of ``--ppl-window``).
- **speed**: offline decode, ``ignore_eos``, batch 1 (one request) and batch 32 (32 requests at
  once): output tokens/s and the ratio to float32.

    python benchmarks/quantization.py            # float32 vs int8 vs int4 (minutes on 2 cores)
    python benchmarks/quantization.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks._common import Run, add_out_argument, machine_info, ratio  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PERPLEXITY_TEXT = ROOT / "docs" / "architecture.md"
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


def perplexity(llm, ids: list[int], window: int) -> float:
    """``exp`` of the mean next-token negative log-likelihood over ``ids``, in independent
    windows of ``window`` tokens, each one forward pass into a scratch KV cache (the engine's
    own pool and prefix cache are left alone)."""
    import torch

    runner = llm.engine.runner
    model = runner.model
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window]
            if len(chunk) < 2:
                break
            scratch = torch.zeros(runner.cache_shape(-(-len(chunk) // runner.block_size)),
                                  dtype=runner.kv_cache.dtype)
            meta, positions = runner.prefill_batch([len(chunk)])
            hidden = model.forward(torch.tensor(chunk), positions, meta, scratch)
            logits = model.compute_logits(hidden[:-1]).float()
            targets = torch.tensor(chunk[1:])
            nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
            count += len(chunk) - 1
    return math.exp(nll / count)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--modes", default="int8,int4", help="comma-separated quantization modes")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--speed-tokens", type=int, default=48)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--ppl-window", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="a tiny run (smoke test)")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.max_tokens, args.speed_tokens, args.ppl_tokens, args.ppl_window = 4, 4, 64, 32
    return args


def measure(run: Run, args: argparse.Namespace, modes: list[str],
            batches: tuple[int, ...]) -> dict[str, dict]:
    """Each mode's quality and speed figures (float32 first: the reference)."""
    from engine import LLM, SamplingParams

    n_prompts = 2 if args.quick else len(PROMPTS)
    results: dict[str, dict] = {}
    reference: list[list[int]] = []
    prompt_ids: list[list[int]] = []
    text_ids: list[int] = []
    for mode in modes:
        run(f"== {mode}")
        llm = LLM(args.model, max_model_len=1024,
                  quantization=None if mode == "float32" else mode)
        row: dict = {}
        if mode == "float32":
            prompt_ids = [llm.engine.render_chat(c) for c in chats(n_prompts)]
            outs = llm.generate(prompt_ids, SamplingParams(temperature=0.0,
                                                           max_tokens=args.max_tokens))
            reference = [o.outputs[0].token_ids for o in outs]
            text_ids = llm.tokenizer.encode(PERPLEXITY_TEXT.read_text())[:args.ppl_tokens]
        start = time.perf_counter()
        forced = forced_argmax(llm, prompt_ids, reference)
        agree = sum(a == b for f, r in zip(forced, reference, strict=True)
                    for a, b in zip(f, r, strict=True))
        total = sum(len(r) for r in reference)
        row["argmax_agreement"] = agree / total
        run(f"  teacher-forced argmax = float32's: {agree}/{total} "
            f"({time.perf_counter() - start:.0f} s)")
        row["perplexity"] = perplexity(llm, text_ids, args.ppl_window)
        run(f"  perplexity on {PERPLEXITY_TEXT.name} ({len(text_ids)} tokens): "
            f"{row['perplexity']:.3f}")
        for b in batches:
            row[f"tok_s_{b}"] = decode_speed(llm, b, args.speed_tokens)
            run(f"  decode batch {b}: {row[f'tok_s_{b}']:.1f} tok/s")
        results[mode] = row
        del llm
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args.out, "quantization", quick=args.quick, argv=argv)  # creates args.out
    modes = ["float32"] + [m for m in args.modes.split(",") if m]
    batches = (1, 4) if args.quick else (1, 32)
    results = measure(run, args, modes, batches)
    base = results["float32"]
    rows = [[m, f"{r['argmax_agreement']:.1%}",
             f"{r['perplexity']:.3f} ({ratio(r['perplexity'], base['perplexity']):.3f}x)"]
            + [f"{r[f'tok_s_{b}']:.1f} ({ratio(r[f'tok_s_{b}'], base[f'tok_s_{b}']):.2f}x)"
               for b in batches] for m, r in results.items()]
    run.section("quantization modes against float32, same run", rows,
                ["mode", "argmax = float32", "perplexity"]
                + [f"batch {b} tok/s" for b in batches])
    run.write_json({"argv": sys.argv[1:] if argv is None else argv, "machine": machine_info(),
                    "results": results},
                  indent=1)

    def draw(ax) -> None:
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            ax.bar([j + i * width for j in range(len(batches))],
                   [results[mode][f"tok_s_{b}"] for b in batches], width, label=mode)
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(batches))],
                      [f"batch {b}" for b in batches])
        ax.set_ylabel("decode tokens/s (CPU)")

    if not args.quick:
        run.plot(f"{run.stem}.png", draw, figsize=(6, 3.5), dpi=120)
    run.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
