"""FP8 decode kernel variants at batch 256 against the production launch (CUDA only).

The FP8 KV target (decode step at ctx 2048 <= 0.65x bf16's) needs the FP8 decode kernel at
about 4.37 TB/s; the production launch reads ~4.1 TB/s. This measures the alternatives that
change how the kernel reads the cache, each against the production launch in the same run:

- ``HND pages``: the production kernel over a cache whose pages are head-major
  (``[block, kv_head, token, dim]``; one head's page is one contiguous 2 KB run).
- ``V^T``: a kernel whose FP8 value pages are stored transposed (``[block, kv_head, dim,
  token]``, vLLM v0's value layout), so that ``P @ V`` reads tokens contiguously and Triton
  feeds the MMA with ``ldmatrix`` instead of single-byte shared-memory loads; one or two pages
  per tile.
- ``TMA``: a kernel that fetches each page's K and V rows of its head with the copy engine
  (Hopper TMA, through tensor descriptors), values as stored or transposed.
- ``splits N``: the production kernel with N decode splits (more, shorter programs).
- ``maxnreg R``: the production kernel with its registers capped (more programs per SM).

    python benchmarks/fp8_decode_variants.py

Times are medians of CUDA-graph replays (``do_bench_cudagraph``); each variant's largest
difference from the production kernel's output (relative to its largest value) is printed
beside its time. Kernel-only: no engine, no model.
"""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chatgate_kernels import triton_attention  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16  # Llama-3.1-8B heads, 16-token pages
SCALE = D**-0.5
K_SCALE, V_SCALE = 0.7, 1.3
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


@triton.jit
def _query_rows(q_ptr, seq, kv_head, stride_qt, stride_qh,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The query heads of one KV head's group, padded to 16 rows, in fp16 (the MMA's input for
    FP8 keys and values), with their head indices and the mask of the real ones."""
    g = tl.arange(0, 16)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None], other=0.0).to(tl.float16)
    return q, heads, head_ok


@triton.jit
def _softmax_step(s, m, lsum, qk_scale):
    """One tile's scores into the running max and sum: (probabilities, rescale, max, sum)."""
    m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    return p, alpha, m_new, lsum * alpha + tl.sum(p, 1)


@triton.jit
def _store_rows(out_ptr, acc, lsum, v_scale, seq, heads, head_ok, stride_qt, stride_qh,
                HEAD_DIM: tl.constexpr):
    """The normalised output of the group's real query heads."""
    d = tl.arange(0, HEAD_DIM)
    o = acc / lsum[:, None] * v_scale
    dst = out_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def _decode_vt_kernel(
    q_ptr, k_ptr, vt_ptr, tables, seq_lens, out_ptr, qk_scale, v_scale,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vh, stride_vd,
    stride_bs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr,
):
    """One (KV head, sequence) over its whole context, ``PAGES`` pages per tile; the value page
    is ``[dim, token]`` (tokens contiguous). The context must be a whole number of tiles."""
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    seq_len = tl.load(seq_lens + seq)
    q, heads, head_ok = _query_rows(q_ptr, seq, kv_head, stride_qt, stride_qh, GROUP, HEAD_DIM)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, PAGES * BLOCK_SIZE) % BLOCK_SIZE  # each column's token within its page
    table = tables + seq.to(tl.int64) * stride_bs
    m = tl.full([16], float("-inf"), tl.float32)
    lsum = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, HEAD_DIM], tl.float32)
    for start in range(0, seq_len, PAGES * BLOCK_SIZE):
        pages = tl.load(table + start // BLOCK_SIZE + tl.arange(0, PAGES)).to(tl.int64)
        block = tl.reshape(tl.broadcast_to(pages[:, None], [PAGES, BLOCK_SIZE]),
                           [PAGES * BLOCK_SIZE])  # each column's cache block
        # the reshape hides the offsets' alignment from the compiler: restate it (every key row
        # starts at a multiple of 16 elements; value rows are runs of one page's tokens)
        k_rows = tl.multiple_of(block * stride_kb + kv_head * stride_kh + t * stride_kt, 16)
        v_cols = tl.max_contiguous(tl.multiple_of(
            block * stride_vb + kv_head * stride_vh + t, BLOCK_SIZE), BLOCK_SIZE)
        k = tl.load(k_ptr + k_rows[:, None] + d[None, :])
        s = tl.dot(q, tl.trans(k.to(tl.float16)))
        p, alpha, m, lsum = _softmax_step(s, m, lsum, qk_scale)
        vt = tl.load(vt_ptr + (d * stride_vd)[:, None] + v_cols[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), tl.trans(vt.to(tl.float16)))
    _store_rows(out_ptr, acc, lsum, v_scale, seq, heads, head_ok, stride_qt, stride_qh, HEAD_DIM)


def decode_vt(q: torch.Tensor, key_cache: torch.Tensor, value_t: torch.Tensor,
              tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
              num_stages: int, pages: int = 1) -> None:
    """``value_t``: ``[num_blocks, kv_heads, head_dim, block_size]``; ``key_cache`` any
    ``[num_blocks, block_size, kv_heads, head_dim]`` view with a contiguous last dimension;
    ``pages`` pages per tile."""
    _decode_vt_kernel[(HKV, seq_lens.shape[0])](
        q, key_cache, value_t, tables, seq_lens, out,
        SCALE * triton_attention._LOG2E * K_SCALE, V_SCALE,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_t.stride(0), value_t.stride(1), value_t.stride(2), tables.stride(0),
        GROUP=HQ // HKV, HEAD_DIM=D, BLOCK_SIZE=BS, PAGES=pages, num_warps=1,
        num_stages=num_stages,
    )


@triton.jit
def _decode_tma_kernel(
    q_ptr, k_desc, v_desc, tables, seq_lens, out_ptr, qk_scale, v_scale,
    stride_qt, stride_qh, stride_bs,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, VALUE_T: tl.constexpr,
):
    """One (KV head, sequence) over its whole context, one page per tile, each page's K and V
    rows of the head fetched by the copy engine (TMA) through tensor descriptors: ``k_desc``
    over token rows ``[blocks * block_size, kv_heads * dim]``; ``v_desc`` the same, or with
    ``VALUE_T`` over transposed value pages ``[blocks * kv_heads * dim, block_size]``. The
    context must be a whole number of pages."""
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    seq_len = tl.load(seq_lens + seq)
    q, heads, head_ok = _query_rows(q_ptr, seq, kv_head, stride_qt, stride_qh, GROUP, HEAD_DIM)
    table = tables + seq.to(tl.int64) * stride_bs
    m = tl.full([16], float("-inf"), tl.float32)
    lsum = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, HEAD_DIM], tl.float32)
    for start in range(0, seq_len, BLOCK_SIZE):
        block = tl.load(table + start // BLOCK_SIZE)
        k = k_desc.load([block * BLOCK_SIZE, kv_head * HEAD_DIM])
        s = tl.dot(q, tl.trans(k.to(tl.float16)))
        p, alpha, m, lsum = _softmax_step(s, m, lsum, qk_scale)
        if VALUE_T:
            vt = v_desc.load([(block * NUM_KV_HEADS + kv_head) * HEAD_DIM, 0])
            pv = tl.dot(p.to(tl.float16), tl.trans(vt.to(tl.float16)))
        else:
            v = v_desc.load([block * BLOCK_SIZE, kv_head * HEAD_DIM])
            pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
        acc = acc * alpha[:, None] + pv
    _store_rows(out_ptr, acc, lsum, v_scale, seq, heads, head_ok, stride_qt, stride_qh, HEAD_DIM)


def decode_tma(q: torch.Tensor, key_cache: torch.Tensor, value: torch.Tensor,
               tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
               num_stages: int, value_t: bool) -> Callable[[], object]:
    """A launch of :func:`_decode_tma_kernel`; ``key_cache`` contiguous ``[num_blocks,
    block_size, kv_heads, head_dim]``, ``value`` the same, or with ``value_t`` transposed pages
    ``[num_blocks, kv_heads, head_dim, block_size]``. Descriptors are made once."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = key_cache.shape[0] * BS
    k_desc = TensorDescriptor(key_cache.view(rows, HKV * D), [rows, HKV * D], [HKV * D, 1],
                              [BS, D])
    if value_t:
        v_rows = value.shape[0] * HKV * D
        v_desc = TensorDescriptor(value.view(v_rows, BS), [v_rows, BS], [BS, 1], [D, BS])
    else:
        v_desc = TensorDescriptor(value.view(rows, HKV * D), [rows, HKV * D], [HKV * D, 1],
                                  [BS, D])

    def launch() -> object:
        return _decode_tma_kernel[(HKV, seq_lens.shape[0])](
            q, k_desc, v_desc, tables, seq_lens, out,
            SCALE * triton_attention._LOG2E * K_SCALE, V_SCALE,
            q.stride(0), q.stride(1), tables.stride(0),
            GROUP=HQ // HKV, NUM_KV_HEADS=HKV, HEAD_DIM=D, BLOCK_SIZE=BS, VALUE_T=value_t,
            num_warps=1, num_stages=num_stages,
        )
    return launch


class RegisterCapped:
    """Stands in for the production decode kernel, launching it with ``maxnreg``."""

    def __init__(self, kernel: triton.JITFunction, maxnreg: int) -> None:
        self.kernel, self.maxnreg = kernel, maxnreg

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]:
        return lambda *args, **kwargs: self.kernel[grid](*args, maxnreg=self.maxnreg, **kwargs)


class Case:
    """A random FP8 or bf16 paged cache at batch 256 and one context, shuffled block tables,
    the same K/V also stored head-major and with transposed value pages."""

    def __init__(self, ctx: int, dtype: torch.dtype, batch: int, gen: torch.Generator) -> None:
        blocks = batch * ctx // BS + 1
        shape = (blocks, BS, HKV, D)
        self.key = torch.randn(shape, device="cuda", generator=gen).to(dtype)
        self.value = torch.randn(shape, device="cuda", generator=gen).to(dtype)
        perm = torch.randperm(blocks - 1, device="cuda", generator=gen) + 1
        self.tables = perm.view(batch, ctx // BS).to(torch.int32)
        self.query = torch.randn(batch, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
        self.seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        self.qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        self.ctx = ctx
        self.kv_bytes = 2 * self.key.numel() * self.key.element_size()

    def production(self, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                   splits: int | None = None) -> Callable[[], object]:
        return lambda: triton_attention.paged_attention(
            self.query, key, value, self.tables, self.seq_lens, self.qsl, SCALE, 1, self.ctx,
            out=out, num_splits=splits, k_scale=K_SCALE, v_scale=V_SCALE)

    def capped(self, maxnreg: int, out: torch.Tensor) -> Callable[[], object]:
        """The production launch with the decode kernel's registers capped at ``maxnreg``."""
        launch = self.production(self.key, self.value, out)

        def run() -> object:
            kernel = triton_attention._decode_kernel
            triton_attention._decode_kernel = RegisterCapped(kernel, maxnreg)
            try:
                return launch()
            finally:
                triton_attention._decode_kernel = kernel
        return run

    def variants(self) -> list[tuple[str, Callable[[], object], torch.Tensor]]:
        """(name, launch, output) for the production launch first, then each alternative."""
        head_major_k = self.key.transpose(1, 2).contiguous().transpose(1, 2)
        head_major_v = self.value.transpose(1, 2).contiguous().transpose(1, 2)
        value_t = self.value.permute(0, 2, 3, 1).contiguous()
        makers: list[tuple[str, Callable[[torch.Tensor], Callable[[], object]]]] = [
            ("production", lambda out: self.production(self.key, self.value, out)),
            ("HND pages", lambda out: self.production(head_major_k, head_major_v, out)),
            ("splits 2", lambda out: self.production(self.key, self.value, out, 2)),
            ("splits 4", lambda out: self.production(self.key, self.value, out, 4)),
        ]
        if self.key.dtype == torch.float8_e4m3fn:
            makers += [(name, lambda out, key=key, stages=stages, pages=pages: lambda: decode_vt(
                            self.query, key, value_t, self.tables, self.seq_lens, out, stages,
                            pages))
                       for name, key, stages, pages in (
                           ("V^T, 5 stages", self.key, 5, 1),
                           ("V^T, 6 stages", self.key, 6, 1),
                           ("V^T + HND K, 5 stages", head_major_k, 5, 1),
                           ("V^T, 2 pages, 4 stages", self.key, 4, 2),
                           ("V^T, 2 pages, 5 stages", self.key, 5, 2),
                           ("V^T + HND K, 2 pages, 5 st", head_major_k, 5, 2))]
            makers += [(name, lambda out, values=values, stages=stages, vt=vt: decode_tma(
                            self.query, self.key, values, self.tables, self.seq_lens, out,
                            stages, vt))
                       for name, values, stages, vt in (
                           ("TMA pages, 5 stages", self.value, 5, False),
                           ("TMA pages, 8 stages", self.value, 8, False),
                           ("TMA K + V^T, 5 stages", value_t, 5, True),
                           ("TMA K + V^T, 8 stages", value_t, 8, True))]
        makers += [(f"maxnreg {r}", lambda out, r=r: self.capped(r, out)) for r in (168, 128)]
        outs = [torch.empty_like(self.query) for _ in makers]
        return [(name, make(out), out) for (name, make), out in zip(makers, outs, strict=True)]


def measure(case: Case) -> list[dict]:
    rows = case.variants()
    rows[0][1]()  # the production output every variant is compared with
    ref = rows[0][2].float()
    results = []
    for name, launch, out in rows:
        launch()
        torch.cuda.synchronize()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        ms = triton.testing.do_bench_cudagraph(launch, rep=60, return_mode="median")
        results.append({"variant": name, "us": ms * 1e3, "gbps": case.kv_bytes / ms / 1e6,
                        "rel_err": err})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 1024, 2048])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_decode_variants.py measures Triton kernels on a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    log(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}")
    table = []
    for ctx in args.ctx:
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            case = Case(ctx, dtype, args.batch, gen)
            for r in measure(case):
                r.update(ctx=ctx, cache="fp8" if dtype == torch.float8_e4m3fn else "bf16")
                table.append(r)
                log(f"ctx {ctx} {r['cache']:4} {r['variant']:24} {r['us']:7.1f} us "
                    f"{r['gbps']:6.0f} GB/s  max rel err {r['rel_err']:.1e}")
            del case
            torch.cuda.empty_cache()
    print(f"\nbatch {args.batch}, Llama-3.1-8B heads; kernel alone, median of CUDA-graph replays")
    print(f"{'ctx':>5} {'cache':5} {'variant':24} {'us':>8} {'GB/s':>6} {'x production':>12}")
    for r in table:
        base = next(b for b in table if b["ctx"] == r["ctx"] and b["cache"] == r["cache"]
                    and b["variant"] == "production")
        print(f"{r['ctx']:5} {r['cache']:5} {r['variant']:24} {r['us']:8.1f} {r['gbps']:6.0f} "
              f"{r['us'] / base['us']:12.3f}")


if __name__ == "__main__":
    main()
