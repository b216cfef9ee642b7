"""The decode step alone, on CUDA, through the runner's decode graphs
(``ModelRunner.decode_graphs``: ``load``, ``replay``, ``forward``): the graph of ``batch`` rows
replayed over ``ctx`` cached tokens a row (in distinct blocks), against its roofline
(weights read + KV read) / copy bandwidth, the copy bandwidth measured in the same run (a 4 GiB
device-to-device copy, bytes read + written per second, ``hardware.copy_bandwidth``); given the
matmul rates, also against its floors (``floor.step_floors``: the FLOP floor, the serial floor,
the overlap floor). Then where a step's time goes: the same forward run eagerly (and its top
CUDA kernels under torch.profiler), and one eager prefill forward with its TFLOP/s.
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks import floor
from benchmarks._common import log
from benchmarks.hardware import cuda_median_s, l2_cache_bytes, matmul_rates
from engine import LLM
from engine.cuda_graphs import padded_batch_size
from engine.model import AttentionMetadata

PREFILL_SEQS = 16


def decode_step_roofline(llm: LLM, batch: int, ctx: int, copy_bw: float,
                         device: torch.device,
                         rates: tuple[float, float] | None = None) -> dict:
    """The graph replay of ``batch`` rows over ``ctx`` tokens each, median of 30, against its
    roofline (and its floors, given the matmul rates ``hardware.matmul_rates``); a
    ``skipped`` reason where the pool or the captured graphs cannot hold it."""
    runner = llm.engine.runner
    model = runner.model
    bs = runner.block_size
    nblk = -(-ctx // bs)
    if batch * nblk + 1 > runner.num_blocks:
        return {"skipped": f"needs {batch * nblk + 1} blocks, pool has {runner.num_blocks}"}
    if batch not in runner.graph_sizes:
        return {"skipped": "no CUDA graph of that batch size (eager run or CPU)"}
    tables = (np.arange(batch * nblk, dtype=np.int32).reshape(batch, nblk) + 1)
    host = {"input_ids": np.zeros(batch, dtype=np.int64),
            "positions": np.full(batch, ctx - 1, dtype=np.int64),
            "slot_mapping": tables[:, -1].astype(np.int64) * bs + (ctx - 1) % bs,
            "block_tables": tables, "seq_lens": np.full(batch, ctx, dtype=np.int32),
            "query_start_loc": np.arange(batch + 1, dtype=np.int32)}
    weight_bytes = floor.decode_weight_bytes(model, batch)
    kv_bytes = batch * ctx * floor.kv_bytes_per_token(model, runner.kv_cache.element_size())
    with torch.inference_mode():
        graphs, shape = runner.decode_graphs, (batch, batch)
        graphs.load(host, shape, None)
        graphs.replay(shape)
        torch.cuda.synchronize()
        measured = cuda_median_s(lambda: graphs.replay(shape), reps=30)
    roofline = (weight_bytes + kv_bytes) / copy_bw
    result = {"batch": batch, "ctx": ctx, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
              "step_s": measured, "roofline_s": roofline, "fraction": roofline / measured}
    if rates:
        floors = floor.step_floors(floor.WeightSplit.of(model), batch, batch, kv_bytes,
                                   weight_bytes, rates, copy_bw, l2_cache_bytes(device))
        result.update(flop_s=floors.flop_s, serial_s=floors.serial_s,
                      overlap_s=floors.overlap_s)
    return result


@torch.inference_mode()
def prefill_forward(llm: LLM, tokens: int, device: torch.device) -> dict:
    """One eager forward of ``PREFILL_SEQS`` sequences of ``tokens / PREFILL_SEQS`` tokens in
    fresh blocks: median seconds of 5 and the TFLOP/s it achieves (attention's causal half
    included)."""
    runner = llm.engine.runner
    model, bs = runner.model, runner.block_size
    seqs, per = PREFILL_SEQS, tokens // PREFILL_SEQS
    nblk = -(-per // bs)
    tables = torch.arange(seqs * nblk, device=device, dtype=torch.int32).view(seqs, nblk) + 1
    positions = torch.arange(per, device=device).repeat(seqs)
    slots = (tables.long()[:, torch.arange(per, device=device) // bs] * bs
             + torch.arange(per, device=device) % bs).flatten()
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=tables,
        seq_lens=torch.full((seqs,), per, device=device, dtype=torch.int32),
        query_start_loc=torch.arange(0, seqs * per + 1, per, device=device, dtype=torch.int32),
        max_query_len=per, max_seq_len=per)
    ids = torch.randint(0, model.embed.shape[0], (seqs * per,), device=device)
    seconds = cuda_median_s(lambda: model.forward(ids, positions, meta, runner.kv_cache), reps=5)
    attn_flops = 4 * len(model.layers) * model.num_heads * model.head_dim * seqs * per * per / 2
    flops = 2 * floor.layer_params(model) * seqs * per + attn_flops  # norms included
    return {"prefill_tokens": seqs * per, "prefill_s": seconds,
            "prefill_tflops": flops / seconds / 1e12}


def profile_steps(llm: LLM, batch: int, ctx: int, copy_bw: float, prefill_tokens: int,
                  device: torch.device) -> dict:
    """Where a step's time goes: the batch-``batch`` decode forward replayed and run eagerly,
    the top CUDA kernels of the eager one under torch.profiler, and :func:`prefill_forward`."""
    runner = llm.engine.runner
    graph = decode_step_roofline(llm, batch, ctx, copy_bw, device)  # fills the static buffers
    with torch.inference_mode():
        eager_s = cuda_median_s(lambda: runner.decode_graphs.forward((batch, batch)), reps=10)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                runner.decode_graphs.forward((batch, batch))
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                      max_name_column_width=60)
    return {"ctx": ctx, "graph_s": graph.get("step_s"), "eager_s": eager_s,
            "kernel_table": table, **prefill_forward(llm, prefill_tokens, device)}


def measure_decode_steps(llm: LLM, et: dict, batch: int, ctxs: list[int], prefill_tokens: int,
                         copy_bw: float, device: torch.device,
                         rates: tuple[float, float] | None = None) -> dict:
    """CUDA only (else ``decode_step`` is empty): the decode step of ``batch`` rows against
    its roofline at each context of ``ctxs``, the graph replay of the throughput run ``et``'s
    median steady step, and a profile; as gpu_e2e.json's fields."""
    result: dict = {"decode_step": []}
    if device.type != "cuda":
        return result
    rates = rates or matmul_rates(llm, device)
    for ctx in ctxs:
        r = decode_step_roofline(llm, batch, ctx, copy_bw, device, rates)
        result["decode_step"].append(r)
        log(f"decode step batch {batch} ctx {ctx}: {r}")
    if et["full_decode_step_median_ctx"]:
        rows = padded_batch_size(et["full_decode_step_median_rows"],
                                 llm.engine.runner.graph_sizes)
        r = decode_step_roofline(llm, rows, et["full_decode_step_median_ctx"], copy_bw,
                                 device, rates)
        result["full_step_graph"] = r
        log(f"graph replay of the full steps' median context: {r}")
    if batch in llm.engine.runner.graph_sizes:
        prof = profile_steps(llm, batch, ctxs[0], copy_bw, prefill_tokens, device)
        log(f"decode batch {batch} ctx {prof['ctx']}: graph "
            f"{prof['graph_s'] * 1e3:.2f} ms, eager {prof['eager_s'] * 1e3:.2f} ms; "
            f"kernels (eager, 3 steps):\n{prof['kernel_table']}")
        log(f"prefill forward {prof['prefill_tokens']} tokens: {prof['prefill_s'] * 1e3:.1f} "
            f"ms = {prof['prefill_tflops']:.0f} TFLOP/s")
        result["profile"] = {k: v for k, v in prof.items() if k != "kernel_table"}
    return result
