"""Weight-only int8 on the CPU: the layer computes with its dequantized weight, the engine's
teacher-forced greedy choice stays float32's, and a mode the device cannot run is refused."""

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.quantization import Int8Linear, check_quantization


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
    chats = [[{"role": "user", "content": text}] for text in
             ("What is the capital of France?", "Write a haiku about the sea.",
              "Explain what a hash map is.", "List three prime numbers.")]
    exact = LLM("smollm2", max_model_len=512, num_kv_blocks=256)
    prompts = [exact.engine.render_chat(c) for c in chats]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    reference = [o.outputs[0].token_ids for o in exact.generate(prompts, greedy)]
    del exact

    quantized = LLM("smollm2", max_model_len=512, num_kv_blocks=256, quantization="int8")
    forced = [p + r[:t] for p, r in zip(prompts, reference, strict=True) for t in range(len(r))]
    outs = quantized.generate(forced, SamplingParams(temperature=0.0, max_tokens=1))
    chosen = [o.outputs[0].token_ids[0] for o in outs]
    expected = [token for r in reference for token in r]
    agreement = sum(a == b for a, b in zip(chosen, expected, strict=True)) / len(expected)
    assert agreement >= 0.9, agreement
