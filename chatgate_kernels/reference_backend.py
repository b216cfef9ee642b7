"""The kernel interface the model calls, computed by the torch reference (``reference``).

:class:`ReferenceKernels` is the interface: every backend (``triton_backend``,
``native_backend``) is a subclass that overrides what it computes itself. The torch reference
runs wherever nothing faster does (a CPU without a compiler, an FP8 cache on the CPU) and is the
oracle of the others.
"""

import torch

import chatgate_kernels.reference as reference
from chatgate_kernels.reference import AttentionPlan


class ReferenceKernels:
    """One step's ops over the paged cache (contract in ``chatgate_kernels/__init__.py``)."""

    name = "torch reference"

    def attention_plan(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, slot_mapping: torch.Tensor,
                       block_size: int, num_kv_heads: int) -> AttentionPlan | None:
        """The index work of a step's attention, shared by all its layers (made once per
        step); None where the kernels index the block tables themselves."""
        return reference.attention_plan(block_tables, seq_lens, query_start_loc, slot_mapping,
                                        block_size, num_kv_heads)

    def decode_row_order(self, seq_lens: torch.Tensor) -> torch.Tensor | None:
        """The order in which the decode kernel starts a step's rows, shared by all its layers
        (it changes no result); None where rows are taken in order."""
        return None

    def extend_tiles(self, query_start_loc: torch.Tensor, num_tokens: int
                     ) -> torch.Tensor | None:
        """The extend launch's work list of a step of ``num_tokens`` query tokens, shared by
        all its layers (device ops only: a captured step's launch is as large as its bound);
        None where the kernel takes every sequence."""
        return None

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        max_query_len: int, max_seq_len: int, out: torch.Tensor | None = None,
                        plan: AttentionPlan | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0, row_order: torch.Tensor | None = None,
                        extend_tiles: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``query [num_tokens, num_heads, head_dim]`` over the paged cache,
        written into ``out`` when given (a static buffer, for CUDA graphs) and returned.
        ``plan``: the step's :meth:`attention_plan`; ``row_order``: its
        :meth:`decode_row_order`; ``extend_tiles``: its :meth:`extend_tiles`."""
        return reference.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
            max_query_len, max_seq_len, out=out, plan=plan, k_scale=k_scale, v_scale=v_scale,
        )

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor,
                          key_cache: torch.Tensor, value_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: float = 1.0,
                          v_scale: float = 1.0) -> None:
        """Write ``key``/``value`` rows ``[num_tokens, num_kv_heads, head_dim]`` into their
        slots."""
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale,
                                    v_scale)

    def rotary_and_cache(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         k_scale: float = 1.0, v_scale: float = 1.0,
                         plan: AttentionPlan | None = None) -> None:
        """Rotate ``query`` in place by each token's rotary rows ``cos``/``sin [num_tokens,
        head_dim]``, and write the rotated ``key`` and ``value`` into their cache slots."""
        reference.rotary_and_cache(query, key, value, cos, sin, key_cache, value_cache,
                                   slot_mapping, k_scale, v_scale, plan)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """transformers' ``LlamaRMSNorm`` of ``x [num_tokens, hidden]``."""
        return reference.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``residual += x`` in place, then ``rms_norm(residual)``: the decoder's residual
        step."""
        return reference.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up [num_tokens, 2 * width]`` (gate first)."""
        return reference.silu_and_mul(gate_up)

    def fp8_per_token(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [num_tokens, width]`` as FP8 codes and float32 scales ``[num_tokens, 1]``, one
        per row: the activations of an FP8 product."""
        return reference.fp8_per_token(x)

    def exponential_noise(self, keys: torch.Tensor, vocab: int) -> torch.Tensor:
        """Exp(1) noise ``[len(keys), vocab]`` (float32), a pure function of each row's 32-bit
        key (int64 ``keys``) and the column, the same from every backend."""
        return reference.exponential_noise(keys, vocab)
