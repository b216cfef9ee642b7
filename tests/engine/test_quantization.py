"""Weight-only int8 on the CPU: the layer computes with its dequantized weight, the engine's
teacher-forced greedy choice stays float32's, and a mode the device cannot run is refused."""

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.quantization import Int8Linear, check_quantization
from tests.engine.conftest import teacher_forced_agreement


def test_int8_linear_matches_its_dequantized_weight_and_keeps_the_input_dtype() -> None:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 64) * 0.05, torch.randn(96), torch.randn(5, 64)
    layer = Int8Linear(weight, bias)
    assert layer.weight.dtype == torch.int8 and layer.weight.abs().max() >= 126
    row_error = (layer.dequantized() - weight).abs().amax(dim=1)
    assert torch.all(row_error <= layer.scales.float() * 0.5 * (1 + 1e-6))  # half a step
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (5, 96)
    # activations and the result are rounded to bfloat16 on the way: a few parts in 1000
    expected = F.linear(x, layer.dequantized(), bias)
    assert torch.allclose(y, expected, rtol=2e-2, atol=2e-2)


def test_unknown_or_gpu_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="one of"):
        check_quantization("int3", torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("int8", torch.device("cuda"))
    check_quantization(None, torch.device("cuda"))


def test_int8_engine_picks_float32s_greedy_token_at_nearly_every_forced_position() -> None:
    quantized = LLM("smollm2", max_model_len=512, num_kv_blocks=256, quantization="int8")
    agreement = teacher_forced_agreement(quantized)
    assert agreement >= 0.9, agreement
