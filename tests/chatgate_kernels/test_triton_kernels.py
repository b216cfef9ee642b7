"""Triton kernels against the float64 torch reference, on CPU under ``TRITON_INTERPRET=1``.

Every output is poisoned with NaN first, so an unwritten element fails the test; errors are
relative, ``‖out − ref‖ / ‖ref‖`` over the rows that carry queries.
"""

import pytest
import torch

pytest.importorskip("triton")

from chatgate_kernels import reference, triton_attention, triton_cache  # noqa: E402

BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def check(batch, dtype: torch.dtype, num_splits: int | None = None) -> None:
    q, k, v, *rest = batch.args(dtype)
    out = torch.full_like(q, float("nan"))
    got = triton_attention.paged_attention(q, k, v, *rest, out=out, num_splits=num_splits)
    assert got is out
    want = reference.paged_attention(q.double(), k.double(), v.double(), *rest)
    assert not torch.isnan(got).any(), "unwritten or NaN output"
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < BOUND[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize(
    ("dtype", "block_size", "group", "head_dim", "num_splits"),
    [
        (torch.float32, 16, 1, 64, None),
        (torch.float32, 8, 3, 64, 4),
        (torch.float32, 32, 4, 128, 7),  # more splits than tiles: empty splits
        (torch.bfloat16, 32, 4, 128, 2),
        (torch.bfloat16, 8, 8, 64, 3),
        (torch.float16, 16, 8, 64, 1),
    ],
)
def test_decode(batch_factory, dtype, block_size, group, head_dim, num_splits) -> None:
    seqs = [(1, 1), (1, 2 * block_size), (1, 150), (1, 77)]
    batch = batch_factory(seqs, num_kv_heads=2, group=group, head_dim=head_dim,
                          block_size=block_size, dtype=dtype, seed=block_size + group)
    check(batch, dtype, num_splits)


@pytest.mark.parametrize(
    ("dtype", "block_size", "group", "head_dim"),
    [
        (torch.float32, 8, 1, 64),
        (torch.float32, 16, 3, 64),
        (torch.bfloat16, 32, 4, 64),
        (torch.float16, 16, 8, 128),
    ],
)
def test_extend(batch_factory, dtype, block_size, group, head_dim) -> None:
    # Plain prefill, prefill after a cached prefix (partial and full blocks), a 2-token extend.
    seqs = [(9, 9), (20, 53), (33, 33 + 4 * block_size), (2, 70)]
    batch = batch_factory(seqs, num_kv_heads=1, group=group, head_dim=head_dim,
                          block_size=block_size, dtype=dtype, seed=group)
    check(batch, dtype)


def test_extend_many_tiles(batch_factory, monkeypatch) -> None:
    """Small tiles, so one sequence spans several query tiles and unmasked key tiles."""
    monkeypatch.setattr(triton_attention, "EXTEND_BLOCK_M", 16)
    monkeypatch.setitem(triton_attention.EXTEND_CONFIG, "32",
                        {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1})
    seqs = [(45, 100), (37, 37), (16, 17)]
    batch = batch_factory(seqs, num_kv_heads=2, group=2, head_dim=64, block_size=8,
                          dtype=torch.float32, seed=3)
    check(batch, torch.float32)


@pytest.mark.parametrize(
    ("dtype", "num_splits"), [(torch.float32, None), (torch.bfloat16, 2)],
)
def test_mixed_batch(batch_factory, dtype, num_splits) -> None:
    """Decode rows, a q_len 0 row, prefill and extend rows in one flattened batch."""
    seqs = [(1, 60), (12, 12), (1, 5), (0, 9), (7, 40), (1, 129)]
    batch = batch_factory(seqs, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                          dtype=dtype, seed=7)
    q, k, v, *rest = batch.args(dtype)
    out = torch.full_like(q, float("nan"))
    triton_attention.paged_attention(q, k, v, *rest, out=out, num_splits=num_splits)
    want = reference.paged_attention(q.double(), k.double(), v.double(), *rest)
    assert not torch.isnan(out).any()
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < BOUND[dtype], f"relative error {err:.2e}"


def test_extend_tiles_list_each_query_tile_once_last_first_then_none() -> None:
    q_lens = [1, 130, 0, 64, 2, 1, 0, 0]  # the last two: padding rows of a captured step
    starts = torch.tensor([0] + q_lens).cumsum(0)
    tiles = triton_attention.extend_tiles(starts, num_tokens=198 + 20)  # 20 padding tokens
    assert tiles.dtype == torch.int32
    assert tiles.shape[0] == 4 + 8  # ceil(218 / 64) + min(8 rows, 218 // 2)
    assert tiles[:5].tolist() == [[1, 2], [1, 1], [1, 0], [3, 0], [4, 0]]
    assert (tiles[5:, 0] == -1).all()


@pytest.mark.parametrize("block_m", [64, 16])
def test_extend_over_the_tile_map_writes_what_the_dense_launch_writes(batch_factory,
                                                                       monkeypatch,
                                                                       block_m) -> None:
    """Decode, empty, prefill and extend rows: launched over ``extend_tiles`` (with spare
    tiles) the output is bit-identical to the launch over every sequence."""
    monkeypatch.setattr(triton_attention, "EXTEND_BLOCK_M", block_m)
    monkeypatch.setitem(triton_attention.EXTEND_CONFIG, "16",
                        {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1})
    seqs = [(1, 60), (40, 40), (0, 9), (7, 40), (1, 129), (2, 2)]
    batch = batch_factory(seqs, num_kv_heads=2, group=2, head_dim=64, block_size=16,
                          dtype=torch.bfloat16, seed=5)
    q, k, v, *rest = batch.args(torch.bfloat16)
    outs = []
    for tiles in (None, triton_attention.extend_tiles(rest[2], q.shape[0] + 5)):
        out = torch.full_like(q, float("nan"))
        triton_attention.paged_attention(q, k, v, *rest, out=out, tiles=tiles)
        outs.append(out)
    assert not torch.isnan(outs[0]).any()  # every token row belongs to a sequence
    assert torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_rows_started_in_any_order_give_the_same_output(batch_factory,
                                                              num_splits) -> None:
    """``row_order`` only changes which programs start first: longest-first, reversed and
    in-order launches of a mixed batch (decode rows of several lengths, a prefill row, an empty
    row) write bit-identical outputs, and every row is computed."""
    seqs = [(1, 40), (1, 300), (9, 9), (1, 7), (0, 5), (1, 129)]
    batch = batch_factory(seqs, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                          dtype=torch.bfloat16, seed=11)
    q, k, v, *rest = batch.args(torch.bfloat16)
    seq_lens = rest[1]
    outs = []
    for order in (None, triton_attention.longest_first(seq_lens),
                  torch.arange(len(seqs) - 1, -1, -1)):
        out = torch.full_like(q, float("nan"))
        triton_attention.paged_attention(q, k, v, *rest, out=out, num_splits=num_splits,
                                         row_order=order)
        outs.append(out)
    assert triton_attention.longest_first(seq_lens).tolist()[:2] == [1, 5]
    assert not torch.isnan(outs[0]).any()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_default_splits_are_bounded() -> None:
    cpu = torch.device("cpu")
    assert triton_attention.num_decode_splits(256, 8, 512, cpu) == 1
    assert triton_attention.num_decode_splits(1, 1, 10**6, cpu) == triton_attention.MAX_SPLITS
    assert triton_attention.num_decode_splits(1, 8, 300, cpu) == 5  # ceil(300 / 64)
    # about 4 programs on each of the 16 multiprocessors the interpreter reports
    assert triton_attention.num_decode_splits(1, 4, 10**5, cpu) == 16
    assert triton_attention.num_decode_splits(2, 8, 10**5, cpu) == 4


@pytest.mark.parametrize(
    ("src", "dst", "block_size"),
    [(torch.float32, torch.float32, 8), (torch.float32, torch.bfloat16, 16),
     (torch.float16, torch.float16, 32)],
)
def test_reshape_and_cache(src, dst, block_size) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim = 5, 3, 64
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dst)
    value_cache = torch.randn(shape, generator=gen).to(dst)
    # Non-contiguous token rows: a slice of a wider [tokens, 2 * heads, dim] tensor.
    key = torch.randn(7, 2 * num_kv_heads, head_dim, generator=gen).to(src)[:, :num_kv_heads]
    value = torch.randn(7, num_kv_heads, head_dim, generator=gen).to(src)
    total = num_blocks * block_size
    slots = torch.tensor([3, -1, total - 1, block_size, -5, 2 * block_size + 1, 0],
                         dtype=torch.int64)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    triton_cache.reshape_and_cache(key, value, key_cache, value_cache, slots.to(torch.int32))
    if src == dst:
        assert torch.equal(key_cache, want_k)
        assert torch.equal(value_cache, want_v)
    else:  # the interpreter truncates float32 -> bfloat16 where the GPU rounds: one ulp apart
        torch.testing.assert_close(key_cache, want_k, rtol=2**-7, atol=0)
        torch.testing.assert_close(value_cache, want_v, rtol=2**-7, atol=0)


@pytest.mark.parametrize(
    ("dtype", "seqs", "num_splits"),
    [
        (torch.bfloat16, [(1, 1), (1, 32), (1, 150), (1, 77)], 3),
        (torch.float32, [(1, 60), (12, 12), (0, 9), (7, 40), (1, 129)], None),
    ],
)
def test_fp8_cache_reads_codes_times_layer_scales(batch_factory, dtype, seqs,
                                                  num_splits) -> None:
    """An FP8 cache holds codes; attention sees code × scale (decode and extend rows)."""
    batch = batch_factory(seqs, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                          dtype=torch.float32, seed=11)
    q, k, v, *rest = batch.args(dtype)
    k_scale, v_scale = 0.013, 0.021  # codes up to ~350: the format's upper range is used
    k8 = reference.to_cache(k, reference.FP8, k_scale)
    v8 = reference.to_cache(v, reference.FP8, v_scale)
    out = torch.full_like(q, float("nan"))
    triton_attention.paged_attention(q, k8, v8, *rest, out=out, num_splits=num_splits,
                                     k_scale=k_scale, v_scale=v_scale)
    want = reference.paged_attention(
        q.double(), reference.from_cache(k8, torch.float64, k_scale),
        reference.from_cache(v8, torch.float64, v_scale), *rest)
    rows = torch.tensor([n > 0 for n in (batch.query_start_loc.diff().tolist())])
    assert rows.any()
    assert not torch.isnan(out).any()
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < BOUND[dtype], f"relative error {err:.2e}"


def test_reshape_and_cache_fp8_divides_by_the_scale_and_saturates(
        assert_fp8_codes_equal) -> None:
    gen = torch.Generator().manual_seed(5)
    shape = (4, 16, 2, 64)
    caches = [torch.zeros(shape, dtype=reference.FP8) for _ in range(4)]
    key = torch.randn(6, 2, 64, generator=gen)
    key[0, 0, 0] = 1e4  # beyond 448 × scale: saturates, never NaN
    value = torch.randn(6, 2, 64, generator=gen)
    slots = torch.tensor([0, 17, -1, 63, 5, 40])
    reference.reshape_and_cache(key, value, caches[0], caches[1], slots, 0.05, 0.01)
    triton_cache.reshape_and_cache(key, value, caches[2], caches[3], slots, 0.05, 0.01)
    assert_fp8_codes_equal(caches[2], caches[0])
    assert_fp8_codes_equal(caches[3], caches[1])
    assert caches[0].float()[0, 0, 0, 0] == reference.FP8_MAX
    stored = reference.from_cache(caches[1].view(-1, 2, 64)[slots[slots >= 0]], torch.float32,
                                  0.01)
    torch.testing.assert_close(stored, value[slots >= 0], rtol=2**-3, atol=0.01 * 2**-9)
