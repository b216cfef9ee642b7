"""Triton fusions of the decoder's elementwise work: RMSNorm (with the residual add), rotary
embedding (with the K/V cache write) and SiLU·mul.

Each one rounds to the activation dtype exactly where transformers' Llama rounds (every torch
op on bf16 computes in fp32 and rounds its result), so it reproduces the op-by-op torch path
(``chatgate_kernels/reference.py``) up to the fp32 summation order of the norm's mean of squares.
One launch replaces 3–12 small kernels; no host synchronisation.
"""

import torch
import triton
import triton.language as tl

from chatgate_kernels.triton_cache import FP8_MAX, to_cache

INV_FP8_MAX = tl.constexpr(1.0 / 448.0)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_r, stride_o, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    normed = (x32 * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def _check_rows(*tensors: torch.Tensor) -> None:
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("fused kernels need a contiguous last dimension")


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> torch.Tensor:
    res = x if residual is None else residual  # unused without a residual
    _check_rows(x, res)
    out = torch.empty_like(x)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), x.shape[1], eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(x.shape[1]),
        )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x)`` over the last dimension of ``x [num_tokens, hidden]``."""
    return _norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``residual += x`` (in place, rounded to its dtype), then ``weight * rmsnorm(residual)``."""
    return _norm(x, residual, weight, eps)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, width, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    out = (act.to(tl.float32) * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up [num_tokens, 2 * width]`` holds gate then up."""
    _check_rows(gate_up)
    num_tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(num_tokens, width)
    block = min(1024, triton.next_power_of_2(width))
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=block,
        )
    return out


@triton.jit
def _fp8_per_token_kernel(
    x_ptr, codes_ptr, scale_ptr, stride_x, stride_c, width, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        mask = start + cols < width
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) * INV_FP8_MAX
    tl.store(scale_ptr + row, scale)
    for start in range(0, width, BLOCK):
        mask = start + cols < width
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0)
        # a correctly rounded division (``/`` compiles to an approximate one), as torch's
        codes = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX)
        tl.store(codes_ptr + row * stride_c + start + cols,
                 codes.to(codes_ptr.dtype.element_ty), mask=mask)


def fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [num_tokens, width]`` as FP8 codes and one float32 scale per row (see
    ``reference.fp8_per_token``), in one launch of a program per row."""
    _check_rows(x)
    num_tokens, width = x.shape
    codes = torch.empty(num_tokens, width, device=x.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty(num_tokens, 1, device=x.device, dtype=torch.float32)
    if num_tokens:
        _fp8_per_token_kernel[(num_tokens,)](
            x, codes, scales, x.stride(0), codes.stride(0), width,
            BLOCK=min(2048, triton.next_power_of_2(width)), num_warps=4,
        )
    return codes, scales


@triton.jit
def _rotate(x_ptrs, c1, c2, s1, s2, mask, HALF: tl.constexpr):
    """``x * cos + rotate_half(x) * sin`` for a tile of heads ``[heads, HALF]`` (two halves),
    each product and the sum rounded to the activation dtype, as transformers computes it."""
    ty = x_ptrs.dtype.element_ty
    x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    first = (x1 * c1).to(ty).to(tl.float32) + (-x2 * s1).to(ty).to(tl.float32)
    second = (x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)
    return first.to(ty), second.to(ty)


@triton.jit
def _rotary_and_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, key_cache_ptr, value_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_table,
    stride_cb, stride_ct, stride_ch, block_size, num_heads, num_kv_heads, k_scale, v_scale,
    HALF: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, FP8: tl.constexpr,
):
    """One token: every query head rotated in place, every K/V head written to its slot."""
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    table = token * stride_table
    c1 = tl.load(cos_ptr + table + d).to(tl.float32)
    c2 = tl.load(cos_ptr + table + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + table + d).to(tl.float32)
    s2 = tl.load(sin_ptr + table + HALF + d).to(tl.float32)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    q = q_ptr + token * stride_qt + heads * stride_qh + d
    first, second = _rotate(q, c1, c2, s1, s2, heads < num_heads, HALF)
    tl.store(q, first, mask=heads < num_heads)
    tl.store(q + HALF, second, mask=heads < num_heads)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        kv_heads = tl.arange(0, KV_HEADS_PAD)[:, None]
        kv_ok = kv_heads < num_kv_heads
        k_first, k_second = _rotate(k_ptr + token * stride_kt + kv_heads * stride_kh + d,
                                    c1, c2, s1, s2, kv_ok, HALF)
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct \
            + kv_heads * stride_ch + d
        ty = key_cache_ptr.dtype.element_ty
        tl.store(key_cache_ptr + dst, to_cache(k_first, k_scale, ty, FP8), mask=kv_ok)
        tl.store(key_cache_ptr + dst + HALF, to_cache(k_second, k_scale, ty, FP8), mask=kv_ok)
        v = v_ptr + token * stride_vt + kv_heads * stride_vh + d
        tl.store(value_cache_ptr + dst, to_cache(tl.load(v, mask=kv_ok), v_scale, ty, FP8),
                 mask=kv_ok)
        tl.store(value_cache_ptr + dst + HALF,
                 to_cache(tl.load(v + HALF, mask=kv_ok), v_scale, ty, FP8), mask=kv_ok)


def rotary_and_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Rotate ``query [num_tokens, num_heads, head_dim]`` in place and write the rotated
    ``key`` and ``value [num_tokens, num_kv_heads, head_dim]`` into their cache slots
    (an FP8 cache stores them divided by ``k_scale``/``v_scale``).

    ``cos``/``sin`` are ``[num_tokens, head_dim]``, each token's rows of the rotary tables; a
    negative slot skips the cache write (padding). ``key`` itself is left unrotated.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    _check_rows(query, key, value, cos, sin, key_cache)
    if head_dim & (head_dim - 1):
        raise ValueError(f"rotary_and_cache needs a power-of-two head_dim, got {head_dim}")
    if key_cache.stride() != value_cache.stride() or cos.stride() != sin.stride():
        raise ValueError("key/value caches and cos/sin tables must share strides")
    if num_tokens == 0:
        return
    _rotary_and_cache_kernel[(num_tokens,)](
        query, key, value, cos, sin, slot_mapping, key_cache, value_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), cos.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        key_cache.shape[1], num_heads, num_kv_heads, k_scale, v_scale, HALF=head_dim // 2,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        FP8=key_cache.dtype == torch.float8_e4m3fn,
        enable_fp_fusion=False,  # no FMA: fp32 products round before the add, as in torch
    )
