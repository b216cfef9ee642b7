"""The fused CPU kernels (``chatgate_kernels/cpu_native.cpp``) against the torch reference."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from chatgate_kernels import reference
from chatgate_kernels.cpu_native import native

pytestmark = pytest.mark.skipif(native() is None, reason="no C++ compiler to build the kernels")


@pytest.mark.parametrize(
    ("seqs", "group", "block_size"),
    [
        ([(1, 1), (1, 17), (1, 40)], 1, 8),  # pure decode, partial last blocks
        ([(1, 9), (6, 6), (4, 21), (1, 3)], 3, 8),  # mixed, prefill and cached prefix
        ([(5, 37), (0, 12), (1, 16)], 4, 16),  # a q_len 0 row between others
        ([(40, 40), (19, 300), (1, 1000)], 3, 16),  # extends longer than a work item
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_the_reference(batch_factory, seqs, group, block_size,
                                               dtype) -> None:
    batch = batch_factory(seqs, num_kv_heads=2, group=group, head_dim=64,
                          block_size=block_size, dtype=dtype)
    want = reference.paged_attention(*batch.args()).float()
    out = torch.full_like(batch.query, float("nan"))
    got = native().paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                   batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                   batch.scale, out)
    assert got is out
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_paged_attention_takes_float32_queries_over_a_bfloat16_cache_into_bfloat16(
        batch_factory) -> None:
    batch = batch_factory([(1, 33), (7, 20)], num_kv_heads=3, group=3, head_dim=64,
                          block_size=16, dtype=torch.float32)
    key_cache, value_cache = batch.key_cache.bfloat16(), batch.value_cache.bfloat16()
    args = list(batch.args())
    args[1], args[2] = key_cache.float(), value_cache.float()
    want = reference.paged_attention(*args)
    out = torch.empty_like(batch.query, dtype=torch.bfloat16)
    native().paged_attention(batch.query, key_cache, value_cache, batch.block_tables,
                             batch.seq_lens, batch.query_start_loc, batch.scale, out)
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 4, 128)])
@pytest.mark.parametrize("q_len", [6, 20])  # a verify step's tokens; more than a work item's 16
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_each_query_token_of_a_sequence_has_the_bits_of_a_decode_step(
        batch_factory, kv_heads, group, head_dim, q_len, cache_dtype) -> None:
    """``q_len`` query tokens of one sequence after 300 cached (a verify step's): each token's
    output equals, bit for bit, a one-token decode call for it over the keys it sees."""
    batch = batch_factory([(q_len, 300 + q_len)], num_kv_heads=kv_heads, group=group,
                          head_dim=head_dim, block_size=16, dtype=torch.float32)
    key_cache, value_cache = batch.key_cache.to(cache_dtype), batch.value_cache.to(cache_dtype)
    got = native().paged_attention(batch.query, key_cache, value_cache, batch.block_tables,
                                   batch.seq_lens, batch.query_start_loc, batch.scale,
                                   torch.full_like(batch.query, float("nan")))
    for j in range(q_len):
        decode = native().paged_attention(
            batch.query[j:j + 1], key_cache, value_cache, batch.block_tables,
            torch.tensor([301 + j], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            batch.scale, torch.full_like(batch.query[:1], float("nan")))
        assert torch.equal(got[j], decode[0]), f"query token {j}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_and_cache_is_transformers_rotary_bit_for_bit(dtype) -> None:
    """Rotated query (in place) and cached key equal transformers' ``apply_rotary_pos_emb``
    exactly; values are cached as they are; padding slots (-1) write nothing."""
    gen = torch.Generator().manual_seed(7)
    n, heads, kv_heads, dim, block_size = 6, 9, 3, 64, 4
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, v = (t.view(n, -1, dim) for t in qkv.split(
        [heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    angles = torch.rand(n, dim // 2, generator=gen) * 900.0
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    slots = torch.tensor([0, 5, -1, 9, 13, 2])
    key_cache = torch.zeros(4, block_size, kv_heads, dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    want_key_cache, want_value_cache = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(want_k, v, want_key_cache, want_value_cache,
                                slots)
    native().rotary_and_cache(q, k, v, cos, sin, key_cache, value_cache, slots)
    assert torch.equal(q, want_q)
    assert torch.equal(key_cache, want_key_cache)
    assert torch.equal(value_cache, want_value_cache)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_adds_into_the_residual_and_normalises(x_dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, 576, generator=gen).to(x_dtype)
    residual = torch.randn(5, 576, generator=gen) * 30.0
    weight = torch.randn(576, generator=gen)
    want_residual = residual + x.float()
    want = reference.rms_norm(want_residual, weight, 1e-5)
    out = torch.empty(5, 576, dtype=torch.bfloat16)
    native().add_rms_norm(x, residual, weight, 1e-5, out)
    torch.testing.assert_close(residual, want_residual)
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


def test_silu_and_mul_matches_torch() -> None:
    gen = torch.Generator().manual_seed(11)
    gate_up = torch.randn(3, 2 * 1536, generator=gen) * 4.0
    out = torch.empty(3, 1536)
    native().silu_and_mul(gate_up, out)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def _quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as the kernels quantize it: int8 codes per group of 32 and each group's step."""
    groups = x.view(x.shape[0], -1, 32)
    step = groups.abs().amax(-1) / 127.0
    codes = torch.round(groups / torch.where(step > 0, step, 1.0)[..., None])
    return codes, step


@pytest.mark.parametrize("n", [200, 100])  # with AVX2: blocks of 8 rows, and the pair layout
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_int4_linear_is_the_q4_1_by_q8_product(n: int, rows: int) -> None:
    """Weights as 4-bit codes with a float16 scale and minimum per group of 32 (packed by
    ``int4_pack``), activations as int8 codes per group of 32: the sum over groups of
    scale * step * (codes . codes) + minimum * step * sum(codes)."""
    from engine.quantization import int4_groups

    gen = torch.Generator().manual_seed(13)
    weight, x = torch.randn(n, 192, generator=gen), torch.randn(rows, 192, generator=gen)
    codes, scale, low = int4_groups(weight)
    scale, low = scale.half(), low.half()
    packed = native().int4_pack(codes.to(torch.uint8), scale, low)
    q, step = _quantized_rows(x)
    w = codes.view(n, 6, 32).double()
    dots = torch.einsum("ngj,mgj->mng", w, q.double())
    want = (dots * scale.double()[None] * step.double()[:, None]
            + low.double()[None] * (step.double() * q.double().sum(-1))[:, None]).sum(-1)
    out = torch.empty(rows, n)
    native().int4_linear(x, *packed, out)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n", [320, 300])  # blocks of 16 rows (AVX512-VNNI) or 8 (AVX2), and rows
@pytest.mark.parametrize("rows", [1, 2, 15, 32])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 1e-2), (torch.float32, 1e-3)])
def test_int8_linear_is_the_int8_by_q8_product(n: int, rows: int, dtype: torch.dtype,
                                               tol: float) -> None:
    """In float32 the tolerance is float rounding: an activation code off by one is ~1 off."""
    gen = torch.Generator().manual_seed(17)
    weight = torch.randint(-127, 128, (n, 128), generator=gen, dtype=torch.int8)
    row_scales, x = torch.rand(n, generator=gen), torch.randn(rows, 128, generator=gen) * 5
    q, step = _quantized_rows(x)
    dots = torch.einsum("ngj,mgj->mng", weight.view(n, 4, 32).double(), q.double())
    want = (dots * step.double()[:, None]).sum(-1) * row_scales.double()
    out = torch.empty(rows, n, dtype=dtype)
    codes = native().int8_pack((weight.to(torch.int16) + 128).to(torch.uint8))
    assert torch.equal(native().int8_unpack(codes), (weight.to(torch.int16) + 128).to(torch.uint8))
    native().int8_linear(x, codes, row_scales, out)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("n", [320, 300])  # blocks of 16 rows (AVX512-VNNI) or 8 (AVX2), and rows
def test_int8_linear_gives_each_of_1_to_8_rows_the_bits_it_has_alone(n: int) -> None:
    """M = 1..8 activation rows (one pass over each weight block for up to 8 of them with
    AVX512-VNNI, 4 with AVX2): each row's output equals that row's product computed alone
    (M = 1)."""
    gen = torch.Generator().manual_seed(19)
    weight = torch.randint(-127, 128, (n, 256), generator=gen, dtype=torch.int8)
    row_scales, x = torch.rand(n, generator=gen), torch.randn(8, 256, generator=gen) * 5
    codes = native().int8_pack((weight.to(torch.int16) + 128).to(torch.uint8))
    alone = [native().int8_linear(x[r:r + 1], codes, row_scales, torch.empty(1, n))[0]
             for r in range(8)]
    for m in range(1, 9):
        out = native().int8_linear(x[:m], codes, row_scales, torch.empty(m, n))
        for r in range(m):
            assert torch.equal(out[r], alone[r]), f"row {r} of {m}"


def test_a_lock_left_by_a_killed_build_does_not_stall_the_next_load() -> None:
    """torch's lock file in the build folder, as a build killed half-way leaves it: a new
    process still loads the kernels (torch alone would wait for the file forever)."""
    import subprocess
    import sys
    from pathlib import Path

    from chatgate_kernels.cpu_native import build_directory

    build = build_directory()
    (build / "lock").touch()
    loaded = subprocess.run(
        [sys.executable, "-c", "from chatgate_kernels.cpu_native import native; "
                               "print(native() is not None)"],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])
    assert loaded.stdout.strip() == "True", loaded.stderr[-2000:]
    assert not (build / "lock").exists()
