"""Hardware numbers measured in the run that uses them (the copy bandwidth, the sustained
matmul rate, the L2 size) and device timing: the inputs of ``benchmarks/floor.py``."""

import gc
import time

import numpy as np
import torch

from engine import LLM


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def wall_s(fn, device: torch.device):
    """``(seconds, fn())``: wall time of ``fn`` with the device idle before and after it."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def release_memory(device: torch.device) -> None:
    """Return what dropped references held to the allocator and, on CUDA, to the device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s (read + written) of a large device-to-device copy: median of CUDA-event timings."""
    numel = 2**31 if device.type == "cuda" else 2**25
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            if i >= 5:
                times.append(start.elapsed_time(end) * 1e-3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            if i >= 5:
                times.append(time.perf_counter() - t)
    bw = 2 * src.nbytes / float(np.median(times))
    del src, dst
    return bw


def cuda_median_s(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls, each timed with CUDA events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return float(np.median(times))


def matmul_rate(device: torch.device, fp8: bool = False) -> float:
    """FLOP/s of a bf16 GEMM of the decoder's gate/up shape at 4096 rows (with ``fp8``: the
    FP8 product ``--quantization fp8`` runs, per-row scales), sustained: timed after 2 s of the
    same GEMMs, so the clocks are where the power cap holds them under load."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    b = torch.randn(28672, 4096, device=device, dtype=torch.bfloat16)
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        sa = torch.ones(4096, 1, device=device)
        sb = torch.ones(1, 28672, device=device)

        def product() -> torch.Tensor:
            return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    else:
        def product() -> torch.Tensor:
            return a @ b.t()
    start = time.perf_counter()
    while time.perf_counter() - start < 2.0:
        product()
        torch.cuda.synchronize()
    seconds = cuda_median_s(product, reps=50)
    return 2 * 4096 * 4096 * 28672 / seconds


def matmul_rates(llm: LLM, device: torch.device) -> tuple[float, float]:
    """(rate of the decoder layers' products, rate of lm_head's): the FP8 rate for the layers
    of an FP8 model, whose output layer stays bfloat16."""
    bf16 = matmul_rate(device)
    fp8 = llm.engine.config.quantization == "fp8"
    return (matmul_rate(device, fp8=True) if fp8 else bf16), bf16


def l2_cache_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
