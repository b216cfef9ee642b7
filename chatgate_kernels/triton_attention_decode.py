"""The decode kernels of ``triton_attention`` (rows with ``q_len == 1``): split-K
flash-decoding, one program per (sequence, KV head, split) with every query head of the KV
head packed into one tile, and the merge of the splits by their log-sum-exp. A row with
``seq_len == 0`` yields zeros; rows with other query lengths are skipped."""

import triton
import triton.language as tl

from chatgate_kernels.triton_attention_tiles import dot, load_rows, online_softmax_step, token_rows


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
        rows = token_rows(tok, valid, table, kv_off, stride_cb, stride_ct, stride_bb,
                           BLOCK_SIZE, MASK)
    k = load_rows(k_cache_ptr, rows, d, valid, MASK)
    s = dot(q, tl.trans(k.to(q.dtype)), PRECISION, UPCAST)
    if MASK:
        s = tl.where(valid[None, :], s, float("-inf"))
    return online_softmax_step(s, m, lsum, acc, v_cache_ptr, rows, d, valid, qk_scale, q.dtype,
                                MASK, PRECISION, UPCAST)


@triton.jit
def decode_kernel(
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
def reduce_kernel(
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
