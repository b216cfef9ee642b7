"""What every model source produces: a :class:`LoadedModel` whose weights were checked against
its config (:func:`finalize`), and the transformers model sharing them (:func:`build_hf_model`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from accelerate import init_empty_weights
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from engine.generation_config import GenerationDefaults
from engine.tensor_parallel import Shard
from engine.tokenizer import DEFAULT_MODEL, ModelPackageMissingError

__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelPackageMissingError", "build_hf_model",
           "check_model_type", "expected_shapes", "finalize"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class LoadedModel:
    """Weights, config and tokenizer of one model; see the module docstring for invariants."""

    name: str
    config: PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase | None
    # set when a dummy model borrows a tokenizer with fewer tokens than its vocabulary: only
    # ids below it may be sampled (the rest have no text)
    vocab_limit: int | None = None
    # the sampling values the model recommends (its generation config)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    # set when ``state_dict`` holds only one tensor-parallel rank's share of the weights
    shard: Shard | None = None


def build_hf_model(loaded: LoadedModel) -> PreTrainedModel:
    """The transformers model for ``loaded.config`` whose parameters *share storage* with
    ``loaded.state_dict`` (no copy); eval mode, no grad, same device/dtype. Test oracle."""
    embed = loaded.state_dict["model.embed_tokens.weight"]
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(loaded.config), dtype=embed.dtype)
    model.load_state_dict(loaded.state_dict, strict=True, assign=True)
    model.to(embed.device)  # moves only the (non-persistent) buffers, e.g. rotary inv_freq
    model.requires_grad_(False)
    return model.eval()


def check_model_type(config: PretrainedConfig, model: str) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model={model!r} has model_type {config.model_type!r}; the engine runs "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")


def expected_shapes(config: PretrainedConfig) -> dict[str, torch.Size]:
    """Parameter names and shapes of the transformers model, from a meta-device build."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return {name: t.shape for name, t in model.state_dict().items()}


def finalize(raw: dict[str, torch.Tensor], config: PretrainedConfig, device: torch.device,
              dtype: torch.dtype, model: str,
              shard: Shard | None = None) -> dict[str, torch.Tensor]:
    """Validate names/shapes against ``config`` (``shard``'s share of each, when ``raw`` holds
    one rank's), move to device/dtype and tie ``lm_head``."""
    expected = expected_shapes(config)
    if shard is not None:
        expected = {k: shard.tensor(k, torch.empty(v, device="meta"), config).shape
                    for k, v in expected.items()}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    wanted = [k for k in expected if not (tied and k == "lm_head.weight")]
    missing = [k for k in wanted if k not in raw]
    wrong = [f"{k}: {tuple(raw[k].shape)} != {tuple(expected[k])}"
             for k in wanted if k in raw and raw[k].shape != expected[k]]
    if missing or wrong:
        raise ValueError(f"model={model!r}: weights do not match its config "
                         f"(missing {missing[:5]}, wrong shapes {wrong[:5]})")
    out: dict[str, torch.Tensor] = {}
    for k in tqdm(wanted, desc=f"Moving weights to {device}", unit="tensor", leave=True):
        out[k] = raw[k].to(device=device, dtype=dtype).contiguous()
    if tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return {k: out[k] for k in expected}
