"""Paged-attention kernels: one contract; Triton on CUDA, fused C++ on CPU (``cpu_native``,
built at first use), and the torch reference (the CPU path without a compiler, and the oracle).

Layout shared by every implementation:
- ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
- The caches hold the model's dtype, or FP8 (``torch.float8_e4m3fn``) with one ``k_scale`` and
  one ``v_scale`` per layer: a cached value is its FP8 code times the scale. Writes divide by
  the scale and saturate at ±448; reads multiply. Scales are ignored for other dtypes.
- A slot is ``block_id * block_size + offset``; a negative slot means "padding, skip".
- ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``; entries past a sequence's
  last block are never read for attention but must hold a valid block id (the engine pads with 0).
- ``seq_lens``: int32 ``[num_seqs]``, each sequence's context length *after* this step's tokens
  were written into the cache.
- ``query_start_loc``: int32 ``[num_seqs + 1]``, cumulative query lengths over the flattened
  batch. Query ``j`` of sequence ``i`` sits at position ``seq_lens[i] - q_len_i + j`` and attends
  to keys ``0..position`` (causal over the new tokens, full over the cached prefix).

``decode_row_order(seq_lens)`` is the order in which the CUDA decode kernel starts a step's
rows (longest context first; None on CPU): made once per step, passed to every layer's
``paged_attention``, it changes no result.

Beside attention, the decoder's elementwise steps (RMSNorm with the residual add, rotary with
the cache write, SiLU·mul) share the same dispatch: one fused Triton launch each on CUDA; on CPU
the rotary is the C++ kernel (bit-identical to transformers'), the norms and SiLU·mul
transformers' op-by-op torch code (the quantized model calls ``cpu_native``'s fused ones
itself). So do the sampler's counter-based noise and ``fp8_per_token``, the per-row FP8
quantization of an FP8 product's activations (``--quantization fp8``, CUDA).
"""

from chatgate_kernels import cpu_native
from chatgate_kernels.dispatch import (
    add_rms_norm,
    attention_plan,
    decode_row_order,
    exponential_noise,
    exponential_noise_at,
    fp8_per_token,
    paged_attention,
    reshape_and_cache,
    rms_norm,
    rotary_and_cache,
    silu_and_mul,
)

__all__ = [
    "cpu_native",
    "add_rms_norm",
    "attention_plan",
    "decode_row_order",
    "exponential_noise",
    "exponential_noise_at",
    "fp8_per_token",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_and_cache",
    "silu_and_mul",
]
