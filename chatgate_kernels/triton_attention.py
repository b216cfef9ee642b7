"""Triton paged attention over a flattened varlen batch (contract in
``chatgate_kernels/__init__.py``).

Two kernels (``triton_attention_decode``, ``triton_attention_extend``) share this entry point,
with no host synchronisation:

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

from chatgate_kernels.triton_attention_decode import decode_kernel, reduce_kernel
from chatgate_kernels.triton_attention_extend import extend_kernel

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
EXTEND_BLOCK_M = 64  # query rows of an extend tile, every dtype (the tile map's unit)
EXTEND_CONFIG: dict[str, dict[str, int]] = {
    "8": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    "16": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    "32": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
}
# Decode split heuristic, from the H200 sweep in docs/kernels-notes.md.
MIN_SPLIT_TOKENS = 64  # a decode split reads at least this many tokens
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4  # decode aims for about this many programs per multiprocessor

_LOG2E = 1.4426950408889634


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


def extend_tiles(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The extend kernel's tile map of a step of ``num_tokens`` query tokens: ``[tiles, 2]``
    int32 rows (sequence, query tile) for every ``EXTEND_BLOCK_M``-query tile of each sequence
    with ``q_len > 1``, a sequence's last tile first, then rows ``(-1, 0)`` up to the bound
    ``ceil(num_tokens / EXTEND_BLOCK_M) + min(num_seqs, num_tokens // 2)``, which depends on
    host ints only. Device ops, no host synchronisation (CUDA-graph capturable): the launch
    is as large as the bound, not the number of sequences times their longest query."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    n = q_lens.shape[0]
    blocks = torch.where(q_lens > 1, (q_lens + EXTEND_BLOCK_M - 1) // EXTEND_BLOCK_M, 0)
    ends = torch.cumsum(blocks, 0)
    bound = -(-num_tokens // EXTEND_BLOCK_M) + min(n, num_tokens // 2)
    t = torch.arange(bound, device=query_start_loc.device)
    seq = torch.searchsorted(ends, t, right=True).clamp_(max=n - 1)
    q_block = ends[seq] - 1 - t  # counted back from the sequence's last tile
    return torch.stack([torch.where(t < ends[-1], seq, -1), q_block], 1).to(torch.int32)


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
    tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [num_tokens, num_heads, head_dim]`` over the paged cache.

    ``max_query_len == 1`` means a pure decode batch (one launch, two with splits); otherwise
    the extend kernel runs too and each kernel skips the other's rows. ``out`` (optional) must
    have ``query``'s shape and dtype; ``num_splits`` overrides the decode split heuristic;
    ``row_order`` (a permutation of the sequences, e.g. :func:`longest_first`) is the order in
    which the decode programs start, and changes no result; ``tiles`` (:func:`extend_tiles`)
    launches the extend kernel over its tile map instead of over every sequence.
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
        _extend(call, max_query_len, tiles)
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
    decode_kernel[(call.num_kv_heads, call.num_seqs, splits)](
        *call.tensors, out, mid_o, mid_lse, out if row_order is None else row_order,
        call.qk_scale, call.v_scale, splits,
        *call.strides, *mid_strides,
        GROUP_PAD=max(16, triton.next_power_of_2(call.constexprs["GROUP"])), BLOCK_N=block_n,
        DIRECT=splits == 1, num_warps=cfg["num_warps"], num_stages=stages,
        FULL_TILES=bool(cfg.get("FULL_TILES", 0)), PAGE_ROWS=bool(page_rows),
        ORDERED=row_order is not None, **call.constexprs,
    )
    if splits > 1:
        reduce_kernel[(call.num_seqs, call.num_heads)](
            out, mid_o, mid_lse, call.tensors[5], splits, out.stride(0), out.stride(1),
            *mid_strides, HEAD_DIM=call.head_dim, SPLITS_PAD=triton.next_power_of_2(splits),
            num_warps=REDUCE_WARPS,
        )


def _extend(call: _Call, max_query_len: int, tiles: torch.Tensor | None) -> None:
    """The rows with more than one query token (prefill, extend)."""
    cfg = EXTEND_CONFIG[call.bits]
    if tiles is None:
        grid = (math.ceil(max_query_len / EXTEND_BLOCK_M), call.num_seqs, call.num_heads)
    else:
        grid = (tiles.shape[0], call.num_heads)
    extend_kernel[grid](
        *call.tensors, call.out, call.out if tiles is None else tiles, call.qk_scale,
        call.v_scale, *call.strides,
        BLOCK_M=EXTEND_BLOCK_M, BLOCK_N=max(cfg["BLOCK_N"], call.block_size),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], TILED=tiles is not None,
        **call.constexprs,
    )
