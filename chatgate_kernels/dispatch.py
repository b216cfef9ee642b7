"""Pick the implementation by the tensors' device: Triton on CUDA, torch reference elsewhere."""

import torch

from chatgate_kernels import reference
from chatgate_kernels.cpu_native import native


def _native_for(cache_dtype: torch.dtype):  # noqa: ANN202 - the compiled module or None
    """The fused CPU kernels when they take a cache of this dtype (float32, bfloat16), else
    None (FP8 caches, or no compiler: the torch reference)."""
    if cache_dtype not in (torch.float32, torch.bfloat16):
        return None
    return native()


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value`` rows ``[num_tokens, num_kv_heads, head_dim]`` into their slots."""
    if key.is_cuda:
        from chatgate_kernels import triton_cache

        triton_cache.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                       k_scale, v_scale)
    else:
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping,
                                    k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    plan: reference.AttentionPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    row_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [num_tokens, num_heads, head_dim]`` over the paged cache, written
    into ``out`` when given (a static buffer, for CUDA graphs) and returned. ``plan``: the
    step's :func:`attention_plan` (CPU); ``row_order``: the step's :func:`decode_row_order`."""
    if query.is_cuda:
        from chatgate_kernels import triton_attention

        return triton_attention.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            scale, max_query_len, max_seq_len, out=out, k_scale=k_scale, v_scale=v_scale,
            row_order=row_order,
        )
    fused = _native_for(key_cache.dtype)
    if fused is not None:
        out = torch.empty_like(query) if out is None else out
        return fused.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                     query_start_loc, scale, out)
    return reference.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale, max_query_len, max_seq_len, out=out, plan=plan, k_scale=k_scale,
        v_scale=v_scale,
    )


def attention_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                   num_kv_heads: int, cache_dtype: torch.dtype) -> reference.AttentionPlan | None:
    """The index work of a step's attention, shared by all its layers: computed once per step
    for the CPU's torch reference; None where the kernels index the block tables themselves
    (CUDA, and the fused CPU kernels)."""
    if block_tables.is_cuda or _native_for(cache_dtype) is not None:
        return None
    return reference.attention_plan(block_tables, seq_lens, query_start_loc, slot_mapping,
                                    block_size, num_kv_heads)


def decode_row_order(seq_lens: torch.Tensor) -> torch.Tensor | None:
    """The order in which the decode kernel starts a step's rows, shared by all its layers:
    longest context first on CUDA (a batch of mixed lengths then ends together instead of
    waiting for a long row started last); None on CPU, whose kernels take rows in order."""
    if seq_lens.is_cuda:
        from chatgate_kernels import triton_attention

        return triton_attention.longest_first(seq_lens)
    return None


def _fused_or_reference(t: torch.Tensor):
    """``triton_fused`` for a CUDA tensor (imported on first use, so CPU never loads it),
    else ``reference``: both implement the elementwise contract below."""
    if t.is_cuda:
        from chatgate_kernels import triton_fused

        return triton_fused
    return reference


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[len(keys), vocab]`` (float32), a pure function of each row's 32-bit key
    (int64 ``keys``) and the column, the same on every device (see ``reference``)."""
    if keys.is_cuda:
        from chatgate_kernels import triton_sampling

        return triton_sampling.exponential_noise(keys, vocab)
    return reference.exponential_noise(keys, vocab)


def exponential_noise_at(keys: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``exponential_noise``'s values at (key, column) pairs only (broadcast together)."""
    return reference.exponential_noise_at(keys, columns)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` of ``x [num_tokens, hidden]``."""
    return _fused_or_reference(x).rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``residual += x`` in place, then ``rms_norm(residual)``: the decoder's residual step."""
    return _fused_or_reference(x).add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [num_tokens, 2 * width]`` (gate first)."""
    return _fused_or_reference(gate_up).silu_and_mul(gate_up)


def fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [num_tokens, width]`` as FP8 codes ``[num_tokens, width]`` and float32 scales
    ``[num_tokens, 1]``, one per row: the activations of an FP8 product."""
    return _fused_or_reference(x).fp8_per_token(x)


def rotary_and_cache(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    plan: reference.AttentionPlan | None = None,
) -> None:
    """Rotate ``query`` in place by each token's rotary rows ``cos``/``sin [num_tokens,
    head_dim]``, and write the rotated ``key`` and ``value`` into their cache slots. ``plan``:
    the step's :func:`attention_plan` (CPU)."""
    if query.is_cuda:
        from chatgate_kernels import triton_fused

        triton_fused.rotary_and_cache(query, key, value, cos, sin, key_cache, value_cache,
                                      slot_mapping, k_scale, v_scale)
    elif (fused := _native_for(key_cache.dtype)) is not None:
        fused.rotary_and_cache(query, key, value, cos, sin, key_cache, value_cache,
                               slot_mapping.long())
    else:
        reference.rotary_and_cache(query, key, value, cos, sin, key_cache, value_cache,
                                   slot_mapping, k_scale, v_scale, plan)
