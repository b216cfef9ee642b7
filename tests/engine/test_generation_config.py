"""engine.generation_config: a model's recommended sampling values, read from a Hugging Face
folder's generation_config.json or a GGUF's ``general.sampling.*`` metadata; the bundled
SmolLM2, whose GGUF carries none, gets its model card's values."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch

from engine.generation_config import (
    GenerationDefaults,
    gguf_scalars,
    read_generation_config,
    read_gguf_sampling,
    write_generation_config,
)
from engine.loader import LoadedModel, build_hf_model, load_model, smollm2_gguf_path

CPU = torch.device("cpu")


def test_bundled_smollm2_gguf_has_no_sampling_metadata_and_gets_its_model_cards_values(
        smollm2: LoadedModel) -> None:
    assert read_gguf_sampling(smollm2_gguf_path()) == GenerationDefaults()
    assert smollm2.generation_defaults == GenerationDefaults(temperature=0.2, top_p=0.9)


def test_header_scan_reads_the_scalars_gguf_reader_reads() -> None:
    """Keys before and after the tokenizer's 49k-string arrays, which the scan skips."""
    path = smollm2_gguf_path()
    reader = gguf.GGUFReader(str(path), "r")
    keys = {"llama.context_length", "llama.rope.freq_base", "tokenizer.ggml.add_bos_token",
            "tokenizer.ggml.eos_token_id", "general.quantization_version"}
    assert gguf_scalars(path, keys) == {k: reader.get_field(k).contents() for k in keys}


def test_gguf_sampling_metadata_gives_the_sampling_values(tmp_path: Path) -> None:
    path = tmp_path / "sampling.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_sampling_temp(0.7)
    writer.add_sampling_top_p(0.95)
    writer.add_sampling_top_k(40)
    writer.add_sampling_min_p(0.05)
    writer.add_sampling_penalty_repeat(1.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_gguf_sampling(path) == GenerationDefaults(
        temperature=0.7, top_p=0.95, top_k=40, min_p=0.05, repetition_penalty=1.1)


def test_hf_folder_generation_config_gives_its_sampling_values_only(
        tmp_path: Path, tiny_model: str) -> None:
    loaded = load_model(tiny_model, CPU, torch.float32)
    folder = tmp_path / "hf"
    build_hf_model(loaded).save_pretrained(str(folder))
    assert loaded.tokenizer is not None
    loaded.tokenizer.save_pretrained(str(folder))
    # what transformers writes (token ids, no sampling values): nothing to apply
    assert load_model(str(folder), CPU, torch.float32).generation_defaults == GenerationDefaults()
    (folder / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
        "max_new_tokens": 100, "eos_token_id": 2}))
    assert load_model(str(folder), CPU, torch.float32).generation_defaults == \
        GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20)


def test_a_value_sampling_would_refuse_fails_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match=r"generation_config\.json: top_p must be in \(0, 1\]"):
        read_generation_config(tmp_path)


def test_written_values_read_back_and_a_folder_without_the_file_has_none(
        tmp_path: Path) -> None:
    assert read_generation_config(tmp_path) == GenerationDefaults()
    defaults = GenerationDefaults(temperature=0.7, top_k=40)
    write_generation_config(tmp_path, defaults)
    assert read_generation_config(tmp_path) == defaults
