"""Triton ``reshape_and_cache``: scatter new K/V rows into their paged-cache slots.

Invariants: caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` with a contiguous
last dimension; ``slot = block_id * block_size + offset``; a negative slot is padding and
leaves the cache untouched. Values are cast to the cache dtype. No host synchronisation.
"""

import torch
import triton
import triton.language as tl


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
    BLOCK_D: tl.constexpr,
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
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
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
        key_cache.shape[1], head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
