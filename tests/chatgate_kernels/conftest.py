"""Batches for the kernel tests (``tests/conftest.py`` turns on Triton's CPU interpreter)."""

from dataclasses import dataclass

import pytest
import torch


@dataclass
class Batch:
    """A flattened varlen batch over a shuffled paged cache (the kernel contract's inputs)."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    max_query_len: int
    max_seq_len: int

    def args(self, dtype: torch.dtype | None = None) -> tuple:
        """Positional arguments of ``paged_attention``, floats cast to ``dtype`` if given."""
        q, k, v = self.query, self.key_cache, self.value_cache
        if dtype is not None:
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        return (q, k, v, self.block_tables, self.seq_lens, self.query_start_loc, self.scale,
                self.max_query_len, self.max_seq_len)


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> Batch:
    """``seqs`` holds ``(q_len, seq_len)`` pairs. Blocks are drawn from a random permutation
    of a larger pool (every unused block holds random data too), and the block table is a
    non-contiguous view of a wider table whose padding entries are valid block ids."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-seq_len // block_size) for _, seq_len in seqs]
    width = max(need) + 2
    num_blocks = sum(need) + 5
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    wide = torch.randint(0, num_blocks, (len(seqs), width + 3), generator=gen, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(need):
        wide[i, :n] = perm[taken:taken + n].to(torch.int32)
        taken += n
    q_lens = [q_len for q_len, _ in seqs]
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(
        query=query.to(dtype),
        key_cache=key_cache.to(dtype),
        value_cache=value_cache.to(dtype),
        block_tables=wide[:, :width],
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32),
        query_start_loc=starts,
        scale=head_dim**-0.5,
        max_query_len=max(q_lens),
        max_seq_len=max(s for _, s in seqs),
    )


@pytest.fixture
def batch_factory():
    return make_batch


def _assert_fp8_codes_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """FP8 caches hold the same codes, except where Triton's CPU interpreter converts wrongly:
    a value rounded up across a power of two loses the exponent carry (half the correct code:
    7.84 becomes 4, not 8), and subnormals (up to 2**-6, where they round into the normals)
    may round one step (2**-9) apart. The GPU converts correctly;
    ``benchmarks/gpu_kernels_check.py`` checks FP8 writes code for code there."""
    got, want = got.float(), want.float()
    carry_dropped = (got * 2 == want) & (want.abs().log2() % 1 == 0)
    subnormal_step = (want.abs() <= 2**-6) & ((got - want).abs() <= 2**-9)
    assert not ((got != want) & ~carry_dropped & ~subnormal_step).any(), "FP8 codes differ"


@pytest.fixture
def assert_fp8_codes_equal():
    return _assert_fp8_codes_equal
