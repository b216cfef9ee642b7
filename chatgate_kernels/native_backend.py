"""The fused C++ kernels of ``cpu_native`` behind the kernel interface: attention and rotary
with the cache write; the norms and SiLU·mul stay transformers' op-by-op torch code (the
reference's), for the float greedy oracle. Only for caches of the model's float dtypes
(float32, bfloat16)."""

from types import ModuleType

import torch

from chatgate_kernels.reference import AttentionPlan
from chatgate_kernels.reference_backend import ReferenceKernels


class NativeCpuKernels(ReferenceKernels):
    """``native``: the compiled ``cpu_native`` module."""

    name = "fused CPU kernels"

    def __init__(self, native: ModuleType) -> None:
        self.native = native

    def attention_plan(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, slot_mapping: torch.Tensor,
                       block_size: int, num_kv_heads: int) -> AttentionPlan | None:
        return None

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        max_query_len: int, max_seq_len: int, out: torch.Tensor | None = None,
                        plan: AttentionPlan | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0, row_order: torch.Tensor | None = None,
                        extend_tiles: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(query) if out is None else out
        return self.native.paged_attention(query, key_cache, value_cache, block_tables,
                                           seq_lens, query_start_loc, scale, out)

    def rotary_and_cache(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         k_scale: float = 1.0, v_scale: float = 1.0,
                         plan: AttentionPlan | None = None) -> None:
        self.native.rotary_and_cache(query, key, value, cos, sin, key_cache, value_cache,
                                     slot_mapping.long())
