"""The torch reference (the oracle of every kernel test) against naive float64 loops."""

import math

import pytest
import torch

from chatgate_kernels import reference


def naive_attention(batch) -> torch.Tensor:
    """Token by token, head by head: softmax over keys ``0..position`` read through the table."""
    q = batch.query.double()
    k_cache, v_cache = batch.key_cache.double(), batch.value_cache.double()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            position = seq_len - q_len + j
            for h in range(q.shape[1]):
                scores, values = [], []
                for t in range(position + 1):
                    block = int(batch.block_tables[i, t // block_size])
                    key = k_cache[block, t % block_size, h // group]
                    scores.append(float(q[starts[i] + j, h] @ key) * batch.scale)
                    values.append(v_cache[block, t % block_size, h // group])
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                out[starts[i] + j, h] = sum(w * v for w, v in zip(weights, values,
                                                                     strict=True)) / total
    return out


@pytest.mark.parametrize(
    ("seqs", "group", "block_size"),
    [
        ([(1, 1), (1, 17), (1, 40)], 1, 8),  # pure decode, partial last blocks
        ([(1, 9), (6, 6), (4, 21), (1, 3)], 3, 8),  # mixed, prefill and cached prefix
        ([(5, 37), (0, 12), (1, 16)], 4, 16),  # a q_len 0 row between others
    ],
)
def test_reference_matches_naive_loops(batch_factory, seqs, group, block_size) -> None:
    batch = batch_factory(seqs, num_kv_heads=2, group=group, head_dim=16,
                          block_size=block_size, dtype=torch.float64)
    got = reference.paged_attention(*batch.args())
    want = naive_attention(batch)
    starts = batch.query_start_loc.tolist()
    rows = [t for i in range(len(seqs)) for t in range(starts[i], starts[i + 1])]
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-10, atol=1e-10)


def test_reference_reshape_and_cache_matches_loop() -> None:
    gen = torch.Generator().manual_seed(1)
    key_cache = torch.randn(6, 8, 2, 16, generator=gen, dtype=torch.float64)
    value_cache = torch.randn(6, 8, 2, 16, generator=gen, dtype=torch.float64)
    key = torch.randn(5, 2, 16, generator=gen, dtype=torch.float64)
    value = torch.randn(5, 2, 16, generator=gen, dtype=torch.float64)
    slots = torch.tensor([17, -1, 0, 47, -1])
    want_k, want_v = key_cache.clone(), value_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // 8, slot % 8] = key[t]
            want_v[slot // 8, slot % 8] = value[t]
    reference.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k)
    assert torch.equal(value_cache, want_v)


def test_rotary_of_fused_qkv_views_equals_rotary_of_separate_tensors() -> None:
    """Query and key heads that are columns of one q/k/v product are rotated together (with
    the rotary factors a plan keeps for its step's later layers): the same query, the same
    cache, bit for bit, as with separate tensors, and the key itself is left unrotated."""
    gen = torch.Generator().manual_seed(3)
    n, heads, kv_heads, dim, block_size = 5, 6, 2, 64, 4
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen)
    q, k, v = (t.view(n, -1, dim) for t in qkv.split(
        [heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    angles = torch.rand(n, dim // 2, generator=gen) * 6.0
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.tensor([0, 5, 6, 9, 13])
    tables = torch.arange(4, dtype=torch.int32)[None, :].repeat(n, 1)
    plan = reference.attention_plan(tables, torch.tensor([n] * n), torch.arange(n + 1), slots,
                                    block_size, kv_heads)
    k_before = k.clone()
    caches = [torch.zeros(4, block_size, kv_heads, dim) for _ in range(4)]
    separate_q = q.clone()
    reference.rotary_and_cache(separate_q, k.clone(), v, cos, sin, caches[0], caches[1], slots)
    assert reference._heads_after(q, k) is not None  # the fused path is the one taken below
    for _ in range(2):  # the second "layer" reuses the plan's factors
        fused_q = qkv.clone()[:, :heads * dim].view(n, heads, dim)
        fused_k = fused_q.as_strided(k.shape, k.stride(), heads * dim)
        fused_k.copy_(k)
        reference.rotary_and_cache(fused_q, fused_k, v, cos, sin, caches[2], caches[3], slots,
                                   plan=plan)
        assert torch.equal(fused_q, separate_q) and torch.equal(fused_k, k_before)
        assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert len(plan.rotary) == 1 and plan.rotary[0][0] is sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_llama_rms_norm_bit_for_bit(dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(5)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576, generator=gen).to(dtype)
    for scale in (1e-3, 1.0, 300.0):
        x = (torch.randn(37, 576, generator=gen) * scale).to(dtype)
        with torch.no_grad():
            assert torch.equal(reference.rms_norm(x, norm.weight.data, 1e-5), norm(x))
