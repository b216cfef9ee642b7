"""End-to-end engine benchmark: correctness against transformers, offline throughput against
the floor of its own steps (and transformers ``generate`` with a static cache), and the
batch-256 decode step against its memory roofline. One call runs everything and prints a
short table last.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_e2e.py            # H200: dummy:llama-3.1-8b, bf16

Same code path on CPU, small (a smoke test of the script itself):

    python benchmarks/gpu_e2e.py --device cpu --model dummy:smollm2-135m --dtype float32 \\
        --num-requests 16 --quick

Weights are loaded once (``engine.loader.load_model``) and shared, without a copy, by the engine
(``LLM``) and by transformers (``build_hf_model``). Writes ``gpu_e2e.json`` and ``gpu_e2e.png``
to ``--out`` (default ``$OUT``, else ``benchmarks/out``). The methods are those of the modules
it calls: correctness and the transformers baseline ``benchmarks/hf_reference.py``; the
1,000-request workload, read through the engine's step timing, and its floor
``benchmarks/offline_throughput.py`` (floors: ``benchmarks/floor.py``); the decode step alone
``benchmarks/decode_step.py``; the table ``benchmarks/e2e_report.py``.
"""

import argparse
import functools
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import e2e_report  # noqa: E402
from benchmarks._common import add_out_argument, args_json, log, save_figure  # noqa: E402
from benchmarks.decode_step import measure_decode_steps  # noqa: E402
from benchmarks.hardware import copy_bandwidth, release_memory, sync  # noqa: E402
from benchmarks.hf_reference import (  # noqa: E402
    EMBED_SCALE,
    check_dtype,
    correctness_prompts,
    fp32_correctness,
    fp32_reference_agreement,
    hf_baseline,
)
from benchmarks.offline_throughput import (  # noqa: E402
    add_workload_args,
    make_requests,
    measure_throughput,
)
from engine import LLM  # noqa: E402
from engine.loader import LoadedModel, build_hf_model, load_model  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(ap)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="FP8 products in the decoder layers (the floor counts their FLOPs at "
                         "the FP8 rate measured in the same run)")
    ap.add_argument("--correct-prompts", type=int, default=8)
    ap.add_argument("--correct-tokens", type=int, default=32)
    ap.add_argument("--decode-batch", type=int, default=256)
    ap.add_argument("--decode-ctx", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--hf-batches", type=int, default=None,
                    help="time only the first N transformers batches and extrapolate")
    ap.add_argument("--no-fp32-check", action="store_true",
                    help="skip the float32 correctness check (a separate fp32 load)")
    ap.add_argument("--retry-embed-scale", action="store_true",
                    help=f"on a bf16 divergence, re-check with the embedding scaled by "
                         f"{EMBED_SCALE:g}")
    ap.add_argument("--hf-candidates", type=int, nargs="+", default=[384, 256, 192, 128, 64])
    ap.add_argument("--hf-eager", action="store_true",
                    help="turn off transformers' automatic compile of the static-cache forward")
    ap.add_argument("--no-hf", action="store_true",
                    help="skip the transformers throughput baseline (correctness still runs)")
    ap.add_argument("--sync-baseline", action="store_true",
                    help="run the throughput workload again with overlapped scheduling off")
    ap.add_argument("--quick", action="store_true",
                    help="short lengths (prompts 8-64, outputs 4-32): a smoke test of the script")
    add_out_argument(ap)
    return ap.parse_args(argv)


def run_info(args: argparse.Namespace, device: torch.device) -> dict:
    """The device, the library versions and the arguments of this run."""
    import transformers
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0], "args": args_json(args)}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def start_engine(args: argparse.Namespace, loaded: LoadedModel, result: dict) -> LLM:
    """The engine on the already loaded weights (shared, not copied); its set-up in
    ``result["engine"]``."""
    start = time.perf_counter()
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
              gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager, seed=args.seed,
              quantization=args.quantization, loaded=loaded)  # shares these weights
    runner = llm.engine.runner
    kv_gib = runner.kv_cache.numel() * runner.kv_cache.element_size() / 2**30
    result["engine"] = {"init_s": time.perf_counter() - start, "num_kv_blocks": runner.num_blocks,
                        "kv_cache_gib": kv_gib, "graph_sizes": runner.graph_sizes}
    log(f"engine up in {result['engine']['init_s']:.1f}s: {runner.num_blocks} KV blocks "
        f"({kv_gib:.1f} GiB), {len(runner.graph_sizes)} decode graphs")
    return llm


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32,
             "float16": torch.float16}[args.dtype]
    prompt_range, output_range = ((8, 64), (4, 32)) if args.quick else ((32, 1024), (32, 512))
    info = run_info(args, device)
    log(f"{info}")
    result: dict = {"info": info}
    copy_bw = copy_bandwidth(device)
    result["copy_bandwidth_Bps"] = copy_bw
    log(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")

    correct_prompts = correctness_prompts(args)
    corr: dict = {}
    if not args.no_fp32_check and dtype != torch.float32:
        corr["float32"] = fp32_correctness(args, device, correct_prompts)
    loaded = load_model(args.model, device, dtype, seed=args.seed, use_cache=False)
    sync(device)
    log(f"loaded {args.model}: {sum(t.numel() for t in loaded.state_dict.values()) / 1e9:.2f} "
        f"B parameters")
    llm = start_engine(args, loaded, result)
    hf = build_hf_model(loaded)
    hf.generation_config.eos_token_id = None
    check_dtype(args, llm, hf, loaded, correct_prompts, device, corr)
    result["correctness"] = corr

    requests = make_requests(args.num_requests, loaded.config.vocab_size, args.seed,
                             prompt_range, output_range)
    result.update(measure_throughput(llm, requests, copy_bw, device, args.sync_baseline))
    et = result["engine_throughput"]
    fl = result.get("floor")  # its matmul rates serve the decode steps' floors too
    result.update(measure_decode_steps(
        llm, et, args.decode_batch, args.decode_ctx, args.max_num_batched_tokens, copy_bw, device,
        (fl["matmul_flops"], fl["head_flops"]) if fl else None))
    del llm
    release_memory(device)
    if device.type == "cuda":
        log(f"engine freed; {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated")
    if dtype != torch.float32:
        agreement = fp32_reference_agreement(loaded, correct_prompts, corr[args.dtype], device)
        corr[args.dtype]["fp32_reference"] = agreement
        log(f"{args.dtype} vs the float32 computation of the same weights: {agreement}")
    if not args.no_hf:  # the transformers baseline
        result["hf_throughput"] = hf_baseline(hf, requests, args, device, et)
        result["ratio"] = et["output_tokens_per_s"] / result["hf_throughput"]["output_tokens_per_s"]

    (out_dir / "gpu_e2e.json").write_text(json.dumps(result, indent=2))
    save_figure(out_dir / "gpu_e2e.png", functools.partial(e2e_report.plot, result), ncols=2,
                figsize=(10, 4), dpi=120)
    e2e_report.print_summary(args, result, corr, copy_bw)
    e2e_report.print_steps(args, result)


if __name__ == "__main__":
    main()
