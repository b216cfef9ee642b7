"""A model's recommended sampling values (its generation config), which the gateway gives a
request that leaves them unset (vLLM's ``--generation-config auto``).

Sources: a Hugging Face folder's ``generation_config.json``; a GGUF file's
``general.sampling.*`` metadata (what llama.cpp's converter writes from that same file). Only
the sampling values are taken, as vLLM takes them; ``do_sample`` is ignored, as vLLM ignores it.
"""

from __future__ import annotations

import json
import mmap
import struct
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
    metadata = gguf_scalars(path, set(_SAMPLING_KEYS.values()))
    config: dict[str, Any] = {}
    for name, key in _SAMPLING_KEYS.items():
        if key not in metadata:
            continue
        value = metadata[key]
        # a float32 in the file: take its shortest decimal (0.7, not 0.699999988)
        config[name] = (float(np.format_float_positional(np.float32(value)))
                        if isinstance(value, float) else value)
    return GenerationDefaults.from_config(config, str(path))


# GGUF value type -> struct format of a scalar of it (little-endian)
_SCALARS = {gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b",
            gguf.GGUFValueType.UINT16: "<H", gguf.GGUFValueType.INT16: "<h",
            gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
            gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.BOOL: "<?",
            gguf.GGUFValueType.UINT64: "<Q", gguf.GGUFValueType.INT64: "<q",
            gguf.GGUFValueType.FLOAT64: "<d"}


def gguf_scalars(path: Path, keys: set[str]) -> dict[str, int | float | bool]:
    """The scalar metadata values of ``keys`` in a GGUF file (v2/v3, little-endian), read
    from its header alone: ``gguf.GGUFReader`` parses every field and tensor, seconds for a
    vocabulary of 49k tokens."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, _tensors, num_kv = struct.unpack_from("<IIQQ", buf, 0)
        if magic != gguf.GGUF_MAGIC or version < 2:
            raise ValueError(f"{path} is not a GGUF v2/v3 file")
        offset = 24
        found: dict[str, int | float | bool] = {}
        for _ in range(num_kv):
            (n,) = struct.unpack_from("<Q", buf, offset)
            key = bytes(buf[offset + 8:offset + 8 + n]).decode()
            (kind,) = struct.unpack_from("<I", buf, offset + 8 + n)
            offset += 12 + n
            if kind in _SCALARS and key in keys:
                (found[key],) = struct.unpack_from(_SCALARS[kind], buf, offset)
            offset = _skip_value(buf, offset, kind)
        return found


def _skip_value(buf: mmap.mmap, offset: int, kind: int) -> int:
    """The offset just past a value of type ``kind`` stored at ``offset``."""
    if kind in _SCALARS:
        return offset + struct.calcsize(_SCALARS[kind])
    if kind == gguf.GGUFValueType.STRING:
        return offset + 8 + struct.unpack_from("<Q", buf, offset)[0]
    if kind != gguf.GGUFValueType.ARRAY:
        raise ValueError(f"unknown GGUF value type {kind}")
    item, count = struct.unpack_from("<IQ", buf, offset)
    offset += 12
    if item in _SCALARS:
        return offset + count * struct.calcsize(_SCALARS[item])
    for _ in range(count):
        offset = _skip_value(buf, offset, item)
    return offset
