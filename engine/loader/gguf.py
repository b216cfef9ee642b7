"""GGUF files, converted through transformers once and cached on disk as safetensors (the
cache folder, the SmolLM2 GGUF and the tokenizer are ``engine.tokenizer``'s, torch-free)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from engine.generation_config import (
    GenerationDefaults,
    read_generation_config,
    read_gguf_sampling,
    write_generation_config,
)
from engine.loader.common import LoadedModel, check_model_type, finalize
from engine.loader.hf_folder import read_safetensors
from engine.tokenizer import (
    SMOLLM2_PACKAGE,
    cached_gguf_tokenizer,
    gguf_cache_dir,
    write_atomically,
)

logger = logging.getLogger("engine.loader")

# The packaged GGUF carries no sampling metadata (no ``general.sampling.*`` keys) and
# transformers' config for it no generation config. These are the values of the usage example
# on the model card (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct): they keep the 135M
# model nearer its most likely answer than vLLM's defaults (temperature 1, top_p 1) do.
SMOLLM2_GENERATION_DEFAULTS = GenerationDefaults(temperature=0.2, top_p=0.9)
WEIGHTS_FILE = "model.safetensors"


def convert_gguf(gguf: Path) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    """Dequantize a GGUF through transformers (float32, slow: ~20 s for SmolLM2-135M)."""
    logger.info("converting %s through transformers (first load; cached afterwards)", gguf)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32, local_files_only=True)
    config = hf.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the converted weights are plain float tensors
    return config, dict(hf.state_dict())


def save_weights(tmp: Path, config: PretrainedConfig, raw: dict[str, torch.Tensor],
                 defaults: GenerationDefaults) -> None:
    config.to_json_file(str(tmp / "config.json"))
    write_generation_config(tmp, defaults)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    unique = {k: v.contiguous() for k, v in raw.items() if not (tied and k == "lm_head.weight")}
    save_file(unique, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})


def load_gguf(name: str, gguf: Path, device: torch.device, dtype: torch.dtype,
               use_cache: bool) -> LoadedModel:
    tokenizer = cached_gguf_tokenizer(gguf, use_cache)
    weights = gguf_cache_dir(gguf) / "model"
    if use_cache and weights.is_dir():
        logger.info("weight cache hit: %s", weights)
        config = AutoConfig.from_pretrained(str(weights), local_files_only=True)
        raw = read_safetensors(weights)
        defaults = read_generation_config(weights)
    else:
        config, raw = convert_gguf(gguf)
        defaults = read_gguf_sampling(gguf)
        if use_cache:
            logger.info("writing the converted weights to %s", weights)
            write_atomically(weights, lambda tmp: save_weights(tmp, config, raw, defaults))
            logger.info("cached converted weights of %s in %s", gguf.name, weights)
    if not defaults.values() and gguf.parent.name == SMOLLM2_PACKAGE:
        defaults = SMOLLM2_GENERATION_DEFAULTS
    check_model_type(config, name)
    return LoadedModel(name=name, config=config,
                       state_dict=finalize(raw, config, device, dtype, name),
                       tokenizer=tokenizer, generation_defaults=defaults)
