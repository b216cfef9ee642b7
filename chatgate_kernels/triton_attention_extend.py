"""The extend kernel of ``triton_attention`` (rows with ``q_len > 1``: prefill, chunked
prefill): flash attention with online softmax over the block table, causal over the new
tokens; key tiles wholly before a query tile's first query skip the mask."""

import triton
import triton.language as tl

from chatgate_kernels.triton_attention_tiles import dot, load_rows, online_softmax_step, token_rows


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
    rows = token_rows(tok, valid, table, kv_off, stride_cb, stride_ct, stride_bb, BLOCK_SIZE,
                       MASK)
    k = load_rows(k_cache_ptr, rows, d, valid, MASK)
    s = dot(q, tl.trans(k.to(q.dtype)), PRECISION, UPCAST)
    if MASK:
        s = tl.where(valid[None, :] & (tok[None, :] <= qpos[:, None]), s, float("-inf"))
    return online_softmax_step(s, m, lsum, acc, v_cache_ptr, rows, d, valid, qk_scale, q.dtype,
                                MASK, PRECISION, UPCAST)


@triton.jit
def extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    tiles_ptr, qk_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch,
    stride_bs, stride_bb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, DOT_FP16: tl.constexpr, TILED: tl.constexpr,
):
    """One (query tile, sequence, query head) of a sequence with ``q_len > 1``. ``TILED``:
    program ``(t, head)`` takes tile ``t`` of the ``[tiles, 2]`` map (sequence, query tile;
    sequence -1: none); else program ``(i, seq, head)`` takes tile ``num_programs(0) - 1 - i``.
    Either way a sequence's tiles with the most keys (the last ones) are launched first."""
    if TILED:
        seq = tl.load(tiles_ptr + 2 * tl.program_id(0))
        q_block = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
        head = tl.program_id(1)
        if seq < 0:
            return
    else:
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

