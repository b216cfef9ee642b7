"""The key-tile steps both attention kernels are made of (``triton_attention_decode``,
``triton_attention_extend``): the float32-accumulating dot, cache-row loads through the block
table, and one online-softmax update. Every score is in base 2 (the scale carries log2 e)."""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in float32; ``UPCAST`` works around the interpreter's bf16 dot.

    Products of 16-bit operands are exact in float32, so upcasting first is a faithful
    emulation of the tensor-core path (TRITON_INTERPRET=1 mis-computes bf16 ``tl.dot``).
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def load_rows(cache_ptr, rows, d, valid, MASK: tl.constexpr):
    """The cache rows at offsets ``rows`` (``valid`` masks them with ``MASK``)."""
    if MASK:
        x = tl.load(cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    else:
        x = tl.load(cache_ptr + rows[:, None] + d[None, :])
    return x


@triton.jit
def token_rows(tok, valid, table, kv_off, stride_cb, stride_ct, stride_bb,
                BLOCK_SIZE: tl.constexpr, MASK: tl.constexpr):
    """Cache row offsets of the tokens ``tok`` through their block table, one entry per token
    (``valid`` masks the lookups with ``MASK``)."""
    if MASK:
        block = tl.load(table + (tok // BLOCK_SIZE) * stride_bb, mask=valid, other=0)
    else:
        block = tl.load(table + (tok // BLOCK_SIZE) * stride_bb)
    return block.to(tl.int64) * stride_cb + (tok % BLOCK_SIZE) * stride_ct + kv_off


@triton.jit
def online_softmax_step(s, m, lsum, acc, v_cache_ptr, rows, d, valid, qk_scale, dtype,
                         MASK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile's scores ``s`` into the running max ``m``, sum ``lsum`` and output ``acc``
    (the tile's values read at cache ``rows``; ``valid`` masks them with ``MASK``)."""
    m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    lsum = lsum * alpha + tl.sum(p, 1)
    v = load_rows(v_cache_ptr, rows, d, valid, MASK)
    acc = acc * alpha[:, None] + dot(p.to(dtype), v.to(dtype), PRECISION, UPCAST)
    return m_new, lsum, acc

