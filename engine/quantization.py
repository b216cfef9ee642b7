"""Quantized linear layers (``--quantization``, vLLM's flag): weight-only int8 and int4 for
the CPU, FP8 products for the GPU.

A CPU decode step is a pass over the weights, so its time is their bytes: float32 reads 4
bytes per weight, ``int8`` 1, ``int4`` half of one. Activations go through torch's packed
kernels in bfloat16 (with float32 activations the same kernels are several times slower) and
the result comes back in the input's dtype. The float32 path stays the default of the engine:
greedy output equals transformers' only there.

- ``int8``: symmetric, one scale per output channel (``_weight_int8pack_mm``).
- ``int4``: asymmetric groups of 32 input weights, each with a scale and a minimum
  (``_weight_int4pack_mm_for_cpu``): the layout of GGUF's Q4_1 blocks. Quantizing Q4_1-derived
  weights by each group's min and max gives back the GGUF's own 4-bit codes, so the model
  computes with the very weights llama.cpp reads. The output layer (tied to the embedding,
  Q8_0 in the packaged GGUF) stays ``int8``: 4 bits there cost more accuracy than the rest.

Where the fused CPU kernels build with integer dot products (``chatgate_kernels/cpu_native.cpp``:
AVX512-VNNI or AVX2), both modes multiply through them instead: activations quantized to int8
per group of 32 (llama.cpp's Q8_1) against the same weights, in integer dot products, the weight
rows prefetched ahead. One kernel for every row count keeps a token's logits independent of how
many rows share its step.

For GPUs with FP8 tensor cores (compute capability 8.9 or later), ``fp8`` is vLLM's dynamic
FP8 scheme: weights as float8_e4m3fn with one scale per output row, activations quantized per
row (token) as they arrive (the device's kernels' ``fp8_per_token``), the product on the FP8 tensor
cores (``torch._scaled_mm``, float32 accumulation) at twice bfloat16's rate from half its
weight bytes. The output layer stays in the model's dtype, as in vLLM. The CPU runs the same
arithmetic through torch's reference FP8 product (slow: there it is for checks, and
``int8``/``int4`` are the fast modes).
"""

from __future__ import annotations

import torch

from chatgate_kernels import device_kernels, reference
from chatgate_kernels.cpu_native import native

INT4_GROUP = 32  # Q4_1's block size


def _fused_kernels(width: int):  # noqa: ANN202 - the compiled module or None
    """The fused CPU kernels' int8-activation products for inputs of ``width``, where they
    run as SIMD integer dot products (``chatgate_kernels/cpu_native.cpp``: AVX512-VNNI or
    AVX2); None elsewhere (torch's packed kernels)."""
    fused = native()
    return fused if fused is not None and fused.integer_dots and width % 64 == 0 else None


def _product_out(x: torch.Tensor, layer: Int8Linear | Int4Linear) -> torch.Tensor:
    """The fused kernels' output for ``layer(x)``: in ``x``'s dtype, or float32 when a bias
    is still to be added."""
    dtype = x.dtype if layer.bias is None else torch.float32
    return x.new_empty((x.shape[0], layer.codes.shape[0]), dtype=dtype)


def _biased(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``y + bias`` (added before any rounding to a 16-bit ``dtype``), in ``dtype``."""
    if bias is not None:
        y = y.float().add_(bias)
    return y.to(dtype)


class Int8Linear:
    """``F.linear(x, weight, bias)`` with ``weight`` as int8 rows and one scale per row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        w = weight.detach().to(torch.float32)
        # the scales as the kernel reads them (bfloat16), so rounding is half a step at most
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-30).to(torch.bfloat16)
        weight = torch.round(w / scales.to(torch.float32)[:, None]).clamp(-127, 127).to(
            torch.int8)
        self.scales = scales
        self.bias = bias
        self.fused = _fused_kernels(w.shape[1])
        if self.fused is not None:  # the fused kernel's form (only): unsigned codes w + 128
            self.codes = self.fused.int8_pack((weight.to(torch.int16) + 128).to(torch.uint8))
            self.row_scales = scales.to(torch.float32)
        else:
            self._weight = weight

    @property
    def weight(self) -> torch.Tensor:
        """The int8 rows (derived from the fused kernel's codes where it runs: the output layer
        is not held twice)."""
        if self.fused is None:
            return self._weight
        return (self.fused.int8_unpack(self.codes).to(torch.int16) - 128).to(torch.int8)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            y = self.fused.int8_linear(x, self.codes, self.row_scales, _product_out(x, self))
        else:
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales)
        return _biased(y, self.bias, x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with (for checks)."""
        return self.weight.to(torch.float32) * self.scales.to(torch.float32)[:, None]

    def fused_operands(self) -> tuple[torch.Tensor, torch.Tensor, None] | None:
        """``(codes, row scales, None)`` as the fused kernels' ``int8_linear`` takes them, or
        None where torch's kernel runs or a bias is added."""
        if self.fused is None or self.bias is not None:
            return None
        return self.codes, self.row_scales, None


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [n, k]`` as 4-bit ``codes [n, k]`` (int32, 0..15) in groups of
    :data:`INT4_GROUP` along ``k``, with each group's ``scale`` and ``minimum`` ``[n, k / 32]``
    (float32): ``w ≈ scale * code + minimum``, exactly Q4_1's rule."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 needs input widths divisible by {INT4_GROUP}, got {k}")
    groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp(min=1e-30)
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15)
    return codes.to(torch.int32).view(n, k), scale, low


class Int4Linear:
    """``F.linear(x, weight, bias)`` with ``weight`` as :func:`int4_groups`: half a byte per
    weight plus two 16-bit numbers per group, packed for the fused CPU kernels (Q4_1 blocks:
    float16 scale and minimum) or else for torch's kernel (bfloat16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        codes, scale, low = int4_groups(weight)
        self.bias = bias
        n, k = codes.shape
        self.fused = _fused_kernels(k)
        if self.fused is not None:  # Q4_1's float16 scale and minimum, in the kernel's layout
            self.codes, self.scale, self.minimum = self.fused.int4_pack(
                codes.to(torch.uint8), scale.to(torch.float16), low.to(torch.float16))
        else:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
            # the kernel's form: w = (code - 8) * scale + zero, [k / group, n, 2] in bfloat16
            self.scales_and_zeros = torch.stack([scale, low + 8.0 * scale], dim=-1).transpose(
                0, 1).contiguous().to(torch.bfloat16)

    def fused_operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(codes, scales, minimums)`` as the fused kernels' ``int4_linear`` takes them, or
        None where torch's kernel runs or a bias is added."""
        if self.fused is None or self.bias is not None:
            return None
        return self.codes, self.scale, self.minimum

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            y = self.fused.int4_linear(x, self.codes, self.scale, self.minimum,
                                       _product_out(x, self))
        else:
            y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed,
                                                  INT4_GROUP, self.scales_and_zeros)
        return _biased(y, self.bias, x.dtype)


class Fp8Linear:
    """``F.linear(x, weight, bias)`` as an FP8 product: ``weight`` as float8_e4m3fn rows with
    one float32 scale each, ``x`` quantized per row at every call; the output in bfloat16
    before the bias (added in float32), then ``x``'s dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        codes, scales = reference.fp8_per_token(weight.detach())
        self.weight = codes  # [out, in]; its transpose is the column-major operand
        self.scales = scales.view(1, -1)  # [1, out]
        self.bias = bias
        self.kernels = device_kernels(weight.device.type)  # quantizes the activations

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        codes, scales = self.kernels.fp8_per_token(x)
        y = torch._scaled_mm(codes, self.weight.t(), scale_a=scales, scale_b=self.scales,
                             out_dtype=torch.bfloat16)
        return _biased(y, self.bias, x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with (for checks)."""
        return self.weight.to(torch.float32) * self.scales.view(-1, 1)


QuantizedLinear = Int8Linear | Int4Linear | Fp8Linear
LAYERS: dict[str, type[QuantizedLinear]] = {"int8": Int8Linear, "int4": Int4Linear,
                                            "fp8": Fp8Linear}
QUANTIZATIONS = tuple(LAYERS)
CPU_QUANTIZATIONS = ("int8", "int4")
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores
# what ``--quantization`` also takes: "auto" (``chatgate serve``'s default) is int8 on the CPU
# and unquantized elsewhere; "none" is unquantized. int8 rather than int4: on everyday questions
# (benchmarks/everyday_questions.py, docs/benchmarks.md section 8) int4 loops at temperature 0
# on "What is the capital of France?", int8 answers it and more questions than float32
CHOICES = (*QUANTIZATIONS, "auto", "none")
AUTO_CPU = "int8"


def quantized_linear(quantization: str, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> QuantizedLinear:
    """The layer of ``quantization`` (one of :data:`QUANTIZATIONS`) computing with ``weight``."""
    return LAYERS[quantization](weight, bias)


def resolve_quantization(choice: str | None, device: torch.device) -> str | None:
    """The layers ``choice`` (one of :data:`CHOICES`, or None) means for ``device``: None for
    unquantized."""
    if choice == "auto":
        return AUTO_CPU if device.type == "cpu" else None
    return None if choice == "none" else choice


def check_quantization(quantization: str | None, device: torch.device) -> None:
    """``ValueError`` naming what is wrong with a ``--quantization`` for ``device``."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, "
                         f"got {quantization!r}")
    if quantization in CPU_QUANTIZATIONS and device.type != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on the CPU only "
                         f"(the device is {device.type}); on a GPU use 'fp8'")
    if quantization == "fp8" and device.type == "cuda" and (
            torch.cuda.get_device_capability(device) < FP8_CAPABILITY):
        raise ValueError("quantization 'fp8' needs a GPU of compute capability 8.9 or later "
                         "(FP8 tensor cores)")
