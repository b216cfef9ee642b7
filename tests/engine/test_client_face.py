"""engine.client, the face a gateway process imports, stays free of torch, the kernels and
xgrammar; what it names in place of the engine's own tables agrees with them."""

import subprocess
import sys

import pytest

from engine import config, quantization
from engine.device import TORCH_DTYPES


@pytest.mark.parametrize("modules", ["engine.client", "engine", "engine.client, chatgate.app"])
def test_importing_the_client_face_imports_no_torch_kernels_or_xgrammar(modules: str) -> None:
    heavy = ("torch", "chatgate_kernels", "xgrammar")
    code = (f"import sys, {modules}\n"
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def test_the_configs_quantization_choices_are_the_engines() -> None:
    assert config.QUANTIZATION_CHOICES == quantization.CHOICES


def test_every_dtype_name_of_the_config_has_a_torch_dtype() -> None:
    assert set(config.DTYPES) == set(TORCH_DTYPES)
