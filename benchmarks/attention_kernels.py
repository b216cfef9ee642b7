"""Time the Triton paged-attention kernels on a CUDA GPU (Llama-3.1-8B attention shapes).

32 query heads, 8 KV heads, head dim 128, bf16, block size 16, shuffled block tables.

- Copy bandwidth: a 4 GiB device-to-device copy on a stream (bytes read + written), the
  ceiling (a CUDA-graph memcpy node runs slower; it is reported too, not used).
- Decode, batch {1, 8, 64, 256} x context {512, 2k, 8k, 32k}: Triton split-K decode, PyTorch
  FlexAttention through its paged helper on the same paged cache, and SDPA on a contiguous
  copy of the same data; KV bytes read / time, as a fraction of the copy bandwidth.
- Prefill / extend (causal over new tokens, full over a cached prefix): TFLOP/s of the Triton
  extend kernel beside SDPA (causal, lower-right aligned when there is a prefix).
- A small sweep of launch configurations first; the best one is used for the tables
  (``--no-sweep``: time the shipped defaults as they are).

Times are medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``; plain
``do_bench`` where capture fails). Writes ``kernels.json`` and ``kernels_decode.png`` to
``--out`` (default ``$OUT``, else ``benchmarks/out``).

    PYTHONUNBUFFERED=1 python benchmarks/attention_kernels.py [--no-sweep]
"""

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import add_out_argument, log, save_figure  # noqa: E402
from chatgate_kernels import triton_attention  # noqa: E402

HQ, HKV, D, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16
SCALE = D**-0.5
BATCHES = (1, 8, 64, 256)
CONTEXTS = (512, 2048, 8192, 32768)
EXTEND_SHAPES = ((1, 8192, 0), (8, 2048, 0), (8, 512, 4096), (32, 128, 2048))  # B, new, prefix
FLEX_BUDGET_S = 150.0  # stop compiling FlexAttention for new shapes past this
DECODE_VARIANTS = (
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
    {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4},
)
EXTEND_VARIANTS = (
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
)
SPLIT_PROGRAMS_PER_SM = (4, 8, 16, 32)
SPLIT_MIN_TOKENS = (64, 128, 256)
def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    except Exception as exc:  # capture can fail for some callables: time without a graph
        log(f"  graph timing failed ({type(exc).__name__}); plain do_bench")
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def try_bench(fn: Callable[[], object]) -> float:
    """``bench`` that reports a configuration that fails to compile or launch as infinite."""
    try:
        return bench(fn)
    except Exception as exc:
        log(f"  failed: {type(exc).__name__}: {str(exc)[:120]}")
        return math.inf


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def copy_bandwidth() -> tuple[float, float]:
    """Bytes/s of a 4 GiB device-to-device copy (bytes read + written): on a stream, the
    ceiling, and as a CUDA-graph memcpy node, which runs slower (kept for reference)."""
    src = torch.randn(2**31, device="cuda", dtype=DTYPE)
    dst = torch.empty_like(src)
    stream_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300,
                                        return_mode="median")
    graph_ms = bench(lambda: dst.copy_(src))
    return 2 * src.nbytes / (stream_ms * 1e-3), 2 * src.nbytes / (graph_ms * 1e-3)


class PagedDecode:
    """Random paged cache + decode batch of uniform context, shuffled block tables."""

    def __init__(self, batch: int, ctx: int) -> None:
        self.batch, self.ctx = batch, ctx
        self.nb = ctx // BS
        self.num_blocks = batch * self.nb + 1  # block 0: the engine's null block, unused
        shape = (self.num_blocks, BS, HKV, D)
        self.key_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
        self.value_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
        perm = torch.randperm(self.num_blocks - 1, device="cuda") + 1
        self.block_tables = perm.view(batch, self.nb).to(torch.int32)
        self.query = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE)
        self.seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        self.qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        self.out = torch.empty_like(self.query)
        self.kv_bytes = 2 * batch * ctx * HKV * D * self.key_cache.element_size()

    def triton(self) -> torch.Tensor:
        return triton_attention.paged_attention(
            self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
            self.qsl, SCALE, 1, self.ctx, out=self.out)

    def contiguous(self, cache: torch.Tensor) -> torch.Tensor:
        """``[batch, kv_heads, ctx, head_dim]`` copy of one cache, gathered by the tables."""
        gathered = cache[self.block_tables.long()].view(self.batch, self.ctx, HKV, D)
        return gathered.transpose(1, 2).contiguous()


def flex_paged(p: PagedDecode, compiled: Callable) -> Callable[[], torch.Tensor]:
    """FlexAttention over the same paged cache through ``PagedAttention``'s block mask."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, noop_mask

    pa = PagedAttention(p.num_blocks, BS, p.batch, device="cuda")
    tables = p.block_tables.long()
    pa.page_table[:, :p.nb] = tables
    logical = torch.arange(p.nb, device="cuda").expand(p.batch, p.nb).contiguous()
    pa.physical_to_logical.scatter_(1, tables, logical)
    pa.capacity[:] = p.ctx
    mask = create_block_mask(noop_mask, p.batch, None, 1, p.ctx, device="cuda",
                             BLOCK_SIZE=BS)
    block_mask = pa.convert_logical_block_mask(mask)
    del pa
    q = p.query.view(p.batch, HQ, 1, D)
    k = p.key_cache.view(1, -1, HKV, D).transpose(1, 2)
    v = p.value_cache.view(1, -1, HKV, D).transpose(1, 2)
    return lambda: compiled(q, k, v, block_mask=block_mask, scale=SCALE, enable_gqa=True)


def decode_rows(copy_bw: float) -> list[dict]:
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.recompile_limit = 64
    compiled = torch.compile(flex_attention, dynamic=False)
    flex_spent = 0.0
    rows = []
    for batch in BATCHES:
        for ctx in CONTEXTS:
            row: dict = {"batch": batch, "ctx": ctx}
            rows.append(row)
            need = 2.3 * 2 * batch * ctx * HKV * D * 2 + 24 * batch * batch * ctx / BS
            if need > 0.9 * torch.cuda.mem_get_info()[0]:
                row["skipped"] = "does not fit"
                log(f"decode B={batch} ctx={ctx}: skipped (needs {need / 2**30:.0f} GiB)")
                continue
            p = PagedDecode(batch, ctx)
            row["kv_gb"] = p.kv_bytes / 1e9
            row["splits"] = triton_attention.num_decode_splits(batch, HKV, ctx,
                                                               torch.device("cuda"))
            row["triton_ms"] = bench(p.triton)
            ours = p.triton().clone()
            k, v = p.contiguous(p.key_cache), p.contiguous(p.value_cache)
            q4 = p.query.view(batch, HQ, 1, D)
            sdpa = lambda q4=q4, k=k, v=v: F.scaled_dot_product_attention(  # noqa: E731
                q4, k, v, scale=SCALE, enable_gqa=True)
            row["sdpa_ms"] = bench(sdpa)
            row["err_vs_sdpa"] = rel(ours, sdpa().view(batch, HQ, D))
            del k, v
            torch.cuda.empty_cache()
            if flex_spent < FLEX_BUDGET_S:
                t = time.perf_counter()
                try:
                    flex = flex_paged(p, compiled)
                    row["flex_ms"] = bench(flex)
                    row["flex_err_vs_triton"] = rel(flex().view(batch, HQ, D), ours)
                except Exception as exc:  # report, keep timing the others
                    row["flex_error"] = f"{type(exc).__name__}: {str(exc)[-400:]}"
                    log(f"  flex failed: {row['flex_error']}")
                flex_spent += time.perf_counter() - t
            else:
                row["flex_error"] = "skipped: compile time budget spent"
            for name in ("triton", "sdpa", "flex"):
                if f"{name}_ms" in row:
                    row[f"{name}_frac"] = p.kv_bytes / (row[f"{name}_ms"] * 1e-3) / copy_bw
            log(f"decode B={batch:3d} ctx={ctx:5d} splits={row['splits']:2d} "
                f"triton {row['triton_ms'] * 1e3:8.1f}us ({row['triton_frac']:.0%}) "
                f"sdpa {row['sdpa_ms'] * 1e3:8.1f}us flex "
                f"{row.get('flex_ms', float('nan')) * 1e3:8.1f}us err {row['err_vs_sdpa']:.1e}")
            del p
            torch.cuda.empty_cache()
    return rows


def extend_inputs(batch: int, new: int, prefix: int) -> tuple:
    """Paged cache holding ``prefix + new`` tokens per sequence and the flattened queries."""
    total = prefix + new
    nb = -(-total // BS)
    num_blocks = batch * nb + 1
    key_cache = torch.randn(num_blocks, BS, HKV, D, device="cuda", dtype=DTYPE)
    value_cache = torch.randn_like(key_cache)
    tables = (torch.randperm(num_blocks - 1, device="cuda") + 1).view(batch, nb).int()
    query = torch.randn(batch * new, HQ, D, device="cuda", dtype=DTYPE)
    seq_lens = torch.full((batch,), total, device="cuda", dtype=torch.int32)
    qsl = torch.arange(0, batch * new + 1, new, device="cuda", dtype=torch.int32)
    return query, key_cache, value_cache, tables, seq_lens, qsl, SCALE, new, total


def extend_rows() -> list[dict]:
    from torch.nn.attention.bias import causal_lower_right

    rows = []
    for batch, new, prefix in EXTEND_SHAPES:
        args = extend_inputs(batch, new, prefix)
        query, key_cache, value_cache, tables, *_ = args
        total = prefix + new
        flops = 4 * batch * HQ * D * (new * prefix + new * (new + 1) / 2)
        out = torch.empty_like(query)
        ms = bench(lambda args=args, out=out: triton_attention.paged_attention(*args, out=out))

        def dense(cache: torch.Tensor, tables=tables, batch=batch, total=total) -> torch.Tensor:
            flat = cache[tables.long()].view(batch, -1, HKV, D)[:, :total]
            return flat.transpose(1, 2).repeat_interleave(HQ // HKV, dim=1).contiguous()

        k, v = dense(key_cache), dense(value_cache)
        q = query.view(batch, new, HQ, D).transpose(1, 2).contiguous()
        if prefix:
            mask = causal_lower_right(new, total)
            sdpa = lambda q=q, k=k, v=v, m=mask: F.scaled_dot_product_attention(  # noqa: E731
                q, k, v, attn_mask=m, scale=SCALE)
        else:
            sdpa = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(  # noqa: E731
                q, k, v, is_causal=True, scale=SCALE)
        sdpa_ms = bench(sdpa)
        want = sdpa().transpose(1, 2).reshape(batch * new, HQ, D)
        row = {"batch": batch, "new": new, "prefix": prefix, "triton_ms": ms,
               "sdpa_ms": sdpa_ms, "triton_tflops": flops / ms / 1e9,
               "sdpa_tflops": flops / sdpa_ms / 1e9, "err_vs_sdpa": rel(out, want)}
        rows.append(row)
        log(f"extend B={batch} new={new} prefix={prefix}: triton {ms:.3f}ms "
            f"{row['triton_tflops']:.0f} TFLOP/s, sdpa {sdpa_ms:.3f}ms "
            f"{row['sdpa_tflops']:.0f} TFLOP/s, err {row['err_vs_sdpa']:.1e}")
        del args, query, key_cache, value_cache, k, v, q, out
        torch.cuda.empty_cache()
    return rows


def sweep() -> dict:
    """Pick the fastest decode / extend launch configuration and decode split heuristic
    (scored as the sum of times relative to the first candidate, over several shapes)."""
    result: dict = {"decode": [], "extend": [], "splits": []}
    shapes = [PagedDecode(64, 8192), PagedDecode(8, 8192), PagedDecode(256, 2048)]
    best = (math.inf, None)
    for cfg in DECODE_VARIANTS:
        triton_attention.DECODE_CONFIG["16"] = cfg
        ms = [try_bench(p.triton) for p in shapes]
        result["decode"].append({**cfg, "ms": ms})
        log(f"sweep decode {cfg}: " + " ".join(f"{m * 1e3:.1f}us" for m in ms))
        score = sum(m / b for m, b in zip(ms, result["decode"][0]["ms"], strict=True))
        best = min(best, (score, cfg), key=lambda x: x[0])
    triton_attention.DECODE_CONFIG["16"] = best[1]
    del shapes
    shapes = [PagedDecode(b, c) for b, c in ((1, 512), (1, 2048), (8, 512), (8, 2048),
                                             (64, 2048), (64, 8192))]
    base: list[float] = []
    best_split = (math.inf, None)
    for programs in SPLIT_PROGRAMS_PER_SM:
        for min_tokens in SPLIT_MIN_TOKENS:
            triton_attention.PROGRAMS_PER_SM = programs
            triton_attention.MIN_SPLIT_TOKENS = min_tokens
            ms = [try_bench(p.triton) for p in shapes]
            base = base or ms
            result["splits"].append({"programs_per_sm": programs, "min_tokens": min_tokens,
                                     "ms": ms})
            log(f"sweep splits programs/SM={programs} min_tokens={min_tokens}: "
                + " ".join(f"{m * 1e3:.1f}us" for m in ms))
            score = sum(m / b for m, b in zip(ms, base, strict=True))
            best_split = min(best_split, (score, (programs, min_tokens)), key=lambda x: x[0])
    triton_attention.PROGRAMS_PER_SM, triton_attention.MIN_SPLIT_TOKENS = best_split[1]
    del shapes
    torch.cuda.empty_cache()

    args = extend_inputs(8, 2048, 0)
    out = torch.empty_like(args[0])
    best = (math.inf, None)
    for cfg in EXTEND_VARIANTS:
        use_extend_variant(cfg)
        ms = try_bench(lambda: triton_attention.paged_attention(*args, out=out))
        result["extend"].append({**cfg, "ms": ms})
        log(f"sweep extend {cfg}: {ms:.3f}ms")
        best = min(best, (ms, cfg), key=lambda x: x[0])
    use_extend_variant(best[1])
    result["chosen"] = {"decode": triton_attention.DECODE_CONFIG["16"],
                        "programs_per_sm": triton_attention.PROGRAMS_PER_SM,
                        "min_split_tokens": triton_attention.MIN_SPLIT_TOKENS,
                        "extend": best[1]}
    log(f"chosen: {result['chosen']}")
    return result


def use_extend_variant(cfg: dict[str, int]) -> None:
    """Launch the 16-bit extend kernel with ``cfg`` (its query tile ``BLOCK_M`` included)."""
    triton_attention.EXTEND_BLOCK_M = cfg["BLOCK_M"]
    triton_attention.EXTEND_CONFIG["16"] = {k: v for k, v in cfg.items() if k != "BLOCK_M"}


def plot(decode: list[dict], ax) -> None:
    done = [r for r in decode if "triton_ms" in r]
    labels = [f"{r['batch']}x{r['ctx'] // 1024 or r['ctx']}{'k' if r['ctx'] >= 1024 else ''}"
              for r in done]
    x = range(len(done))
    for i, name in enumerate(("triton", "flex", "sdpa")):
        ax.bar([j + (i - 1) * 0.27 for j in x], [r.get(f"{name}_frac", 0) for r in done],
               width=0.27, label=name)
    ax.axhline(0.8, color="k", ls="--", lw=0.8)
    ax.set_xticks(list(x), labels, rotation=45)
    ax.set_ylabel("KV bytes/s ÷ copy bandwidth")
    ax.set_title("Paged decode, Llama-3.1-8B shapes (batch x context)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-sweep", action="store_true",
                    help="skip the launch-configuration sweep; time the shipped defaults")
    add_out_argument(ap)
    args = ap.parse_args()
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    log(f"{device}, torch {torch.__version__}, triton {triton.__version__}")
    copy_bw, graph_copy_bw = copy_bandwidth()
    torch.cuda.empty_cache()
    log(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write; as a graph memcpy node "
        f"{graph_copy_bw / 1e9:.0f} GB/s)")
    tuned = {"chosen": "shipped defaults"} if args.no_sweep else sweep()
    decode = decode_rows(copy_bw)
    extend = extend_rows()
    report = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
              "copy_gbps": copy_bw / 1e9,
              "graph_copy_gbps": graph_copy_bw / 1e9, "sweep": tuned, "decode": decode,
              "extend": extend}
    (out_dir / "kernels.json").write_text(json.dumps(report, indent=1))
    save_figure(out_dir / "kernels_decode.png", functools.partial(plot, decode),
                figsize=(12, 4), dpi=120)

    print(f"\n{device}; copy bandwidth {copy_bw / 1e9:.0f} GB/s; chosen {tuned['chosen']}")
    print("decode (us; frac = KV bytes/s / copy bw)")
    print(f"{'B':>4s} {'ctx':>6s} {'sp':>3s} {'triton':>9s} {'frac':>5s} {'flex':>9s} {'frac':>5s}"
          f" {'sdpa':>9s} {'frac':>5s} {'t/flex':>6s} {'t/sdpa':>6s}")
    for r in decode:
        if "triton_ms" not in r:
            print(f"{r['batch']:4d} {r['ctx']:6d}  {r['skipped']}")
            continue
        flex = r.get("flex_ms", float("nan"))
        print(f"{r['batch']:4d} {r['ctx']:6d} {r['splits']:3d} {r['triton_ms'] * 1e3:9.1f} "
              f"{r['triton_frac']:5.2f} {flex * 1e3:9.1f} {r.get('flex_frac', math.nan):5.2f} "
              f"{r['sdpa_ms'] * 1e3:9.1f} {r['sdpa_frac']:5.2f} {r['triton_ms'] / flex:6.2f} "
              f"{r['triton_ms'] / r['sdpa_ms']:6.2f}")
    print("prefill/extend (TFLOP/s)")
    print(f"{'B':>4s} {'new':>6s} {'prefix':>6s} {'triton':>7s} {'sdpa':>7s} {'t/sdpa':>7s}")
    for r in extend:
        print(f"{r['batch']:4d} {r['new']:6d} {r['prefix']:6d} {r['triton_tflops']:7.0f} "
              f"{r['sdpa_tflops']:7.0f} {r['triton_ms'] / r['sdpa_ms']:7.2f}")


if __name__ == "__main__":
    main()
