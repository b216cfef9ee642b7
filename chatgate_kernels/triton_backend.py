"""The Triton kernels behind the kernel interface (CUDA): paged attention, the cache write,
the fused elementwise steps (one launch each, rounding where transformers rounds), FP8
activations and the sampler's noise. Imported only where a CUDA model is built, so the CPU
never loads Triton."""

import torch

import chatgate_kernels.triton_attention as triton_attention
import chatgate_kernels.triton_cache as triton_cache
import chatgate_kernels.triton_fused as triton_fused
import chatgate_kernels.triton_sampling as triton_sampling
from chatgate_kernels.reference import AttentionPlan
from chatgate_kernels.reference_backend import ReferenceKernels


class TritonKernels(ReferenceKernels):
    """Every op of the interface as Triton launches, none of which waits for the host."""

    name = "Triton"

    def attention_plan(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, slot_mapping: torch.Tensor,
                       block_size: int, num_kv_heads: int) -> AttentionPlan | None:
        return None

    def decode_row_order(self, seq_lens: torch.Tensor) -> torch.Tensor | None:
        """Longest context first: a batch of mixed lengths then ends together instead of
        waiting for a long row started last."""
        return triton_attention.longest_first(seq_lens)

    def extend_tiles(self, query_start_loc: torch.Tensor, num_tokens: int
                     ) -> torch.Tensor | None:
        """Each extend query tile, so the launch never spans sequences times their longest
        query (a captured mixed step's would be mostly empty programs)."""
        return triton_attention.extend_tiles(query_start_loc, num_tokens)

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        max_query_len: int, max_seq_len: int, out: torch.Tensor | None = None,
                        plan: AttentionPlan | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0, row_order: torch.Tensor | None = None,
                        extend_tiles: torch.Tensor | None = None) -> torch.Tensor:
        return triton_attention.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
            max_query_len, max_seq_len, out=out, k_scale=k_scale, v_scale=v_scale,
            row_order=row_order, tiles=extend_tiles,
        )

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor,
                          key_cache: torch.Tensor, value_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: float = 1.0,
                          v_scale: float = 1.0) -> None:
        triton_cache.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                       k_scale, v_scale)

    def rotary_and_cache(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         k_scale: float = 1.0, v_scale: float = 1.0,
                         plan: AttentionPlan | None = None) -> None:
        triton_fused.rotary_and_cache(query, key, value, cos, sin, key_cache, value_cache,
                                      slot_mapping, k_scale, v_scale)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return triton_fused.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        return triton_fused.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return triton_fused.silu_and_mul(gate_up)

    def fp8_per_token(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_fused.fp8_per_token(x)

    def exponential_noise(self, keys: torch.Tensor, vocab: int) -> torch.Tensor:
        return triton_sampling.exponential_noise(keys, vocab)
