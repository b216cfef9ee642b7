"""Torch reference of the kernel contract (see ``chatgate_kernels/__init__.py``).

It is the CPU path of the engine and the oracle the Triton kernels are tested against, so it
favours clarity, but batches decode rows into one padded SDPA call so CPU serving stays usable.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as stored in a cache of ``dtype``: cast, or for FP8 divided by the layer's scale
    and saturated to the format's range (a plain cast would turn overflow into NaN)."""
    if dtype == FP8:
        return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return x.to(dtype)


def _select(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache.index_select(0, index)``, through a byte view for FP8 (no CPU kernel of its own)."""
    if cache.dtype == FP8:
        return cache.view(torch.uint8).index_select(0, index).view(FP8)
    return cache.index_select(0, index)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cached values back in ``dtype``: FP8 codes times the layer's scale."""
    if x.dtype == FP8:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    plan: "AttentionPlan | None" = None,
) -> None:
    """``plan``: the step's :func:`attention_plan`, whose ``write_slots`` skip the search for
    padding slots when there is none."""
    if plan is not None and plan.write_slots is not None:
        slots, keep = plan.write_slots, None
    else:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
    for rows, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])
        new = to_cache(rows if keep is None else rows[keep], cache.dtype, scale)
        if cache.dtype == FP8:
            flat, new = flat.view(torch.uint8), new.view(torch.uint8)
        flat.index_copy_(0, slots, new)


def _head_major(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype,
                scale: float) -> torch.Tensor:
    """Rows ``index`` of ``cache`` seen as ``[slots * num_kv_heads, head_dim]``: one gather
    straight into the layout the attention's matrix products read (see :class:`AttentionPlan`)."""
    return from_cache(_select(cache.view(-1, cache.shape[-1]), index), dtype, scale)


def _slot_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[..., n]`` cache slots as the row index of ``[..., num_kv_heads, n]`` head vectors."""
    heads = torch.arange(num_kv_heads, device=slots.device)[:, None]
    return (slots.unsqueeze(-2) * num_kv_heads + heads).flatten()


@dataclass(frozen=True)
class AttentionPlan:
    """The index work of one step's attention, the same for every layer: computed once per step
    (:func:`attention_plan`) instead of once per layer.

    Each layer then reads its cache with one gather per sequence group, straight into
    head-major ``[rows, num_kv_heads, length, head_dim]``: the query heads that share a KV
    head multiply it as one matrix (no copy per query head, no padded block copy)."""

    lens: list[int]
    starts: list[int]
    extend_rows: list[int]  # sequences with more than one query token
    extend_index: list[torch.Tensor]  # each one's [num_kv_heads, len] cache rows, flattened
    decode_rows: list[int]  # sequences with one query token
    decode_index: torch.Tensor  # their [rows, num_kv_heads, decode_len] cache rows, flattened
    decode_len: int  # their longest context
    decode_pad: torch.Tensor | None  # [rows, 1, 1, decode_len]: True past a context; None if none
    decode_tokens: torch.Tensor | None  # their query rows; None when they are all rows in order
    write_slots: torch.Tensor | None  # the step's cache slots (int64) if none is padding
    # the step's rotary factors (see :func:`rotary_and_cache`): ``(sin, cos, signed sin)``,
    # made by the first layer from the ``sin`` every layer is given, reused by the others
    rotary: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=list, compare=False)


def attention_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, slot_mapping: torch.Tensor | None,
                   block_size: int, num_kv_heads: int) -> AttentionPlan:
    """``slot_mapping``: the step's cache writes (None when the plan serves attention only)."""
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()
    decode_rows = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    extend_rows = [i for i in range(len(lens)) if starts[i + 1] - starts[i] > 1]
    device = block_tables.device
    tables = block_tables.long()

    def slots(rows: list[int], length: int) -> torch.Tensor:
        """Each row's first ``length`` cache slots ``[len(rows), length]``."""
        t = torch.arange(length, device=device)
        index = torch.tensor(rows, device=device, dtype=torch.long)
        return tables.index_select(0, index)[:, t // block_size] * block_size + t % block_size

    extend_index = [_slot_rows(slots([i], lens[i])[0], num_kv_heads) for i in extend_rows]
    longest = max((lens[i] for i in decode_rows), default=0)
    row_lens = torch.tensor([lens[i] for i in decode_rows], device=device)
    pad = torch.arange(longest, device=device)[None, :] >= row_lens[:, None]
    # a padded position reads the row's first slot (any valid slot; the mask drops it)
    decode_slots = slots(decode_rows, longest)
    decode_slots = torch.where(pad, decode_slots[:, :1], decode_slots)
    tokens = [starts[i] for i in decode_rows]
    in_order = tokens == list(range(starts[-1]))
    return AttentionPlan(lens, starts, extend_rows, extend_index, decode_rows,
                         _slot_rows(decode_slots, num_kv_heads), longest,
                         pad[:, None, None, :] if bool(pad.any()) else None,
                         None if in_order else torch.tensor(tokens, device=device),
                         slot_mapping.long() if slot_mapping is not None
                         and bool((slot_mapping >= 0).all()) else None)


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
    plan: AttentionPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """``plan``: :func:`attention_plan` of these tensors, when the caller computed it once for
    every layer of the step. ``k_scale``/``v_scale``: the layer's FP8 cache scales."""
    out = torch.empty_like(query) if out is None else out
    if plan is None:
        plan = attention_plan(block_tables, seq_lens, query_start_loc, None,
                              key_cache.shape[1], key_cache.shape[2])
    if plan.decode_rows:
        _decode(query, key_cache, value_cache, plan, scale, out, k_scale, v_scale)
    for i, index in zip(plan.extend_rows, plan.extend_index, strict=True):
        begin, end = plan.starts[i], plan.starts[i + 1]
        _extend(query[begin:end], key_cache, value_cache, index, plan.lens[i], scale,
                out[begin:end], k_scale, v_scale)
    return out


def _extend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    index: torch.Tensor,
    length: int,
    scale: float,
    out: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    """Many queries of one sequence: causal over the new tokens, full over the cached prefix."""
    q_len, num_kv_heads = q.shape[0], key_cache.shape[2]
    k = _head_major(key_cache, index, q.dtype, k_scale).view(num_kv_heads, length, -1)
    v = _head_major(value_cache, index, q.dtype, v_scale).view(num_kv_heads, length, -1)
    mask = None
    if q_len < length:  # a cached prefix: SDPA's is_causal would align the wrong corner
        positions = torch.arange(length - q_len, length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= positions[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask,
                                       is_causal=mask is None, scale=scale, enable_gqa=True)
    out.copy_(o.transpose(0, 1))


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    out: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    """One query per sequence, all sequences in two batched matrix products: each KV head's
    group of query heads against its keys ``[rows, num_kv_heads, group, length]``."""
    rows, length = len(plan.decode_rows), plan.decode_len
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    shape = (rows, num_kv_heads, length, head_dim)
    k = _head_major(key_cache, plan.decode_index, query.dtype, k_scale).view(shape)
    v = _head_major(value_cache, plan.decode_index, query.dtype, v_scale).view(shape)
    tokens = plan.decode_tokens
    q = (query if tokens is None else query[tokens]).view(rows, num_kv_heads, -1, head_dim)
    if plan.decode_pad is None:  # equal lengths: SDPA's fused kernel takes it as it is
        o = F.scaled_dot_product_attention(q, k, v, scale=scale)
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
        scores.masked_fill_(plan.decode_pad, float("-inf"))
        weights = torch.softmax(scores, dim=-1,
                                dtype=torch.promote_types(q.dtype, torch.float32))
        o = torch.matmul(weights.to(q.dtype), v)
    o = o.view(rows, -1, head_dim)
    if tokens is None:
        out.copy_(o)
    else:
        out.index_copy_(0, tokens, o)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``: normalise in fp32, round, then scale by ``weight``. In
    float32 that is ``F.rms_norm``'s own arithmetic, in one call instead of six."""
    if x.dtype == weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [num_tokens, width]`` as FP8 codes with one float32 scale per row ``[num_tokens,
    1]``: ``x ≈ codes * scale``, the scale the row's largest magnitude times 1/448 (a product,
    computed alike on every device; at least 1e-12 / 448, so an all-zero row stays zeros)."""
    x32 = x.float()
    scales = x32.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12) * (1.0 / FP8_MAX)
    return (x32 / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scales


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin``, bit for bit: ``rotate_half(x)`` is
    ``x``'s halves swapped with the new first half negated, and ``-a * s == a * -s`` exactly,
    so the sign moves onto the first half of ``sin`` (``signed_sin``)."""
    n, heads, dim = x.shape
    swapped = x.view(n, heads, 2, dim // 2).flip(2).view(n, heads, dim)
    return x * cos + swapped * signed_sin


def _rotary_factors(cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and the signed ``sin`` of :func:`_rotate`, per head; once per step with a plan."""
    if plan is not None and plan.rotary and plan.rotary[0][0] is sin:
        return plan.rotary[0][1], plan.rotary[0][2]
    half = cos.shape[-1] // 2
    factors = cos.unsqueeze(1), torch.cat((-sin[:, :half], sin[:, half:]), -1)[:, None]
    if plan is not None:
        plan.rotary[:] = [(sin, *factors)]
    return factors


def _heads_after(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """``query`` and ``key`` as one ``[tokens, heads + kv_heads, head_dim]`` view when the key
    heads follow the query heads in memory (the columns of one fused q/k/v product), else None."""
    n, heads, dim = query.shape
    rows = query.stride(0)
    if (query.stride() != (rows, dim, 1) or key.stride() != (rows, dim, 1)
            or rows < (heads + key.shape[1]) * dim
            or key.untyped_storage().data_ptr() != query.untyped_storage().data_ptr()
            or key.data_ptr() != query.data_ptr() + heads * dim * query.element_size()):
        return None
    return query.as_strided((n, heads + key.shape[1], dim), (rows, dim, 1))


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
    plan: AttentionPlan | None = None,
) -> None:
    cos, signed_sin = _rotary_factors(cos, sin, plan)
    both = _heads_after(query, key)
    if both is None:
        query.copy_(_rotate(query, cos, signed_sin))
        key = _rotate(key, cos, signed_sin)
    else:  # one rotation of the query and key heads together; the key stays unrotated
        rotated = _rotate(both, cos, signed_sin)
        query.copy_(rotated[:, :query.shape[1]])
        key = rotated[:, query.shape[1]:]
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, plan)


NOISE_GOLDEN, NOISE_MIX1, NOISE_MIX2 = 0x9E3779B1, 0x21F0AAAD, 0x735A2D97  # odd, < 2**32
NOISE_FLOOR = 2.0**-26  # below -log(1 - 2**-24); keeps a last-bit-rounded log from reaching 0
_MASK32 = 0xFFFFFFFF


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[len(keys), vocab]`` (float32), a pure function of each row's 32-bit key
    and the column: ``-log(u)`` with ``u`` the top 23 bits of a 32-bit integer hash of
    ``column * NOISE_GOLDEN + key`` (mod 2**32), plus a half step, so that
    ``2**-24 <= u <= 1 - 2**-24`` holds exactly in float32 and the noise is never 0 (a zero
    would turn a zero-probability token's ``p / E`` into NaN, which argmax picks).

    The arithmetic is 32-bit unsigned, done in int64 with masks (every product is < 2**63)."""
    columns = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    return exponential_noise_at(keys[:, None], columns[None, :])


def exponential_noise_at(keys: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """:func:`exponential_noise` at given (key, column) pairs only (broadcast together): the
    same values, for a sampler that needs the noise of a few candidate tokens per row."""
    x = columns.to(torch.int64) * NOISE_GOLDEN
    x = (x + keys.to(torch.int64)).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 16).mul_(NOISE_MIX1).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15).mul_(NOISE_MIX2).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    u = (x >> 9).float().add_(0.5).mul_(1.0 / (1 << 23))
    return u.log_().neg_().clamp_min_(NOISE_FLOOR)
