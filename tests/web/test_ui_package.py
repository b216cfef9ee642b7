"""The UI ships inside the package: a wheel (non-editable install) carries every file of
``web/static`` as ``chatgate/static``, next to every module of the three packages and the
fused CPU kernels' C++ source; and no package of ours takes the name of another installed
distribution's module."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "web" / "static"
PACKAGES = ("chatgate", "engine", "chatgate_kernels")


def test_wheel_ships_the_ui(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    for folder in (*PACKAGES, "web/static"):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp_path / "dist")],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("chatgate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    ui = {f"chatgate/static/{p.relative_to(STATIC).as_posix()}"
          for p in STATIC.rglob("*") if p.is_file()}
    assert "chatgate/static/index.html" in ui
    assert any(n.endswith("/LICENSE") for n in ui)
    missing = sorted(ui - names)
    assert not missing, f"the wheel lacks UI files (package-data in pyproject.toml?): {missing}"
    modules = {p.relative_to(src).as_posix() for pkg in PACKAGES for p in (src / pkg).rglob("*.py")}
    # the fused CPU kernels are built from it at run time
    modules.add("chatgate_kernels/cpu_native.cpp")
    missing = sorted(modules - names)
    assert not missing, f"the wheel lacks modules (packages in pyproject.toml?): {missing}"


def test_no_package_shares_its_name_with_another_distributions_module() -> None:
    """transformers imports ``kernels``, a PyPI package it depends on: a package of ours by that
    name (run from a checkout, or installed over it) would be imported in its place."""
    owners = importlib.metadata.packages_distributions()
    clashes = {pkg: owners[pkg] for pkg in PACKAGES
               if set(owners.get(pkg, ["chatgate"])) != {"chatgate"}}
    assert not clashes, f"packages named like another distribution's module: {clashes}"
