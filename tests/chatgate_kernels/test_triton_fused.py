"""Fused elementwise Triton kernels against the op-by-op torch reference (transformers' Llama
numerics), on CPU under ``TRITON_INTERPRET=1``.

In fp32, rotary only multiplies and adds, so it must match bit for bit; the norm's mean and the
SiLU's exp may differ in the last bit. Triton's interpreter rounds fp32 → bf16 by truncation
where the GPU rounds to nearest even, so bf16 results here are checked to a few steps of the
inputs' magnitude; ``benchmarks/gpu_kernels_check.py`` checks them bit for bit on the GPU.
"""

import pytest
import torch

pytest.importorskip("triton")

from chatgate_kernels import reference, triton_fused  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def assert_nearly_equal(got: torch.Tensor, want: torch.Tensor, magnitude: float = 1.0) -> None:
    """fp32: within two ulps. bf16: within four steps at ``magnitude`` (interpreter rounding)."""
    assert not torch.isnan(got).any()
    step = torch.finfo(want.dtype).eps
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2 * step, atol=1e-6)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=4 * step,
                                   atol=4 * step * magnitude)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm(dtype, hidden) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=gen) * 3).to(dtype)
    weight = (1 + torch.randn(hidden, generator=gen) / 4).to(dtype)
    assert_nearly_equal(triton_fused.rms_norm(x, weight, 1e-5),
                        reference.rms_norm(x, weight, 1e-5), magnitude=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_in_place(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 160, generator=gen).to(dtype)
    x = wide[:, :96]  # strided rows
    residual = torch.randn(5, 96, generator=gen).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype)
    want_residual = residual.clone()
    want = reference.add_rms_norm(x, want_residual, weight, 1e-6)
    got = triton_fused.add_rms_norm(x, residual, weight, 1e-6)
    assert_nearly_equal(residual, want_residual, magnitude=4.0)
    assert_nearly_equal(got, want, magnitude=10.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [48, 1500])
def test_silu_and_mul(dtype, width) -> None:
    gen = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(3, 2 * width, generator=gen) * 4).to(dtype)
    assert_nearly_equal(triton_fused.silu_and_mul(gate_up), reference.silu_and_mul(gate_up),
                        magnitude=100.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [48, 3000])
def test_fp8_per_token_gives_the_references_codes_and_row_scales(
        dtype, width, assert_fp8_codes_equal) -> None:
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(4, width, generator=gen) * torch.tensor([[1e-4], [1.0], [500.0], [0.0]])
         ).to(dtype)
    codes, scales = triton_fused.fp8_per_token(x)
    want_codes, want_scales = reference.fp8_per_token(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (4, 1)
    torch.testing.assert_close(scales, want_scales, rtol=0, atol=0)
    # a quotient exactly half-way between two codes (common from bf16 inputs): torch and the
    # GPU round it to the even code, the interpreter away from zero
    quotient = x.float() / want_scales
    tie = (codes.float() + want_codes.float()) / 2 == quotient
    assert_fp8_codes_equal(torch.where(tie, want_codes.float(), codes.float()), want_codes)
    assert torch.equal(codes.float().abs().amax(dim=1)[:3], torch.full((3,), 448.0))
    assert not codes.float()[3].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(4, 4, 64, 16), (6, 2, 64, 8), (8, 1, 128, 32)])
def test_rotary_and_cache(dtype, num_heads, num_kv_heads, head_dim, block_size) -> None:
    gen = torch.Generator().manual_seed(num_heads + head_dim)
    n, num_blocks, max_pos = 6, 5, 300
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = (t.view(n, -1, head_dim) for t in qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    positions = torch.tensor([0, 17, 255, 3, 299, 100])
    slots = torch.tensor([3, -1, block_size * 4 + 1, 2 * block_size, -1, 7])  # -1: padding
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(cache_shape, float("nan"), dtype=dtype) for _ in range(4)]

    want_q, k_before = q.clone(), k.clone()
    cos, sin = cos[positions], sin[positions]  # each token's rows
    reference.rotary_and_cache(want_q, k, v, cos, sin, caches[0], caches[1], slots)
    triton_fused.rotary_and_cache(q, k, v, cos, sin, caches[2], caches[3], slots)

    key_got, key_want = caches[2].nan_to_num(), caches[0].nan_to_num()
    if dtype == torch.float32:
        assert torch.equal(q, want_q)
        assert torch.equal(key_got, key_want)
    else:
        assert_nearly_equal(q, want_q, magnitude=4.0)
        assert_nearly_equal(key_got, key_want, magnitude=4.0)
    assert torch.equal(k, k_before), "key must be left unrotated"
    assert torch.equal(caches[3].nan_to_num(), caches[1].nan_to_num())
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat = caches[2].view(num_blocks * block_size, -1)
    assert not torch.isnan(flat[written]).any()
    assert torch.isnan(flat[~written]).all(), "padding rows must not be written"


def test_rotary_and_cache_fp8_matches_the_reference(assert_fp8_codes_equal) -> None:
    """Into an FP8 cache the rotated key and the value are stored divided by their scales."""
    gen = torch.Generator().manual_seed(2)
    n, num_heads, num_kv_heads, head_dim, block_size = 5, 4, 2, 64, 16
    q = torch.randn(n, num_heads, head_dim, generator=gen)
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    angles = torch.rand(n, head_dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.tensor([1, -1, 20, 33, 7])
    shape = (3, block_size, num_kv_heads, head_dim)
    caches = [torch.zeros(shape, dtype=reference.FP8) for _ in range(4)]
    want_q = q.clone()
    reference.rotary_and_cache(want_q, k, v, cos, sin, caches[0], caches[1], slots, 0.02, 0.03)
    triton_fused.rotary_and_cache(q, k, v, cos, sin, caches[2], caches[3], slots, 0.02, 0.03)
    assert torch.equal(q, want_q)
    assert_fp8_codes_equal(caches[2], caches[0])
    assert_fp8_codes_equal(caches[3], caches[1])
    assert caches[0].float().abs().max() > 16, "the scale must spread codes over the range"
