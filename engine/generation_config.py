"""A model's recommended sampling values (its generation config), which the gateway gives a
request that leaves them unset (vLLM's ``--generation-config auto``).

Sources: a Hugging Face folder's ``generation_config.json``; a GGUF file's
``general.sampling.*`` metadata (what llama.cpp's converter writes from that same file). Only
the sampling values are taken, as vLLM takes them; ``do_sample`` is ignored, as vLLM ignores it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import msgspec
import numpy as np

from engine.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"

# generation_config.json key -> GGUF metadata key
_SAMPLING_KEYS = {
    "temperature": gguf.Keys.General.SAMPLING_TEMP,
    "top_p": gguf.Keys.General.SAMPLING_TOP_P,
    "top_k": gguf.Keys.General.SAMPLING_TOP_K,
    "min_p": gguf.Keys.General.SAMPLING_MIN_P,
    "repetition_penalty": gguf.Keys.General.SAMPLING_PENALTY_REPEAT,
}


class GenerationDefaults(msgspec.Struct, frozen=True, omit_defaults=True):
    """Sampling values a model recommends; None: the model names none."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def values(self) -> dict[str, float | int]:
        """The values the model names, as ``SamplingParams`` keyword arguments."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str) -> GenerationDefaults:
        """The sampling values of a generation config (``generation_config.json``'s keys);
        ``ValueError`` naming ``source`` if ``SamplingParams`` would refuse one."""
        defaults = cls(**{k: config[k] for k in _SAMPLING_KEYS if config.get(k) is not None})
        try:
            SamplingParams(**defaults.values())
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        return defaults


def read_generation_config(folder: Path) -> GenerationDefaults:
    """The sampling values of ``folder/generation_config.json``; none without the file."""
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        return GenerationDefaults()
    return GenerationDefaults.from_config(json.loads(path.read_text()), str(path))


def write_generation_config(folder: Path, defaults: GenerationDefaults) -> None:
    (folder / GENERATION_CONFIG_FILE).write_text(json.dumps(defaults.values(), indent=2))


def read_gguf_sampling(path: Path) -> GenerationDefaults:
    """The sampling values in a GGUF file's ``general.sampling.*`` metadata (none if absent)."""
    reader = gguf.GGUFReader(str(path), "r")
    config: dict[str, Any] = {}
    for name, key in _SAMPLING_KEYS.items():
        field = reader.get_field(key)
        if field is None:
            continue
        value = field.contents()
        # a float32 in the file: take its shortest decimal (0.7, not 0.699999988)
        config[name] = (float(np.format_float_positional(np.float32(value)))
                        if isinstance(value, float) else value)
    return GenerationDefaults.from_config(config, str(path))
