"""Weight-only int8 and int4 on the CPU: each layer computes with its dequantized weight, int4
recovers the GGUF's own Q4_1 codes, the engine's teacher-forced greedy choice stays float32's,
and a mode the device cannot run is refused. The FP8 product (made for GPUs with FP8 tensor
cores) computes with its quantized activations and weight; torch runs it on the CPU too, so
the layer and the engine's greedy choice are checked here as well
(``benchmarks/gpu_kernels_check.py`` checks the layer on the GPU)."""

import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGUFReader
from gguf.quants import dequantize

from chatgate_kernels import reference
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.quantization import (
    INT4_GROUP,
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    check_quantization,
    int4_groups,
    resolve_quantization,
)
from engine.runner_factory import build_runner, load_for_rank
from engine.tokenizer import smollm2_gguf_path
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


def test_int4_linear_matches_its_group_dequantized_weight() -> None:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 64) * 0.05, torch.randn(96), torch.randn(5, 64)
    codes, scale, low = int4_groups(weight)
    assert codes.min() == 0 and codes.max() == 15
    groups = codes.view(96, -1, INT4_GROUP).float()
    dequantized = (groups * scale[..., None] + low[..., None]).view(96, 64)
    assert torch.all((dequantized - weight).abs().view(96, -1, INT4_GROUP).amax(-1)
                     <= scale * 0.5 * (1 + 1e-5))  # half a step per group
    y = Int4Linear(weight, bias)(x)
    assert y.dtype == torch.float32 and y.shape == (5, 96)
    # bfloat16 activations, scales and result: a few parts in 1000
    assert torch.allclose(y, F.linear(x, dequantized, bias), rtol=2e-2, atol=2e-2)


def test_int4_recovers_the_packaged_ggufs_q4_1_codes() -> None:
    """Q4_1 stores 32 weights as a scale ``d``, a minimum ``m`` and 4-bit codes; int4's groups
    of the dequantized weights give back exactly those codes."""
    reader = GGUFReader(smollm2_gguf_path())
    tensor = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    assert tensor.tensor_type.name == "Q4_1"
    rows = tensor.data.shape[0]
    blocks = np.asarray(tensor.data).reshape(rows, -1, 20)  # d, m (float16), 16 code bytes
    packed = blocks[..., 4:]
    gguf_codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type))
    codes, _, _ = int4_groups(weight)
    assert torch.equal(codes, torch.from_numpy(gguf_codes.astype(np.int32)))


def test_auto_quantization_is_int8_on_the_cpu() -> None:
    """``auto`` is int8 on the CPU (docs/benchmarks.md section 8: int4 loops on everyday
    questions at temperature 0), unquantized elsewhere; the explicit modes stay available."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("auto", cpu) == "int8"
    assert resolve_quantization("auto", cuda) is None
    assert resolve_quantization("none", cpu) is None
    assert resolve_quantization(None, cpu) is None
    assert resolve_quantization("int4", cpu) == "int4"
    assert resolve_quantization("int8", cpu) == "int8"


def test_fp8_linear_multiplies_per_row_fp8_activations_by_its_fp8_rows() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64) * 0.05, torch.randn(96)
    x = torch.randn(5, 64) * torch.tensor([[1e-3], [1.0], [30.0], [1.0], [0.0]])
    layer = Fp8Linear(weight, bias)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.scales.shape == (1, 96)
    # each row's largest weight is the largest FP8 value times its scale
    assert torch.equal(layer.weight.float().abs().amax(dim=1), torch.full((96,), 448.0))
    # e4m3 keeps 3 mantissa bits: every weight within half a step (1/16 relative) of its code
    assert torch.all((layer.dequantized() - weight).abs() <= weight.abs() / 16 + 1e-9)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (5, 96)
    codes, scales = reference.fp8_per_token(x)
    assert torch.equal(scales[4], torch.tensor([1e-12 / 448.0]))  # an all-zero row stays zeros
    expected = F.linear(codes.float() * scales, layer.dequantized(), bias)
    assert torch.allclose(y, expected, rtol=1e-2, atol=1e-2)  # the product rounded to bf16
    assert torch.allclose(y[4], bias)


@pytest.mark.parametrize("own_weights", [True, False])
def test_a_runner_that_owns_the_weights_frees_the_float_layers_it_quantized(
        own_weights: bool) -> None:
    """Before the runner sizes its KV pool from the free memory, the float weights of the
    quantized layers are gone, unless the caller keeps the loaded model (a benchmark's
    transformers check shares them)."""
    config = EngineConfig(model="smollm2", max_model_len=256, num_kv_blocks=16,
                          quantization="int8")
    loaded = load_for_rank(config)
    down = weakref.ref(loaded.state_dict["model.layers.0.mlp.down_proj.weight"])
    runner = build_runner(config, loaded=loaded, own_weights=own_weights)
    assert isinstance(runner.model.layers[0].down, Int8Linear)
    assert (down() is None) == own_weights
    assert (loaded.state_dict == {}) == own_weights


def test_unknown_or_misplaced_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="one of"):
        check_quantization("int3", torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("int8", torch.device("cuda"))
    check_quantization(None, torch.device("cuda"))


@pytest.mark.parametrize("layer_type", [Int8Linear, Int4Linear])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(layer_type) -> None:
    """With the fused CPU kernels, each row's output is the same alone, in a tile of four and in
    a ragged batch: a token's logits do not change with how many rows share its step (seeded
    sampling repeats)."""
    torch.manual_seed(0)
    layer = layer_type(torch.randn(192, 128) * 0.05)
    if layer.fused is None:  # torch's packed int4 kernel blocks rows differently by count
        pytest.skip("the fused CPU kernels do not run here (no compiler, no AVX512-VNNI/AVX2)")
    x = torch.randn(11, 128)
    together = layer(x)
    for r in range(11):
        assert torch.equal(layer(x[r:r + 1])[0], together[r])
        assert torch.equal(layer(x[r:])[0], together[r])


# the least share of float32's greedy tokens each mode keeps: int8 and int4 keep ~95 % on
# SmolLM2 and FP8 (3 mantissa bits for every activation too) ~90 % (benchmarks/quantization.py,
# 1,024 positions); over these 56 positions a machine's float32 summation order moves FP8's
# share by a token or two, so its bar sits below its mean. An FP8 product that drops its weight
# scales keeps none.
AGREEMENT_FLOOR = {"int8": 0.9, "int4": 0.9, "fp8": 0.85}


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_quantized_engine_picks_float32s_greedy_token_at_nearly_every_forced_position(
        quantization: str) -> None:
    quantized = LLM("smollm2", max_model_len=512, num_kv_blocks=256, quantization=quantization)
    agreement = teacher_forced_agreement(quantized)
    assert agreement >= AGREEMENT_FLOOR[quantization], agreement


def test_the_fused_decoder_stack_computes_the_op_by_op_layers_bit_for_bit() -> None:
    """The quantized CPU path runs all decoder layers in one fused call per step; its tokens and
    their log-probabilities (prefill, decode and mixed steps) equal the op-by-op layers'."""
    llm = LLM("smollm2", max_model_len=512, num_kv_blocks=256, quantization="int4")
    model = llm.engine.runner.model
    if model.decoder_stack is None:
        pytest.skip("the fused CPU kernels do not run here (no compiler, no AVX512-VNNI/AVX2)")
    chats = [[{"role": "user", "content": text}] for text in
             ("Write a poem about the sea.", "What is 17 * 23?", "Hi!", "Name three colours.")]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)

    def run() -> list[tuple[list[int], list[float]]]:
        outputs = [o.outputs[0] for o in llm.chat(chats, params)]
        return [(o.token_ids, [p.logprob for p in o.logprobs]) for o in outputs]

    fused = run()
    stack, model.decoder_stack = model.decoder_stack, None
    try:
        assert run() == fused
    finally:
        model.decoder_stack = stack
