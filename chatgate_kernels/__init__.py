"""Paged-attention kernels: one interface (``reference_backend.ReferenceKernels``), three
backends, one of which a model picks when it is built (:func:`model_kernels`): Triton on CUDA
(``triton_backend``), the fused C++ kernels on the CPU (``native_backend`` over ``cpu_native``,
built at first use), and the torch reference (``reference_backend``: the CPU without a
compiler, an FP8 cache on the CPU, and the oracle of the others).

Layout shared by every backend:
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

Per step, a backend's ``attention_plan`` (the torch reference's index work),
``decode_row_order`` (Triton's longest-first start order, which changes no result) and
``extend_tiles`` (Triton's list of extend query tiles) are made once and passed to every
layer. Beside attention, the decoder's elementwise steps (RMSNorm with
the residual add, rotary with the cache write, SiLU·mul) are backend ops: one fused Triton
launch each on CUDA; on the CPU the rotary is the C++ kernel (bit-identical to transformers'),
the norms and SiLU·mul transformers' op-by-op torch code (the quantized CPU model calls
``cpu_native``'s fused ones itself). So are the sampler's counter-based noise and
``fp8_per_token``, the per-row FP8 quantization of an FP8 product's activations
(``--quantization fp8``, CUDA), which depend on the device alone (:func:`device_kernels`).
"""

import functools

import torch

import chatgate_kernels.cpu_native as cpu_native
from chatgate_kernels.native_backend import NativeCpuKernels
from chatgate_kernels.reference import exponential_noise_at
from chatgate_kernels.reference_backend import ReferenceKernels

NATIVE_CACHE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def device_kernels(device_type: str) -> ReferenceKernels:
    """The backend of a device type's ops that read no KV cache (noise, FP8 activations):
    Triton on ``"cuda"`` (imported here, so the CPU never loads it), else the torch
    reference."""
    if device_type == "cuda":
        from chatgate_kernels.triton_backend import TritonKernels

        return TritonKernels()
    return ReferenceKernels()


def model_kernels(device: torch.device, cache_dtype: torch.dtype) -> ReferenceKernels:
    """The backend of a model on ``device`` with a KV cache of ``cache_dtype``: Triton on
    CUDA; on the CPU the fused C++ kernels where they take that cache and build, else the torch
    reference."""
    if device.type != "cpu":
        return device_kernels(device.type)
    native = cpu_native.native() if cache_dtype in NATIVE_CACHE_DTYPES else None
    return NativeCpuKernels(native) if native is not None else ReferenceKernels()


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The sampler's Exp(1) noise ``[len(keys), vocab]`` on ``keys``' device (see
    ``ReferenceKernels.exponential_noise``)."""
    return device_kernels(keys.device.type).exponential_noise(keys, vocab)


__all__ = [
    "NATIVE_CACHE_DTYPES",
    "NativeCpuKernels",
    "ReferenceKernels",
    "device_kernels",
    "exponential_noise",
    "exponential_noise_at",
    "model_kernels",
]
