"""The fused CPU kernels of ``cpu_native.cpp``, compiled for this CPU at first use.

Building needs a C++ compiler and ninja (``torch.utils.cpp_extension``); the build is cached
under ``~/.cache/torch_extensions`` (or ``$TORCH_EXTENSIONS_DIR``), so only the first engine on a
machine waits for it (about half a minute on two cores). Without a compiler, or with
``CHATGATE_CPU_KERNELS=0``, :func:`native` is None and the CPU runs ``chatgate_kernels.reference``.
Processes that build or load it at once take turns on an ``flock``, which the system drops
when its holder dies: a build killed half-way (Ctrl-C at a first start) leaves torch's own lock
file behind, which would make every later load wait for it forever; under the flock that file
can only be such a leftover, and is removed.
"""

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("chatgate_kernels.cpu_native")

SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
DISABLE = "CHATGATE_CPU_KERNELS"


def _cpu_key() -> str:
    """A short hash of this CPU's features: a build for another CPU (``-march=native``) is
    never loaded here."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def _name() -> str:
    """The extension's name: one build per CPU."""
    return f"chatgate_cpu_{_cpu_key()}"


def build_directory() -> Path:
    """Where torch builds and caches the extension (made if missing)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(_name(), verbose=False))


@functools.cache
def native() -> ModuleType | None:
    """The compiled module, or None when it is disabled or cannot be built (logged once)."""
    if os.environ.get(DISABLE, "1") == "0":
        return None
    from torch.utils import cpp_extension

    try:
        build = build_directory()
        with _one_builder(build):
            cached = _built(build)
            if not cached:
                logger.info("compiling the fused CPU kernels for this CPU (once per machine: "
                            "~30 s)")
            started = time.monotonic()
            module = cpp_extension.load(name=_name(), sources=[str(SOURCE)],
                                        extra_cflags=FLAGS, extra_ldflags=["-fopenmp"])
            logger.log(logging.DEBUG if cached else logging.INFO, "fused CPU kernels %s in %.1f s",
                       f"loaded from {build}" if cached else "built", time.monotonic() - started)
            return module
    except (OSError, RuntimeError, ImportError) as e:  # no compiler, no ninja, a failed build
        logger.warning("fused CPU kernels unavailable, using the torch reference: %s",
                       str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None


def _built(build: Path) -> bool:
    """Whether the build folder ``build`` holds a library built from this source file (its
    path in torch's ``build.ninja``, the library newer than it): torch then only loads it."""
    library, ninja = build / f"{_name()}.so", build / "build.ninja"
    return (library.is_file() and ninja.is_file() and str(SOURCE) in ninja.read_text()
            and library.stat().st_mtime >= SOURCE.stat().st_mtime)


@contextlib.contextmanager
def _one_builder(build: Path) -> Iterator[None]:
    """Hold the flock of the build folder ``build``, with torch's lock file there removed (see
    the module docstring)."""
    with open(build / "chatgate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)  # torch's, left by a killed build
        yield
