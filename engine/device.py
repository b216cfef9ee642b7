"""The torch device and dtype an ``EngineConfig`` means, resolved in the engine process (the
config itself is plain data that a torch-free gateway also reads)."""

import torch

from engine.config import EngineConfig

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def torch_device(config: EngineConfig) -> torch.device:
    """``config.device``, else CUDA when present, else the CPU."""
    if config.device is not None:
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def torch_dtype(config: EngineConfig) -> torch.dtype:
    """``config.dtype``, else bfloat16 on CUDA and float32 elsewhere."""
    if config.dtype is not None:
        return TORCH_DTYPES[config.dtype]
    return torch.bfloat16 if torch_device(config).type == "cuda" else torch.float32
