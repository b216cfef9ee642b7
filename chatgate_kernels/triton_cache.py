"""Triton ``reshape_and_cache``: scatter new K/V rows into their paged-cache slots.

Invariants: caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` with a contiguous
last dimension; ``slot = block_id * block_size + offset``; a negative slot is padding and
leaves the cache untouched. Values are cast to the cache dtype; an FP8 cache stores them
divided by the layer's scale, saturated at ±448. No host synchronisation.
"""

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # largest float8_e4m3fn value


@triton.jit
def to_cache(x, scale, ty: tl.constexpr, FP8: tl.constexpr):
    """``x`` as stored in a cache of element type ``ty`` (see ``reference.to_cache``)."""
    if FP8:
        return tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX).to(ty)
    else:
        return x.to(ty)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    block_size,
    head_dim,
    k_scale,
    v_scale,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    d = tl.arange(0, BLOCK_D)
    mask = d < head_dim
    dst = block * stride_cb + offset * stride_ct + head * stride_ch + d
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    ty = key_cache_ptr.dtype.element_ty
    tl.store(key_cache_ptr + dst, to_cache(k, k_scale, ty, FP8), mask=mask)
    tl.store(value_cache_ptr + dst, to_cache(v, v_scale, ty, FP8), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots.

    ``key``/``value`` need a contiguous last dimension; ``key_cache`` and ``value_cache`` must
    share strides. ``slot_mapping`` is any integer dtype, one entry per token.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or key_cache.stride(-1) != 1:
        raise ValueError("reshape_and_cache needs a contiguous last dimension")
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must share strides")
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        key_cache.shape[1], head_dim, k_scale, v_scale,
        BLOCK_D=triton.next_power_of_2(head_dim), FP8=key_cache.dtype == torch.float8_e4m3fn,
    )
