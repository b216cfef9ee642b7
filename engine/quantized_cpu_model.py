"""The quantized CPU model (``--quantization int8|int4`` with the fused CPU kernels built):
:class:`LlamaModel`'s layers with the fused kernels' norms and SiLU·mul, which write the
bfloat16 activations the quantized products read, and, where every product runs through the
fused kernels and the KV cache takes them, all decoder layers in one ``DecoderStack`` call per
step (``chatgate_kernels/cpu_native.cpp``): the same arithmetic, in the same order, as the
op-by-op layers, without a Python round trip per op.
"""

from types import ModuleType

import torch
from transformers import PretrainedConfig

from chatgate_kernels import NATIVE_CACHE_DTYPES, cpu_native
from engine.model import AttentionMetadata, LlamaModel
from engine.quantization import CPU_QUANTIZATIONS, resolve_quantization
from engine.tensor_parallel import TensorParallel


class QuantizedCpuModel(LlamaModel):
    """``native``: the compiled ``cpu_native`` module. ``decoder_stack``: the fused
    ``DecoderStack`` over every layer, or None where some product or the KV cache's dtype is
    not the fused kernels' (the op-by-op layers run). The KV cache is bfloat16 unless
    ``kv_cache_dtype`` says otherwise: the quantized products compute q, k and v in bfloat16,
    so a float32 cache would hold values only its rotated keys use the precision of, at twice
    the bytes a decode step's attention reads."""

    def __init__(self, native: ModuleType, config: PretrainedConfig,
                 weights: dict[str, torch.Tensor], max_positions: int, quantization: str,
                 vocab_limit: int | None = None,
                 kv_cache_dtype: torch.dtype | None = None) -> None:
        self.native = native
        super().__init__(config, weights, max_positions, vocab_limit=vocab_limit,
                         quantization=quantization,
                         kv_cache_dtype=kv_cache_dtype or torch.bfloat16)
        self.decoder_stack = self._decoder_stack()

    def _decoder_stack(self):  # noqa: ANN202 - the compiled DecoderStack or None
        if self.kv_cache_dtype not in NATIVE_CACHE_DTYPES:
            return None
        operands = []
        for layer, next_norm in zip(self.layers, self.next_norms, strict=True):
            products = [p.fused_operands() for p in (layer.qkv, layer.o, layer.gate_up,
                                                     layer.down)]
            if any(p is None for p in products):
                return None
            operands.append([t for p in products for t in p] + [layer.post_norm, next_norm])
        return self.native.DecoderStack(operands, self.num_heads, self.num_kv_heads,
                                        self.head_dim, self.eps, self.scale, self.dtype)

    def _input_norm(self, h: torch.Tensor) -> torch.Tensor:
        return super()._input_norm(h).to(torch.bfloat16)

    def _decoder_layers(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, meta: AttentionMetadata,
                        kv_cache: torch.Tensor) -> torch.Tensor:
        if self.decoder_stack is None:
            return super()._decoder_layers(x, h, cos, sin, meta, kv_cache)
        return self.decoder_stack.forward(x, h, cos, sin, kv_cache, meta.slot_mapping,
                                          meta.block_tables, meta.seq_lens,
                                          meta.query_start_loc)

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  final: bool) -> torch.Tensor:
        """The next linear layer's input in bfloat16; with ``final``, the hidden states in the
        model's dtype."""
        out = torch.empty(residual.shape, dtype=self.dtype if final else torch.bfloat16)
        return self.native.add_rms_norm(x, residual, weight, self.eps, out)

    def _silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        return self.native.silu_and_mul(gate_up, out)


def build_model(config: PretrainedConfig, weights: dict[str, torch.Tensor], max_positions: int,
                vocab_limit: int | None = None, quantization: str | None = None,
                tp: TensorParallel | None = None,
                kv_cache_dtype: torch.dtype | None = None) -> LlamaModel:
    """The model of these weights: :class:`QuantizedCpuModel` for a CPU quantization on one
    rank where the fused CPU kernels build, else :class:`LlamaModel` (same arguments)."""
    device = weights["model.embed_tokens.weight"].device
    quantization = resolve_quantization(quantization, device)
    native = (cpu_native.native() if quantization in CPU_QUANTIZATIONS and tp is None
              else None)
    if native is not None:
        return QuantizedCpuModel(native, config, weights, max_positions, quantization,
                                 vocab_limit=vocab_limit, kv_cache_dtype=kv_cache_dtype)
    return LlamaModel(config, weights, max_positions, vocab_limit=vocab_limit,
                      quantization=quantization, tp=tp, kv_cache_dtype=kv_cache_dtype)
