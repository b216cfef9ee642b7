"""One stream against the byte floor: where a batch-1 decode step's time goes.

At one stream a decode step reads every weight once, so its floor is the weight bytes over
the copy bandwidth measured in the same run. The step is split into what the device runs
(the decode graph's replay), the kernels inside it (timed eagerly under the profiler, by
kind: GEMMs, attention, the rest), the gaps between those kernels in the graph, and the host's
part of the inter-token latency. The GEMMs alone are also replayed as one graph of the same
shapes, so their own efficiency against the floor is read without the other kernels.

    python benchmarks/one_stream.py --model dummy:llama-3.1-8b   # on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._common import Run, add_out_argument, log, percentile  # noqa: E402
from benchmarks.floor import decode_weight_bytes  # noqa: E402
from benchmarks.hardware import copy_bandwidth, cuda_median_s, release_memory  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

GEMM_NAMES = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk")
ATTENTION_NAMES = ("attention", "attn", "paged")


def kernel_kind(name: str) -> str:
    """``gemm``, ``attention`` or ``other``, from a CUDA kernel's name."""
    lowered = name.lower()
    if any(part in lowered for part in GEMM_NAMES):
        return "gemm"
    if any(part in lowered for part in ATTENTION_NAMES):
        return "attention"
    return "other"


def run_one_stream(config: EngineConfig, prompt_len: int, tokens: int
                   ) -> tuple[LLMEngine, list[float], float]:
    """One greedy request of ``prompt_len`` tokens and ``tokens`` answer tokens: the engine,
    the wall seconds between consecutive tokens, and the time to the first token."""
    engine = LLMEngine(config, time_steps=True)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.add_request("one", [100 + i % 1000 for i in range(prompt_len)], params)
    start = last = time.perf_counter()
    gaps, ttft, seen = [], None, 0
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        got = sum(len(o.outputs[0].token_ids) for o in outputs) if outputs else 0
        if got and ttft is None:
            ttft = now - start
        elif got:
            gaps.append((now - last) / got)
        if got:
            last, seen = now, seen + got
    assert seen == tokens and ttft is not None
    return engine, gaps, ttft


def profile_eager_step(engine: LLMEngine, steps: int) -> dict[str, list[tuple[str, float]]]:
    """Device seconds per decode step of each kernel, by kind, over ``steps`` eager steps of
    one running request (the profiler's kernel records, summed per name and divided)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    engine.add_request("profiled", list(range(100, 228)), params)
    for _ in range(4):
        engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    by_name: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_name[event.name] += event.device_time_total * 1e-6 / steps
    kinds: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for name, seconds in sorted(by_name.items(), key=lambda item: -item[1]):
        kinds[kernel_kind(name)].append((name, seconds))
    while engine.has_unfinished():
        engine.step()
    return kinds


def gemm_graph_s(model, reps: int = 50) -> float:
    """Device seconds of one replay of every decoder GEMM and the LM head at one row, as one
    CUDA graph over the model's own weights (what the GEMMs cost without the other kernels)."""
    x = torch.randn(1, model.embed.shape[1], device=model.device, dtype=model.dtype)
    weights = [w for layer in model.layers
               for w in ((layer.qkv,) if layer.qkv is not None else (layer.q, layer.k, layer.v))
               + (layer.o,)
               + ((layer.gate_up,) if layer.gate_up is not None else (layer.gate, layer.up))
               + (layer.down,)]
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], device=model.device, dtype=model.dtype)
              for w in weights}

    def gemms() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
        F.linear(x, model.lm_head)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gemms()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemms()
    return cuda_median_s(graph.replay, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--profile-steps", type=int, default=20)
    add_out_argument(parser)
    args = parser.parse_args()
    device = torch.device("cuda")
    report = Run(args.out, "one_stream")
    bandwidth = copy_bandwidth(device)
    config = EngineConfig(model=args.model, device="cuda", dtype="bfloat16", max_num_seqs=8,
                          num_kv_blocks=512)
    log("loading the engine (CUDA graphs) and running one stream")
    engine, gaps, ttft = run_one_stream(config, args.prompt, args.tokens)
    model = engine.runner.model
    floor = decode_weight_bytes(model, 1) / bandwidth
    graph, _ = engine.runner.graphs[1]
    replay = cuda_median_s(graph.replay, 50)
    device_steps = [t.device_s for t in engine.step_timings[2:] if t.device_s is not None]
    host_steps = [t.host_s for t in engine.step_timings[2:]]
    in_steps = [t.graph_device_s for t in engine.step_timings[2:] if t.graph_device_s is not None]
    gemms = gemm_graph_s(model)
    engine.shutdown()
    del engine, graph, model
    release_memory(device)
    log("loading the engine eagerly and profiling its decode steps")
    eager = LLMEngine(dataclasses.replace(config, enforce_eager=True))
    kinds = profile_eager_step(eager, args.profile_steps)
    eager.shutdown()
    totals = {kind: sum(s for _, s in rows) for kind, rows in kinds.items()}
    kernel_sum = sum(totals.values())
    itl = percentile(gaps, 50)
    ms = 1e3
    rows = [
        ("byte floor (weights / copy bandwidth)", floor * ms, 1.0),
        ("ITL p50 (engine loop, graphs)", itl * ms, itl / floor),
        (f"TTFT (prompt {args.prompt})", ttft * ms, None),
        ("step host time p50", percentile(host_steps, 50) * ms, None),
        ("step device time p50", percentile(device_steps, 50) * ms if device_steps else None, None),
        ("decode graph replay in the steps p50", percentile(in_steps, 50) * ms if in_steps
         else None, None),
        ("decode graph replay alone (batch 1)", replay * ms, replay / floor),
        ("GEMMs + LM head alone, one graph", gemms * ms, gemms / floor),
        ("kernels summed (eager, profiled)", kernel_sum * ms, kernel_sum / floor),
    ] + [(f"  {kind}", seconds * ms, None) for kind, seconds in sorted(totals.items())] + [
        ("gaps in the graph (replay - kernels)", (replay - kernel_sum) * ms, None),
        ("host share of ITL (ITL - replay)", (itl - replay) * ms, None),
    ]
    report.section(f"One stream, {args.model}, bf16, copy bandwidth {bandwidth / 1e12:.2f} TB/s",
                   [(name, value, ratio) for name, value, ratio in rows],
                   ["what", "ms", "x floor"])
    top = [(kind, name[:90], seconds * 1e6) for kind, rows_ in kinds.items()
           for name, seconds in rows_[:6]]
    report.section("Largest kernels per step (eager)", top, ["kind", "kernel", "us/step"])
    report.write_json({"floor_s": floor, "itl_p50_s": itl, "ttft_s": ttft, "replay_s": replay,
                       "gemm_graph_s": gemms, "kernel_totals_s": totals,
                       "bandwidth_Bps": bandwidth, "gaps_s": gaps})


if __name__ == "__main__":
    main()
