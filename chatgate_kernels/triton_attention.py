"""Triton paged attention over a flattened varlen batch (contract in
``chatgate_kernels/__init__.py``).

Two kernels share one entry point, with no host synchronisation:

- decode rows (``q_len == 1``): split-K flash-decoding. One program owns one (sequence, KV
  head, split) and processes every query head of that KV head at once (GQA packing, the head
  group padded to 16 rows for ``tl.dot``). Each split writes a normalised partial output and
  its log-sum-exp; a reduce kernel merges them. With one split the kernel writes the output
  directly. The grid depends only on ``num_seqs`` and the split count, and the split count only
  on host ints, so the decode path is CUDA-graph capturable. Programs start row by row (the KV
  heads of a row together), the rows in the order of ``row_order`` when given: longest rows
  first, so no long row is left running alone once the short ones have ended.
- extend rows (``q_len > 1``): flash attention with online softmax that walks the KV through
  the block table; key tiles wholly before the first query of a tile skip the causal mask.

Rows with ``q_len == 0`` are skipped; a decode row with ``seq_len == 0`` yields zeros.
All softmax arithmetic is in float32 (base 2); ``tl.dot`` uses IEEE float32 for float32 inputs.
An FP8 cache is read as it is stored, converted to the query's dtype (exact) for ``tl.dot``;
its ``k_scale`` folds into the softmax scale and ``v_scale`` into the output.
"""

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Launch configurations keyed by "16"/"32"-bit queries and "8" for 16-bit queries over an FP8
# cache (benchmarks/attention_kernels.py sweeps alternatives; correctness does not depend on them).
# Optional decode keys (default 0): FULL_TILES runs the whole key tiles of a split without masks
# (one masked tile for the rest); PAGE_ROWS gathers one block-table entry per page of a tile
# instead of one per token (used only when BLOCK_N is a multiple of a power-of-two block size).
# FP8: one warp, 32-token tiles, 5 stages (the pipeliner then keeps two tiles of K/V in flight
# behind the block-table load) -- docs/performance.md "FP8 KV cache".
# 16-bit: one warp, one-page (16-token) tiles, 5 stages, unmasked whole tiles (H200 sweep of 75
# launches: 1-3 % faster than 64 tokens / 4 warps / 4 stages at batch 256, 4 % slower at 1 x 1024).
DECODE_CONFIG: dict[str, dict[str, int]] = {
    "8": {"BLOCK_N": 32, "num_warps": 1, "num_stages": 5, "FULL_TILES": 1, "PAGE_ROWS": 1},
    "16": {"BLOCK_N": 16, "num_warps": 1, "num_stages": 5, "FULL_TILES": 1, "PAGE_ROWS": 1},
    "32": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
}
REDUCE_WARPS = 1  # the split merge is a few hundred bytes per head: one warp is fastest
EXTEND_CONFIG: dict[str, dict[str, int]] = {
    "8": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    "16": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    "32": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
}
# Decode split heuristic, from the H200 sweep in docs/kernels-notes.md.
MIN_SPLIT_TOKENS = 64  # a decode split reads at least this many tokens
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4  # decode aims for about this many programs per multiprocessor

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in float32; ``UPCAST`` works around the interpreter's bf16 dot.

    Products of 16-bit operands are exact in float32, so upcasting first is a faithful
    emulation of the tensor-core path (TRITON_INTERPRET=1 mis-computes bf16 ``tl.dot``).
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _load_rows(cache_ptr, rows, d, valid, MASK: tl.constexpr):
    """The cache rows at offsets ``rows`` (``valid`` masks them with ``MASK``)."""
    if MASK:
        x = tl.load(cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    else:
        x = tl.load(cache_ptr + rows[:, None] + d[None, :])
    return x


@triton.jit
def _token_rows(tok, valid, table, kv_off, stride_cb, stride_ct, stride_bb,
                BLOCK_SIZE: tl.constexpr, MASK: tl.constexpr):
    """Cache row offsets of the tokens ``tok`` through their block table, one entry per token
    (``valid`` masks the lookups with ``MASK``)."""
    if MASK:
        block = tl.load(table + (tok // BLOCK_SIZE) * stride_bb, mask=valid, other=0)
    else:
        block = tl.load(table + (tok // BLOCK_SIZE) * stride_bb)
    return block.to(tl.int64) * stride_cb + (tok % BLOCK_SIZE) * stride_ct + kv_off


@triton.jit
def _online_softmax_step(s, m, lsum, acc, v_cache_ptr, rows, d, valid, qk_scale, dtype,
                         MASK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile's scores ``s`` into the running max ``m``, sum ``lsum`` and output ``acc``
    (the tile's values read at cache ``rows``; ``valid`` masks them with ``MASK``)."""
    m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    lsum = lsum * alpha + tl.sum(p, 1)
    v = _load_rows(v_cache_ptr, rows, d, valid, MASK)
    acc = acc * alpha[:, None] + _dot(p.to(dtype), v.to(dtype), PRECISION, UPCAST)
    return m_new, lsum, acc


@triton.jit
def _decode_tile(
    q, m, lsum, acc, start, hi, table, k_cache_ptr, v_cache_ptr, kv_off, d,
    qk_scale, stride_cb, stride_ct, stride_bb,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
    PAGE_ROWS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One key tile of decode online softmax; ``MASK`` guards the tokens at and past ``hi``.
    ``PAGE_ROWS`` reads one block-table entry per page (tiles start on page boundaries)."""
    tok = start + tl.arange(0, BLOCK_N)
    valid = tok < hi
    if PAGE_ROWS:
        page = start // BLOCK_SIZE + tl.arange(0, BLOCK_N // BLOCK_SIZE)
        if MASK:
            block = tl.load(table + page * stride_bb, mask=page * BLOCK_SIZE < hi, other=0)
        else:
            block = tl.load(table + page * stride_bb)
        rows = ((block.to(tl.int64) * stride_cb)[:, None]
                + (tl.arange(0, BLOCK_SIZE) * stride_ct)[None, :])
        # the reshape hides the strides' alignment from the compiler: restore it (a cache row
        # starts at a multiple of 16 elements, as the strides Triton specialises on show)
        rows = tl.multiple_of(tl.reshape(rows, [BLOCK_N]) + kv_off, 16)
    else:
        rows = _token_rows(tok, valid, table, kv_off, stride_cb, stride_ct, stride_bb,
                           BLOCK_SIZE, MASK)
    k = _load_rows(k_cache_ptr, rows, d, valid, MASK)
    s = _dot(q, tl.trans(k.to(q.dtype)), PRECISION, UPCAST)
    if MASK:
        s = tl.where(valid[None, :], s, float("-inf"))
    return _online_softmax_step(s, m, lsum, acc, v_cache_ptr, rows, d, valid, qk_scale, q.dtype,
                                MASK, PRECISION, UPCAST)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    out_ptr, mid_o_ptr, mid_lse_ptr, row_order_ptr,
    qk_scale, v_scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch,
    stride_bs, stride_bb,
    stride_ms, stride_mh, stride_mk,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    DOT_FP16: tl.constexpr, FULL_TILES: tl.constexpr, PAGE_ROWS: tl.constexpr,
    ORDERED: tl.constexpr,
):
    """One (sequence, KV head, split): all query heads of the KV head over one token range."""
    kv_head = tl.program_id(0)
    if ORDERED:
        seq = tl.load(row_order_ptr + tl.program_id(1)).to(tl.int32)
    else:
        seq = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    split_tokens = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_tokens
    hi = tl.minimum(lo + split_tokens, seq_len)

    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    d = tl.arange(0, HEAD_DIM)
    q_row = q_start.to(tl.int64) * stride_qt
    q = tl.load(q_ptr + q_row + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None], other=0.0)
    if DOT_FP16:
        q = q.to(tl.float16)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bs
    kv_off = kv_head.to(tl.int64) * stride_ch

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    lsum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    if FULL_TILES:  # unmasked whole tiles, then at most one masked tile
        full_end = lo + (hi - lo) // BLOCK_N * BLOCK_N
        for start in range(lo, full_end, BLOCK_N):
            m, lsum, acc = _decode_tile(
                q, m, lsum, acc, start, hi, table, k_cache_ptr, v_cache_ptr, kv_off, d,
                qk_scale, stride_cb, stride_ct, stride_bb,
                BLOCK_SIZE, BLOCK_N, False, PAGE_ROWS, PRECISION, UPCAST,
            )
        if full_end < hi:
            m, lsum, acc = _decode_tile(
                q, m, lsum, acc, full_end, hi, table, k_cache_ptr, v_cache_ptr, kv_off, d,
                qk_scale, stride_cb, stride_ct, stride_bb,
                BLOCK_SIZE, BLOCK_N, True, PAGE_ROWS, PRECISION, UPCAST,
            )
    else:
        for start in range(lo, hi, BLOCK_N):
            m, lsum, acc = _decode_tile(
                q, m, lsum, acc, start, hi, table, k_cache_ptr, v_cache_ptr, kv_off, d,
                qk_scale, stride_cb, stride_ct, stride_bb,
                BLOCK_SIZE, BLOCK_N, True, PAGE_ROWS, PRECISION, UPCAST,
            )

    nonempty = lsum > 0
    o = acc / tl.where(nonempty, lsum, 1.0)[:, None] * v_scale  # exact when v_scale is 1
    if DIRECT:
        dst = out_ptr + q_start.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        mid = seq.to(tl.int64) * stride_ms + heads * stride_mh + split * stride_mk
        tl.store(mid_o_ptr + mid[:, None] * HEAD_DIM + d[None, :], o, mask=head_ok[:, None])
        lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, lsum, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + mid, lse, mask=head_ok)


@triton.jit
def _reduce_kernel(
    out_ptr, mid_o_ptr, mid_lse_ptr, qsl_ptr,
    num_splits,
    stride_ot, stride_oh,
    stride_ms, stride_mh, stride_mk,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Merge the decode splits of one (sequence, query head) by their log-sum-exp."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - q_start != 1:
        return
    k = tl.arange(0, SPLITS_PAD)
    k_ok = k < num_splits
    d = tl.arange(0, HEAD_DIM)
    mid = seq.to(tl.int64) * stride_ms + head * stride_mh + k * stride_mk
    lse = tl.load(mid_lse_ptr + mid, mask=k_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    o = tl.load(mid_o_ptr + mid[:, None] * HEAD_DIM + d[None, :], mask=k_ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(dst, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _extend_tile(
    q, m, lsum, acc, start, qpos, seq_len, table, k_cache_ptr, v_cache_ptr, kv_off, d,
    qk_scale, stride_cb, stride_ct, stride_bb,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One key tile of online softmax; ``MASK`` applies causality and the sequence end."""
    tok = start + tl.arange(0, BLOCK_N)
    valid = tok < seq_len
    rows = _token_rows(tok, valid, table, kv_off, stride_cb, stride_ct, stride_bb, BLOCK_SIZE,
                       MASK)
    k = _load_rows(k_cache_ptr, rows, d, valid, MASK)
    s = _dot(q, tl.trans(k.to(q.dtype)), PRECISION, UPCAST)
    if MASK:
        s = tl.where(valid[None, :] & (tok[None, :] <= qpos[:, None]), s, float("-inf"))
    return _online_softmax_step(s, m, lsum, acc, v_cache_ptr, rows, d, valid, qk_scale, q.dtype,
                                MASK, PRECISION, UPCAST)


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    qk_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch,
    stride_bs, stride_bb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, DOT_FP16: tl.constexpr,
):
    """One (query tile, sequence, query head) of a sequence with ``q_len > 1``; the tiles
    with the most keys (the last ones) are launched first."""
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_len <= 1 or q_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first = seq_len - q_len + q_block * BLOCK_M  # position of the tile's first query
    r = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < q_len
    qpos = seq_len - q_len + r
    d = tl.arange(0, HEAD_DIM)
    tokens = q_start.to(tl.int64) + r
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if DOT_FP16:
        q = q.to(tl.float16)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bs
    kv_off = (head // GROUP).to(tl.int64) * stride_ch

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_end = (first + 1) // BLOCK_N * BLOCK_N  # keys below it are visible to every row
    for start in range(0, full_end, BLOCK_N):
        m, lsum, acc = _extend_tile(
            q, m, lsum, acc, start, qpos, seq_len, table, k_cache_ptr, v_cache_ptr, kv_off, d,
            qk_scale, stride_cb, stride_ct, stride_bb,
            BLOCK_SIZE, BLOCK_N, False, PRECISION, UPCAST,
        )
    end = tl.minimum(first + BLOCK_M, seq_len)
    for start in range(full_end, end, BLOCK_N):
        m, lsum, acc = _extend_tile(
            q, m, lsum, acc, start, qpos, seq_len, table, k_cache_ptr, v_cache_ptr, kv_off, d,
            qk_scale, stride_cb, stride_ct, stride_bb,
            BLOCK_SIZE, BLOCK_N, True, PRECISION, UPCAST,
        )
    o = acc / lsum[:, None] * v_scale
    dst = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@functools.lru_cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # interpreter: any fixed number works
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_decode_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Split count for decode: about PROGRAMS_PER_SM programs per multiprocessor (rounded to
    the nearest count, at least 1), each split reading at least MIN_SPLIT_TOKENS tokens, at
    most MAX_SPLITS. Measured on the H200 (batch 1–256 × context 512–32k, Llama-3.1-8B heads):
    the fastest split count gives ~4 programs per SM at every batch size.

    Depends only on host ints, so a CUDA graph captured with a given ``max_seq_len`` stays
    valid (and correct) for any ``seq_lens`` it is replayed with.
    """
    want = round(PROGRAMS_PER_SM * _sm_count(device) / (num_seqs * num_kv_heads))
    cap = -(-max_seq_len // MIN_SPLIT_TOKENS)
    return max(1, min(want, cap, MAX_SPLITS))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    row_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [num_tokens, num_heads, head_dim]`` over the paged cache.

    ``max_query_len == 1`` means a pure decode batch (one launch, two with splits); otherwise
    the extend kernel runs too and each kernel skips the other's rows. ``out`` (optional) must
    have ``query``'s shape and dtype; ``num_splits`` overrides the decode split heuristic;
    ``row_order`` (a permutation of the sequences, e.g. :func:`longest_first`) is the order in
    which the decode programs start, and changes no result.
    Every tensor needs a contiguous last dimension; ``key_cache``/``value_cache`` share strides.
    """
    out = torch.empty_like(query) if out is None else out
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    call = _Call.of(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
                    scale, k_scale, v_scale)
    _decode(call, num_splits or num_decode_splits(call.num_seqs, call.num_kv_heads,
                                                  max_seq_len, query.device), max_seq_len,
            row_order)
    if max_query_len > 1:
        _extend(call, max_query_len)
    return out


@dataclass(frozen=True)
class _Call:
    """What both kernels of one ``paged_attention`` call are launched with."""

    tensors: tuple[torch.Tensor, ...]  # query, caches, block tables, seq lens, query starts
    out: torch.Tensor
    qk_scale: float  # softmax scale in base 2, the FP8 key scale folded in
    v_scale: float
    strides: tuple[int, ...]  # query/out, cache, block-table strides
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    bits: str  # the launch-configuration key
    constexprs: dict[str, object]  # GROUP, HEAD_DIM, BLOCK_SIZE, PRECISION, UPCAST, DOT_FP16

    @staticmethod
    def of(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
           out: torch.Tensor, scale: float, k_scale: float, v_scale: float) -> "_Call":
        _, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
        if num_heads % num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if any(t.stride(-1) != 1 for t in (query, key_cache, value_cache, out)):
            raise ValueError("query, caches and out need a contiguous last dimension")
        if key_cache.stride() != value_cache.stride():
            raise ValueError("key_cache and value_cache must share strides")
        fp8 = key_cache.dtype == torch.float8_e4m3fn
        bits = "32" if query.dtype == torch.float32 else "8" if fp8 else "16"
        # FP8 codes convert to fp16 in one instruction (to bf16 through fp32): 16-bit queries
        # and probabilities meet them in fp16, which holds every code exactly
        dot_fp16 = fp8 and bits == "8"
        if not fp8:
            k_scale = v_scale = 1.0
        return _Call(
            tensors=(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc),
            out=out, qk_scale=scale * _LOG2E * k_scale, v_scale=v_scale,
            strides=(query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                     key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                     block_tables.stride(0), block_tables.stride(1)),
            num_seqs=seq_lens.shape[0], num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, block_size=block_size, bits=bits,
            constexprs={
                "GROUP": num_heads // num_kv_heads, "HEAD_DIM": head_dim,
                "BLOCK_SIZE": block_size, "PRECISION": "ieee" if bits == "32" else "tf32",
                "UPCAST": (query.dtype == torch.bfloat16 and not dot_fp16
                           and os.environ.get("TRITON_INTERPRET") == "1"),
                "DOT_FP16": dot_fp16,
            },
        )


def longest_first(seq_lens: torch.Tensor) -> torch.Tensor:
    """The sequences by descending ``seq_lens``: the decode order that keeps the last programs
    short. One small sort, no host synchronisation (CUDA-graph capturable)."""
    return torch.argsort(seq_lens, descending=True)


def _decode(call: _Call, splits: int, max_seq_len: int,
            row_order: torch.Tensor | None) -> None:
    """The decode rows: split-K over ``splits`` token ranges, merged when there are several."""
    cfg = DECODE_CONFIG[call.bits]
    block_n = max(cfg["BLOCK_N"], call.block_size)
    # A split of at most one key tile has nothing to pipeline: without stage buffers more
    # programs fit on a multiprocessor (short contexts split many ways).
    stages = 1 if -(-max_seq_len // splits) <= block_n else cfg["num_stages"]
    bs = call.block_size
    page_rows = (cfg.get("PAGE_ROWS", 0) and bs & (bs - 1) == 0 and block_n % bs == 0
                 and all(st % 16 == 0 for st in call.strides[4:7]))  # cache strides
    out = call.out
    mid_o, mid_lse, mid_strides = out, out, (0, 0, 0)  # unused with one split
    if splits > 1:
        mid_o = torch.empty(call.num_seqs, call.num_heads, splits, call.head_dim,
                            dtype=torch.float32, device=out.device)
        mid_lse = torch.empty(call.num_seqs, call.num_heads, splits, dtype=torch.float32,
                              device=out.device)
        mid_strides = (call.num_heads * splits, splits, 1)  # in rows of head_dim / lse entries
    _decode_kernel[(call.num_kv_heads, call.num_seqs, splits)](
        *call.tensors, out, mid_o, mid_lse, out if row_order is None else row_order,
        call.qk_scale, call.v_scale, splits,
        *call.strides, *mid_strides,
        GROUP_PAD=max(16, triton.next_power_of_2(call.constexprs["GROUP"])), BLOCK_N=block_n,
        DIRECT=splits == 1, num_warps=cfg["num_warps"], num_stages=stages,
        FULL_TILES=bool(cfg.get("FULL_TILES", 0)), PAGE_ROWS=bool(page_rows),
        ORDERED=row_order is not None, **call.constexprs,
    )
    if splits > 1:
        _reduce_kernel[(call.num_seqs, call.num_heads)](
            out, mid_o, mid_lse, call.tensors[5], splits, out.stride(0), out.stride(1),
            *mid_strides, HEAD_DIM=call.head_dim, SPLITS_PAD=triton.next_power_of_2(splits),
            num_warps=REDUCE_WARPS,
        )


def _extend(call: _Call, max_query_len: int) -> None:
    """The rows with more than one query token (prefill, extend)."""
    cfg = EXTEND_CONFIG[call.bits]
    grid = (math.ceil(max_query_len / cfg["BLOCK_M"]), call.num_seqs, call.num_heads)
    _extend_kernel[grid](
        *call.tensors, call.out, call.qk_scale, call.v_scale, *call.strides,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=max(cfg["BLOCK_N"], call.block_size),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **call.constexprs,
    )
