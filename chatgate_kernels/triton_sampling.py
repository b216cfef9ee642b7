"""Triton form of ``reference.exponential_noise``: the sampler's counter-based Exp(1) noise in
one launch, bit-identical to the torch reference (uint32 arithmetic wraps where the reference
masks), so a seeded request draws the same tokens on CPU and GPU from the same probabilities."""

import torch
import triton
import triton.language as tl

from chatgate_kernels.reference import NOISE_FLOOR, NOISE_GOLDEN, NOISE_MIX1, NOISE_MIX2

_BLOCK = 1024


@triton.jit
def _exponential_noise_kernel(
    keys_ptr, out_ptr, vocab, stride_out,
    GOLDEN: tl.constexpr, MIX1: tl.constexpr, MIX2: tl.constexpr, FLOOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    x = cols.to(tl.uint32) * tl.full([BLOCK], GOLDEN, tl.uint32) + key
    x = x ^ (x >> 16)
    x = x * tl.full([BLOCK], MIX1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([BLOCK], MIX2, tl.uint32)
    x = x ^ (x >> 15)
    u = ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    noise = tl.maximum(-tl.log(u), FLOOR)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, noise, mask=cols < vocab)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.empty(keys.shape[0], vocab, dtype=torch.float32, device=keys.device)
    if keys.shape[0]:
        grid = (keys.shape[0], triton.cdiv(vocab, _BLOCK))
        _exponential_noise_kernel[grid](
            keys.to(torch.int64).contiguous(), out, vocab, out.stride(0),
            GOLDEN=NOISE_GOLDEN, MIX1=NOISE_MIX1,
            MIX2=NOISE_MIX2, FLOOR=NOISE_FLOOR, BLOCK=_BLOCK,
        )
    return out
