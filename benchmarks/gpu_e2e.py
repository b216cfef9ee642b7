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
to ``--out`` (default ``$OUT``, else ``benchmarks/out``).

Method:
- Correctness: 8 random-token prompts, 32 greedy tokens each, engine (batched, CUDA graphs)
  against transformers' own greedy decoding (``generate``, ``do_sample=False``, one prompt at a
  time, EOS disabled like ``ignore_eos``). Random weights can make near-tied logits; every
  divergence is reported with its logit margin in transformers' logits (top-1 minus the logit of
  the engine's token, teacher-forced on the engine's tokens). Transformers is also run on the
  same prompts as one left-padded batch: how often it agrees with itself shows how much of a
  16-bit divergence is batch shape alone. In 16 bits both implementations are also compared
  with the exact computation (the same weights in float32). ``--retry-embed-scale`` repeats the
  check with the embedding matrix scaled by 16 (exact in bf16, undone afterwards).
- Throughput: N ShareGPT-like requests (seeded log-normal lengths: prompts clipped to
  [32, 1024] tokens, outputs to [32, 512]), random token ids, greedy, ``ignore_eos``, all
  submitted at once through ``LLM.generate``, after an untimed warm-up pass (the first 64
  requests, 8 output tokens each) that compiles the kernel variants the run meets. Transformers:
  the same requests in arrival order, left-padded batches of the largest batch size that fits
  (probed in the same run, with the longest prompt and output),
  ``generate(cache_implementation="static")``, which compiles its
  decoding forward (``torch.compile``, mode "reduce-overhead") by default for a static cache on a
  GPU. Each batch's shapes are compiled (and their CUDA graphs recorded) in an untimed warm-up
  that stops after a few tokens; that one-time cost is reported separately. Every batch is timed
  unless ``--hf-batches N`` limits it to the first N (their rate, useful output tokens per
  second, i.e. the requested lengths, not padding, is then extrapolated to the whole set);
  ``--hf-eager`` turns transformers' compile off (``disable_compile=True``).
- Decode step at batch 256: the engine's captured graph for 256 rows replayed over a context of
  ``--decode-ctx`` tokens per row; roofline = (weights read + KV read) / copy bandwidth, with
  the copy bandwidth measured in the same run as in ``benchmarks/attention_kernels.py`` (a 4 GiB
  device-to-device copy, bytes read + written per second). The full engine step (host work
  included) at 256 running rows is taken from the throughput run's pure-decode steps.
- Floors, each from the sustained matmul rate and the copy bandwidth measured in the run: the
  floor (every step at the larger of its FLOPs and its bytes), the serial floor (GEMMs, then
  the KV reads, as a layer's dependencies order them) and between them the overlap floor
  (attention beside every GEMM those dependencies allow), from ``benchmarks/floor.py``; for the
  throughput run's steps and for each decode step.
"""

import argparse
import functools
import json
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import floor  # noqa: E402
from benchmarks._common import add_out_argument, args_json, log, save_figure  # noqa: E402
from benchmarks.engine_internals import StepRecorder  # noqa: E402
from benchmarks.hardware import (  # noqa: E402
    copy_bandwidth,
    cuda_median_s,
    l2_cache_bytes,
    matmul_rates,
    release_memory,
    sync,
    wall_s,
)
from benchmarks.hf_reference import (  # noqa: E402
    check_correctness,
    fp32_reference_agreement,
    hf_baseline,
)
from engine import LLM, SamplingParams  # noqa: E402
from engine.cuda_graphs import padded_batch_size  # noqa: E402
from engine.loader import LoadedModel, build_hf_model, dummy_config, load_model  # noqa: E402
from engine.model import AttentionMetadata  # noqa: E402

EMBED_SCALE = 16.0
WARMUP_REQUESTS, WARMUP_TOKENS = 64, 8  # the engine's untimed warm-up pass


def make_requests(n: int, vocab: int, seed: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int]) -> list[tuple[list[int], int]]:
    """ShareGPT-like: log-normal lengths (medians ~1/4 of each range's top), clipped."""
    rng = np.random.default_rng(seed)
    p_lo, p_hi = prompt_range
    o_lo, o_hi = output_range
    prompt_lens = np.clip(rng.lognormal(math.log(p_hi / 4), 0.8, n), p_lo, p_hi).astype(int)
    output_lens = np.clip(rng.lognormal(math.log(o_hi / 3), 0.7, n), o_lo, o_hi).astype(int)
    return [(rng.integers(0, vocab, size=int(p)).tolist(), int(o))
            for p, o in zip(prompt_lens, output_lens, strict=True)]


def fp32_correctness(args, device: torch.device, prompts: list[list[int]]) -> dict:
    """The same check in float32 (weights from the same seed, generated in fp32): no bf16
    rounding, so near-ties cannot flip and tokens must be equal."""
    loaded = load_model(args.model, device, torch.float32, seed=args.seed, use_cache=False)
    llm = LLM(model=args.model, device=args.device, dtype="float32",
              max_num_seqs=len(prompts), max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, num_kv_blocks=1024,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager, seed=args.seed,
              loaded=loaded)
    hf = build_hf_model(loaded)
    hf.generation_config.eos_token_id = None
    log(f"correctness (float32): {len(prompts)} prompts x {args.correct_tokens} greedy "
        f"tokens, {len(llm.engine.runner.graph_sizes)} decode graphs")
    result = check_correctness(llm, hf, prompts, args.correct_tokens, device)
    del llm, hf, loaded
    release_memory(device)
    return result


def engine_warmup(llm: LLM, requests, device: torch.device) -> float:
    """An untimed pass over the first requests with short outputs, so that the kernel variants
    the run meets are compiled (Triton JIT, cuBLAS heuristics) outside the timed window, as
    transformers' compile warm-up is; returns its seconds."""
    batch = requests[:WARMUP_REQUESTS]
    params = SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    return wall_s(lambda: llm.generate([p for p, _ in batch], params), device)[0]


def engine_throughput(llm: LLM, requests, device: torch.device) -> dict:
    warmup_s = engine_warmup(llm, requests, device)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in requests]
    prompts = [p for p, _ in requests]
    recorder = StepRecorder(llm.engine, device, len(requests))
    runner = llm.engine.runner
    graph0, eager0 = runner.num_graph_steps, runner.num_eager_steps
    preemptions0 = llm.engine.scheduler.num_preemptions
    elapsed, outs = wall_s(lambda: llm.generate(prompts, params), device)
    recorder.restore()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(o for _, o in requests), "ignore_eos: every request runs to max"
    prompt_tokens = sum(len(p) for p in prompts)
    # steady decode steps: CUDA-graph steps right after another one (an overlapped step's time
    # includes waiting for the step before it), with at least 15/16 of the rows
    full_steps = [i for i, (_, rows, graph) in enumerate(recorder.steps)
                  if i and graph and recorder.steps[i - 1][2]
                  and rows >= runner_max(llm) * 15 // 16]
    full = [recorder.steps[i][0] for i in full_steps]
    graph_s = recorder.graph_s()
    in_situ = [graph_s[i] for i in full_steps if graph_s[i] is not None]
    graph_time = sum(t for t, _, graph in recorder.steps if graph)
    return {
        "seconds": elapsed, "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / elapsed,
        "steps": len(recorder.steps), "graph_steps": runner.num_graph_steps - graph0,
        "eager_steps": runner.num_eager_steps - eager0,
        "num_preemptions": llm.engine.scheduler.num_preemptions - preemptions0,
        "warmup_seconds": warmup_s,
        "full_decode_steps": len(full), "graph_steps_seconds": graph_time,
        "eager_steps_seconds": sum(t for t, _, _ in recorder.steps) - graph_time,
        "full_decode_step_median_s": float(np.median(full)) if full else None,
        # the same steps' graph replays, timed on the device as they ran
        "full_decode_graph_median_s": float(np.median(in_situ)) if in_situ else None,
        "full_decode_step_median_rows": int(np.median([recorder.steps[i][1]
                                                       for i in full_steps])) if full else None,
        "full_decode_step_median_ctx": int(np.median([
            recorder.work[i][1] // recorder.steps[i][1] for i in full_steps])) if full else None,
        "step_work": recorder.work, "step_rows": [rows for _, rows, _ in recorder.steps],
    }


def runner_max(llm: LLM) -> int:
    return llm.engine.config.max_num_seqs


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


def decode_step_roofline(llm: LLM, batch: int, ctx: int, copy_bw: float,
                         device: torch.device,
                         rates: tuple[float, float] | None = None) -> dict:
    """Replay the captured decode graph of ``batch`` rows, each over ``ctx`` cached tokens in
    distinct blocks, and compare with (weight bytes + KV bytes) / copy bandwidth. Given the
    matmul rates (``hardware.matmul_rates``), also with the step's FLOP floor (``flop_s``), its
    serial floor (``serial_s``) and its overlap floor (``overlap_s``), as ``floor.step_floors``
    defines them."""
    runner = llm.engine.runner
    model = runner.model
    bs = runner.block_size
    nblk = -(-ctx // bs)
    if batch * nblk + 1 > runner.num_blocks:
        return {"skipped": f"needs {batch * nblk + 1} blocks, pool has {runner.num_blocks}"}
    tables = (np.arange(batch * nblk, dtype=np.int32).reshape(batch, nblk) + 1)
    positions = np.full(batch, ctx - 1, dtype=np.int64)
    host = {"input_ids": np.zeros(batch, dtype=np.int64), "positions": positions,
            "slot_mapping": tables[:, -1].astype(np.int64) * bs + (ctx - 1) % bs,
            "block_tables": tables, "seq_lens": np.full(batch, ctx, dtype=np.int32)}
    weight_bytes = floor.decode_weight_bytes(model, batch)
    kv_bytes = batch * ctx * floor.kv_bytes_per_token(model, runner.kv_cache.element_size())
    if not runner.graphs or batch not in runner.graphs:
        return {"skipped": "no CUDA graph of that batch size (eager run or CPU)"}
    with torch.inference_mode():
        runner.load_decode_batch(host)
        runner.decode_forward(batch)
        torch.cuda.synchronize()
        measured = cuda_median_s(lambda: runner.decode_forward(batch), reps=30)
    roofline = (weight_bytes + kv_bytes) / copy_bw
    result = {"batch": batch, "ctx": ctx, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
              "step_s": measured, "roofline_s": roofline, "fraction": roofline / measured}
    if rates:
        floors = floor.step_floors(floor.WeightSplit.of(model), batch, batch, kv_bytes,
                                   weight_bytes, rates, copy_bw, l2_cache_bytes(device))
        result.update(flop_s=floors.flop_s, serial_s=floors.serial_s,
                      overlap_s=floors.overlap_s)
    return result


def profile_steps(llm: LLM, batch: int, ctx: int, copy_bw: float, prefill_tokens: int,
                  device: torch.device) -> dict:
    """Where a step's time goes: the batch-``batch`` decode forward run eagerly (graph replay
    vs eager time, and the top CUDA kernels under torch.profiler), and one eager prefill
    forward of ``prefill_tokens`` tokens (16 sequences) with its achieved TFLOP/s."""
    runner = llm.engine.runner
    model = runner.model
    graph = decode_step_roofline(llm, batch, ctx, copy_bw, device)  # fills the static buffers
    with torch.inference_mode():
        eager_s = cuda_median_s(lambda: runner.decode_forward(batch, replay=False), reps=10)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                runner.decode_forward(batch, replay=False)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                          max_name_column_width=60)
        # prefill: 16 sequences of prefill_tokens / 16 tokens in fresh blocks
        seqs, bs = 16, runner.block_size
        per = prefill_tokens // seqs
        nblk = -(-per // bs)
        tables = torch.arange(seqs * nblk, device=device, dtype=torch.int32).view(seqs, nblk) + 1
        positions = torch.arange(per, device=device).repeat(seqs)
        slots = (tables.long()[:, torch.arange(per, device=device) // bs] * bs
                 + torch.arange(per, device=device) % bs).flatten()
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=tables,
            seq_lens=torch.full((seqs,), per, device=device, dtype=torch.int32),
            query_start_loc=torch.arange(0, seqs * per + 1, per, device=device,
                                         dtype=torch.int32),
            max_query_len=per, max_seq_len=per)
        ids = torch.randint(0, model.embed.shape[0], (seqs * per,), device=device)
        prefill_s = cuda_median_s(lambda: model.forward(ids, positions, meta, runner.kv_cache),
                                  reps=5)
    params = floor.layer_params(model)  # norms included
    attn_flops = 4 * len(model.layers) * model.num_heads * model.head_dim * seqs * per * per / 2
    flops = 2 * params * seqs * per + attn_flops
    return {"ctx": ctx, "graph_s": graph.get("step_s"),
            "eager_s": eager_s, "kernel_table": table, "prefill_tokens": seqs * per,
            "prefill_s": prefill_s, "prefill_tflops": flops / prefill_s / 1e12}


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The model, device and engine limits of the 1,000-request workload (also used by
    ``tensor_parallel.py``)."""
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=2048)


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


def prompt_vocab(model: str) -> int:
    """Token ids random prompts draw from: a dummy preset's vocabulary, else the first 1,000
    (ids every real tokenizer has)."""
    if model.startswith("dummy:"):
        return dummy_config(model.removeprefix("dummy:")).vocab_size
    return 1000


def correctness_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = np.random.default_rng(args.seed + 1)
    hi = 16 if args.quick else 300
    vocab = prompt_vocab(args.model)
    return [rng.integers(0, vocab, size=int(n)).tolist()
            for n in rng.integers(4, hi, size=args.correct_prompts)]


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


def check_dtype(args: argparse.Namespace, llm: LLM, hf, loaded: LoadedModel,
                prompts: list[list[int]], device: torch.device, corr: dict) -> None:
    """Correctness in the run's dtype (again with the embedding scaled on a divergence when
    ``--retry-embed-scale``), into ``corr``."""
    log(f"correctness ({args.dtype}): {len(prompts)} prompts x {args.correct_tokens} "
        f"greedy tokens")
    corr[args.dtype] = check_correctness(llm, hf, prompts, args.correct_tokens, device)
    if corr[args.dtype]["num_equal"] < len(prompts) and args.retry_embed_scale:
        embed = loaded.state_dict["model.embed_tokens.weight"]
        log(f"correctness again with the embedding scaled by {EMBED_SCALE:g}")
        embed.mul_(EMBED_SCALE)
        try:
            corr[f"{args.dtype}_embed_x16"] = check_correctness(
                llm, hf, prompts, args.correct_tokens, device)
        finally:
            embed.div_(EMBED_SCALE)


def measure_throughput(args: argparse.Namespace, llm: LLM, requests: list, copy_bw: float,
                       device: torch.device, result: dict) -> dict:
    """The engine's offline throughput (and its floor on CUDA; again with overlapped
    scheduling toggled when ``--sync-baseline``), into ``result``; returns the main run."""
    log(f"throughput: {len(requests)} requests, prompts mean "
        f"{np.mean([len(p) for p, _ in requests]):.0f} tokens, outputs mean "
        f"{np.mean([o for _, o in requests]):.0f} tokens")
    result["engine_throughput"] = engine_throughput(llm, requests, device)
    result["async_scheduling"] = llm.engine.async_scheduling
    et = result["engine_throughput"]
    log(f"engine: {et['output_tokens']} output tokens in {et['seconds']:.1f}s = "
        f"{et['output_tokens_per_s']:.0f} tok/s ({et['steps']} steps, {et['graph_steps']} "
        f"graph, {et['num_preemptions']} preemptions; warm-up pass before it "
        f"{et['warmup_seconds']:.1f}s; overlapped scheduling "
        f"{'on' if llm.engine.async_scheduling else 'off'})")
    if device.type == "cuda":
        result["floor"] = workload_floor(llm, et, matmul_rates(llm, device), copy_bw,
                                         l2_cache_bytes(device))
        log(f"floor of these steps: {result['floor']}")
    if args.sync_baseline:
        llm.engine.async_scheduling = not llm.engine.async_scheduling
        result["engine_throughput_other_mode"] = engine_throughput(llm, requests, device)
        llm.engine.async_scheduling = not llm.engine.async_scheduling
        log(f"the same with overlapped scheduling toggled: "
            f"{result['engine_throughput_other_mode']['output_tokens_per_s']:.0f} tok/s")
    return et


def measure_decode_steps(args: argparse.Namespace, llm: LLM, et: dict, copy_bw: float,
                         device: torch.device, result: dict) -> None:
    """CUDA only: the decode step against its roofline at each ``--decode-ctx``, the graph
    replay of the throughput run's median full step, and a kernel profile."""
    result["decode_step"] = []
    if device.type != "cuda":
        return
    rates = ((result["floor"]["matmul_flops"], result["floor"]["head_flops"])
             if "floor" in result else matmul_rates(llm, device))
    for ctx in args.decode_ctx:
        r = decode_step_roofline(llm, args.decode_batch, ctx, copy_bw, device, rates)
        result["decode_step"].append(r)
        log(f"decode step batch {args.decode_batch} ctx {ctx}: {r}")
    if et["full_decode_step_median_ctx"]:
        rows = padded_batch_size(et["full_decode_step_median_rows"],
                                 llm.engine.runner.graph_sizes)
        r = decode_step_roofline(llm, rows, et["full_decode_step_median_ctx"], copy_bw,
                                 device, rates)
        result["full_step_graph"] = r
        log(f"graph replay of the full steps' median context: {r}")
    if args.decode_batch in llm.engine.runner.graphs:
        prof = profile_steps(llm, args.decode_batch, args.decode_ctx[0], copy_bw,
                             args.max_num_batched_tokens, device)
        log(f"decode batch {args.decode_batch} ctx {prof['ctx']}: graph "
            f"{prof['graph_s'] * 1e3:.2f} ms, eager {prof['eager_s'] * 1e3:.2f} ms; "
            f"kernels (eager, 3 steps):\n{prof['kernel_table']}")
        log(f"prefill forward {prof['prefill_tokens']} tokens: {prof['prefill_s'] * 1e3:.1f} "
            f"ms = {prof['prefill_tflops']:.0f} TFLOP/s")
        result["profile"] = {k: v for k, v in prof.items() if k != "kernel_table"}


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
    et = measure_throughput(args, llm, requests, copy_bw, device, result)
    measure_decode_steps(args, llm, et, copy_bw, device, result)
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
    save_figure(out_dir / "gpu_e2e.png", functools.partial(plot, result), ncols=2,
                figsize=(10, 4), dpi=120)
    print_summary(args, result, corr, copy_bw)
    print_steps(args, result)


def print_summary(args: argparse.Namespace, result: dict, corr: dict, copy_bw: float) -> None:
    """The table, last: set-up, correctness and throughput."""
    info, et = result["info"], result["engine_throughput"]
    print()
    print(f"{info['device']}; torch {info['torch']}, triton {info['triton']}, transformers "
          f"{info['transformers']}; {args.model} {args.dtype}; copy bw {copy_bw / 1e9:.0f} GB/s")
    engine = result["engine"]
    print(f"KV pool {engine['num_kv_blocks']} blocks ({engine['kv_cache_gib']:.1f} GiB); "
          f"engine init {engine['init_s']:.1f}s")
    for name, c in corr.items():
        diverged = [r for r in c["rows"] if not r["equal"]]
        extra = "".join(f"; p{r['prompt']}@{r['first_divergence']} margin "
                        f"{r['margin_at_divergence']:.3f} gap {r['hf_top2_gap_at_divergence']:.3f}"
                        for r in diverged)
        # a quantized run's engine (not its float32 check) computes with FP8 products
        engine = (f"{name}, {args.quantization} products"
                  if args.quantization and name == args.dtype else name)
        print(f"correctness ({engine}): {c['num_equal']}/{c['num_prompts']} prompts x "
              f"{c['num_tokens']} tokens equal{extra}")
        print(f"  transformers {name} as one left-padded batch vs one prompt at a time: "
              f"{c['hf_batched_num_equal']}/{c['num_prompts']} equal")
        for who, a in c.get("fp32_reference", {}).items():
            print(f"  {who} {engine if who == 'engine' else name} greedy path vs float32 of the "
                  f"same weights: fp32 argmax at "
                  f"{a['fp32_argmax']}/{a['steps']} steps, largest fp32 deficit "
                  f"{a['max_deficit']:.4f}, mean {a['mean_deficit']:.5f}")
    print(f"{'':28}{'tok/s':>10}{'seconds':>10}")
    mode = "overlapped" if result["async_scheduling"] else "synchronous"
    print(f"{'engine (' + mode + ')':28}{et['output_tokens_per_s']:>10.0f}{et['seconds']:>10.1f}")
    other = result.get("engine_throughput_other_mode")
    if other:
        mode = "synchronous" if result["async_scheduling"] else "overlapped"
        print(f"{'engine (' + mode + ')':28}{other['output_tokens_per_s']:>10.0f}"
              f"{other['seconds']:>10.1f}")
    if "floor" in result:
        fl = result["floor"]
        print(f"{'floor of the same steps':28}{fl['output_tokens_per_s']:>10.0f}"
              f"{fl['floor_s']:>10.1f}  (matmul {fl['matmul_flops'] / 1e12:.0f} TFLOP/s"
              f"{' FP8' if args.quantization == 'fp8' else ''}, copy "
              f"{copy_bw / 1e9:.0f} GB/s) -> engine at {fl['fraction']:.0%} of it")
        print(f"{'serial floor, same steps':28}"
              f"{et['output_tokens'] / fl['serial_s']:>10.0f}{fl['serial_s']:>10.1f}  (GEMMs, "
              f"then attention's KV reads) -> engine at {fl['serial_fraction']:.0%} of it")
        print(f"{'overlap floor, same steps':28}"
              f"{et['output_tokens'] / fl['overlap_s']:>10.0f}{fl['overlap_s']:>10.1f}  (as much "
              f"beside attention as dependencies allow) -> engine at "
              f"{fl['overlap_fraction']:.0%} of it; the floor is "
              f"{fl['floor_s'] / fl['overlap_s']:.0%} of it")
    hft = result.get("hf_throughput")
    if hft:
        print(f"{'transformers (b=' + str(hft['batch_size']) + ')':28}"
              f"{hft['output_tokens_per_s']:>10.0f}{hft['seconds_all']:>10.1f}  ({hft['how']})")
        print(f"throughput ratio engine / transformers: {result['ratio']:.1f}x")


def print_steps(args: argparse.Namespace, result: dict) -> None:
    """The table, last: decode steps against their roofline, graph and eager time, the
    profile, the steady decode step against its graph alone."""
    et = result["engine_throughput"]
    other = result.get("engine_throughput_other_mode")
    for r in result["decode_step"]:
        if "skipped" in r:
            print(f"decode step: skipped ({r['skipped']})")
            continue
        gb = (r["weight_bytes"] + r["kv_bytes"]) / 1e9
        print(f"decode step batch {r['batch']} ctx {r['ctx']}: {r['step_s'] * 1e3:.2f} ms, "
              f"roofline {r['roofline_s'] * 1e3:.2f} ms ({gb:.1f} GB) -> {r['fraction']:.0%} "
              f"of roofline")
        if "serial_s" in r:
            floor = max(r["flop_s"], r["roofline_s"])
            print(f"  FLOP floor {r['flop_s'] * 1e3:.2f} ms: step / max(FLOPs, bytes) "
                  f"{r['step_s'] / floor:.2f}x (target <= 1.15x); serial floor "
                  f"{r['serial_s'] * 1e3:.2f} ms: step / serial {r['step_s'] / r['serial_s']:.2f}x")
            print(f"  overlap floor {r['overlap_s'] * 1e3:.2f} ms = "
                  f"{r['overlap_s'] / floor:.2f}x max(FLOPs, bytes): step / overlap floor "
                  f"{r['step_s'] / r['overlap_s']:.2f}x")
    print(f"engine time in CUDA-graph decode steps {et['graph_steps_seconds']:.1f}s "
          f"({et['graph_steps']} steps), in eager (prefill/mixed) steps "
          f"{et['eager_steps_seconds']:.1f}s ({et['eager_steps']} steps)")
    if "profile" in result:
        pr = result["profile"]
        print(f"decode batch {args.decode_batch} ctx {pr['ctx']}: graph {pr['graph_s'] * 1e3:.2f}"
              f" ms vs eager {pr['eager_s'] * 1e3:.2f} ms; prefill forward of "
              f"{pr['prefill_tokens']} tokens {pr['prefill_s'] * 1e3:.1f} ms = "
              f"{pr['prefill_tflops']:.0f} TFLOP/s")
    graph = result.get("full_step_graph", {})
    for mode, run in (("", et), (" (other mode)", other)):
        if not run or not run["full_decode_step_median_s"]:
            continue
        step = run["full_decode_step_median_s"]
        print(f"steady decode step{mode}, host included: median {step * 1e3:.2f} ms over "
              f"{run['full_decode_steps']} steps (median {run['full_decode_step_median_rows']} "
              f"rows, context {run['full_decode_step_median_ctx']})")
        in_situ = run.get("full_decode_graph_median_s")
        if in_situ:
            print(f"  its CUDA graph replays, timed on the device in the same steps: "
                  f"{in_situ * 1e3:.2f} ms -> host-visible {(step - in_situ) * 1e3:.2f} ms, "
                  f"step / graph {step / in_situ:.3f}")
        if "step_s" in graph:
            print(f"  CUDA graph replayed alone afterwards ({graph['batch']} rows, context "
                  f"{graph['ctx']}): {graph['step_s'] * 1e3:.2f} ms -> host-visible "
                  f"{(step - graph['step_s']) * 1e3:.2f} ms, step / graph "
                  f"{step / graph['step_s']:.3f}")
            if "serial_s" in graph:
                print(f"  that step's serial floor {graph['serial_s'] * 1e3:.2f} ms: graph replays"
                      f" in the run {(in_situ or step) / graph['serial_s']:.2f}x of it")


def plot(result: dict, throughput_ax, decode_ax) -> None:
    """Offline throughput (engine, its floor, transformers) and the decode step against its
    roofline."""
    et, hft = result["engine_throughput"], result.get("hf_throughput")
    bars = {"chatgate engine": et["output_tokens_per_s"]}
    if "floor" in result:
        bars["floor of its steps"] = result["floor"]["output_tokens_per_s"]
    if hft:
        mode = "compiled" if hft["compiled"] else "eager"
        bars[f"transformers\nstatic, {mode}, b={hft['batch_size']}"] = hft["output_tokens_per_s"]
    throughput_ax.bar(list(bars), list(bars.values()), color=[f"C{i}" for i in range(len(bars))])
    throughput_ax.set_ylabel("output tokens/s")
    throughput_ax.set_title("Offline throughput")
    steps = [r for r in result["decode_step"] if "skipped" not in r]
    if steps:
        labels = [f"ctx {r['ctx']}" for r in steps]
        x = np.arange(len(steps))
        decode_ax.bar(x - 0.2, [r["step_s"] * 1e3 for r in steps], 0.4, label="measured")
        decode_ax.bar(x + 0.2, [r["roofline_s"] * 1e3 for r in steps], 0.4, label="roofline")
        decode_ax.set_xticks(x, labels)
        decode_ax.set_ylabel("ms")
        decode_ax.set_title(f"Decode step, batch {steps[0]['batch']}")


if __name__ == "__main__":
    main()
