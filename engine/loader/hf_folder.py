"""A local Hugging Face folder: ``config.json`` + ``*.safetensors`` [+ tokenizer files]."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import AutoConfig

from engine.generation_config import read_generation_config
from engine.loader.common import LoadedModel, check_model_type, finalize
from engine.tokenizer import folder_tokenizer


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
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


def load_folder(name: str, folder: Path, device: torch.device,
                 dtype: torch.dtype) -> LoadedModel:
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    check_model_type(config, name)
    raw = read_safetensors(folder)
    return LoadedModel(name=name, config=config,
                       state_dict=finalize(raw, config, device, dtype, name),
                       tokenizer=folder_tokenizer(folder),
                       generation_defaults=read_generation_config(folder))
