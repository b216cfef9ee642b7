"""Weight-only quantized linear layers for the CPU (``--quantization``, vLLM's flag).

A CPU decode step is a pass over the weights, so its time is their bytes: float32 reads 4
bytes per weight, ``int8`` 1. Weights are quantized symmetrically per output channel (one
scale each); activations go through torch's packed int8 kernel in bfloat16 (with float32
activations the same kernel is several times slower), and the result comes back in the
input's dtype. The float32 path stays the default: greedy output equals transformers' only
there.
"""

from __future__ import annotations

import torch

QUANTIZATIONS = ("int8",)


class Int8Linear:
    """``F.linear(x, weight, bias)`` with ``weight`` as int8 rows and one scale per row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        w = weight.detach().to(torch.float32)
        # the scales as the kernel reads them (bfloat16), so rounding is half a step at most
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-30).to(torch.bfloat16)
        self.weight = torch.round(w / scales.to(torch.float32)[:, None]).clamp(-127, 127).to(
            torch.int8)
        self.scales = scales
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales)
        y = y.to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with (for checks)."""
        return self.weight.to(torch.float32) * self.scales.to(torch.float32)[:, None]


def check_quantization(quantization: str | None, device: torch.device) -> None:
    """``ValueError`` naming what is wrong with a ``--quantization`` for ``device``."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, "
                         f"got {quantization!r}")
    if device.type != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on the CPU only "
                         f"(the device is {device.type})")
