"""FP8 KV cache (``--kv-cache-dtype fp8``) against the model-dtype (bf16) cache, same weights,
same run: pool size, the batch-256 decode step, offline throughput, and accuracy.

    PYTHONUNBUFFERED=1 python benchmarks/kv_cache_dtype.py       # H200: dummy:llama-3.1-8b
    python benchmarks/kv_cache_dtype.py --device cpu --model smollm2 --num-requests 0
        # accuracy only, on the real SmolLM2 weights (bf16) and its chat template

- Pool: KV blocks at the same ``--gpu-memory-utilization``.
- Decode step: the captured CUDA graph of ``--decode-batch`` rows replayed over
  ``--decode-ctx`` cached tokens per row (``decode_step.decode_step_roofline``: median of 30
  replays, roofline = weight + KV bytes over the copy bandwidth measured in the same run).
- Throughput: ``offline_throughput``'s N-request workload (log-normal lengths, greedy,
  ``ignore_eos``) after its untimed warm-up pass.
- Accuracy: ``--prompts`` prompts (chat prompts through the model's template when it has a
  tokenizer, else random tokens) and the bf16 cache's ``--tokens`` greedy tokens after each:
  both engines are teacher-forced along that one path (one request per position, so both are
  judged at the same positions) and so are the same weights upcast to float32 (transformers):
  the share of positions whose engine token is the float32 argmax.

Writes ``kv_cache_dtype.json`` to ``--out`` (default ``$OUT``, else ``benchmarks/out``);
prints a table last.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import add_out_argument, args_json, log  # noqa: E402
from benchmarks.decode_step import decode_step_roofline  # noqa: E402
from benchmarks.hardware import copy_bandwidth, release_memory  # noqa: E402
from benchmarks.offline_throughput import engine_throughput, make_requests  # noqa: E402
from benchmarks.serving import TOPICS  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.loader import LoadedModel, build_hf_model, load_model  # noqa: E402


def run_engine(args, loaded: LoadedModel, kv_cache_dtype: str, prompts: list[list[int]],
               paths: list[list[int]] | None, requests, copy_bw: float) -> dict:
    """Pool size, decode steps and throughput of one cache dtype, and its greedy token at
    every position of ``paths`` (None: of the engine's own greedy paths, returned as
    ``"paths"``)."""
    start = time.perf_counter()
    device = torch.device(args.device)
    llm = LLM(model=args.model, device=args.device, dtype="bfloat16", loaded=loaded,
              kv_cache_dtype=kv_cache_dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, enable_prefix_caching=False, seed=args.seed)
    runner = llm.engine.runner
    result: dict = {"num_blocks": runner.num_blocks, "bytes_per_block": runner.bytes_per_block,
                    "init_s": time.perf_counter() - start}
    log(f"{kv_cache_dtype}: {runner.num_blocks} blocks of {runner.bytes_per_block} bytes, "
        f"up in {result['init_s']:.1f}s")
    if paths is None:
        greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        paths = result["paths"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    forced = [p + path[:j] for p, path in zip(prompts, paths, strict=True)
              for j in range(len(path))]
    next_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    result["chosen"] = [o.outputs[0].token_ids[0] for o in llm.generate(forced, next_token)]
    result["decode_step"] = [decode_step_roofline(llm, args.decode_batch, ctx, copy_bw, device)
                             for ctx in args.decode_ctx] if device.type == "cuda" else []
    for r in result["decode_step"]:
        log(f"{kv_cache_dtype}: decode step {r}")
    if args.num_requests:
        result["throughput"] = engine_throughput(llm, requests, device)
        log(f"{kv_cache_dtype}: {result['throughput']['output_tokens_per_s']:.0f} tok/s")
    del llm, runner
    release_memory(device)
    return result


def fp32_argmax_along(hf, prompt: list[int], path: list[int],
                      device: torch.device) -> list[int]:
    """``hf``'s argmax at every position of ``path`` after ``prompt``, fed ``path`` so far."""
    ids = torch.tensor([prompt + path[:-1]], device=device)
    with torch.inference_mode():
        return hf(ids).logits[0, len(prompt) - 1:].argmax(dim=-1).tolist()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--decode-batch", type=int, default=256)
    ap.add_argument("--decode-ctx", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)

    device = torch.device(args.device)
    copy_bw = copy_bandwidth(device) if device.type == "cuda" else 0.0
    loaded = load_model(args.model, device, torch.bfloat16, seed=args.seed, use_cache=False)
    vocab = loaded.config.vocab_size
    rng = np.random.default_rng(args.seed + 7)
    if loaded.tokenizer is not None:
        prompts = [loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]} in detail."}],
            add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(args.prompts)]
    else:
        prompts = [rng.integers(0, vocab, size=int(n)).tolist()
                   for n in rng.integers(64, 512, size=args.prompts)]
    requests = make_requests(args.num_requests, vocab, args.seed, (32, 1024), (32, 512))
    runs = {"auto": run_engine(args, loaded, "auto", prompts, None, requests, copy_bw)}
    paths = runs["auto"].pop("paths")  # the bf16 cache's greedy tokens
    runs["fp8"] = run_engine(args, loaded, "fp8", prompts, paths, requests, copy_bw)

    log("float32 reference: teacher-forced along the bf16 cache's greedy path")
    weights = {name: t.float() for name, t in loaded.state_dict.items()}
    config = loaded.config
    del loaded
    release_memory(device)
    hf32 = build_hf_model(LoadedModel(args.model, config, weights, None))
    expected = [token for prompt, path in zip(prompts, paths, strict=True)
                for token in fp32_argmax_along(hf32, prompt, path, device)]
    for run in runs.values():
        chosen = run.pop("chosen")
        run["fp32_argmax"] = sum(a == b for a, b in zip(chosen, expected, strict=True)) / len(
            expected)
        run["fp32_steps"] = len(expected)

    (out_dir / "kv_cache_dtype.json").write_text(json.dumps(
        {"args": args_json(args), "copy_bandwidth_Bps": copy_bw, "runs": runs}, indent=2))
    base, fp8 = runs["auto"], runs["fp8"]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\n{name}; {args.model} bf16 weights; copy bw {copy_bw / 1e9:.0f} GB/s")
    print(f"{'':34}{'bf16 cache':>12}{'fp8 cache':>12}{'ratio':>8}")
    print(f"{'KV pool blocks':34}{base['num_blocks']:>12}{fp8['num_blocks']:>12}"
          f"{fp8['num_blocks'] / base['num_blocks']:>8.2f}")
    for b, f in zip(base["decode_step"], fp8["decode_step"], strict=True):
        if "skipped" in b or "skipped" in f:
            print(f"decode step: skipped ({b.get('skipped') or f.get('skipped')})")
            continue
        label = f"decode step b{b['batch']} ctx {b['ctx']} (ms)"
        print(f"{label:34}{b['step_s'] * 1e3:>12.2f}{f['step_s'] * 1e3:>12.2f}"
              f"{f['step_s'] / b['step_s']:>8.2f}")
        label = f"  of its byte roofline ctx {b['ctx']}"
        print(f"{label:34}{b['fraction']:>12.0%}{f['fraction']:>12.0%}")
    if args.num_requests:
        bt, ft = base["throughput"], fp8["throughput"]
        label = f"throughput, {args.num_requests} requests (tok/s)"
        print(f"{label:34}{bt['output_tokens_per_s']:>12.0f}{ft['output_tokens_per_s']:>12.0f}"
              f"{ft['output_tokens_per_s'] / bt['output_tokens_per_s']:>8.2f}")
    print(f"{'fp32 argmax, teacher-forced':34}{base['fp32_argmax']:>12.1%}"
          f"{fp8['fp32_argmax']:>12.1%}{fp8['fp32_argmax'] - base['fp32_argmax']:>+8.1%}"
          f"  ({base['fp32_steps']} positions, one path)")


if __name__ == "__main__":
    main()
