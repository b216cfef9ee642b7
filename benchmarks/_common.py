"""The benchmark harness: workloads (the ShareGPT-shaped synthetic length distribution),
statistics, and one run's outputs (``Run``: the tee'd log with a header naming the command and
the machine, tables, the raw JSON, plots), so each script is its workload and its comparison."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_OUT = ROOT / "benchmarks" / "out"  # ignored by git; docs cite copies in results/
STARTED = time.perf_counter()


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """``--out``, the folder a run writes to: ``$OUT`` when set, else ``DEFAULT_OUT``."""
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or DEFAULT_OUT),
                        help="folder for the run's log, JSON and plots (default: $OUT, else "
                             "benchmarks/out)")


def args_json(args: argparse.Namespace) -> dict[str, object]:
    """The run's arguments as JSON values: paths as strings."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def log(msg: str) -> None:
    """A progress line, stamped with the seconds since the benchmark started."""
    print(f"[{time.perf_counter() - STARTED:7.1f}s] {msg}", flush=True)


# -- lengths ------------------------------------------------------------------------------------

def lognormal_params(mean: float, sigma: float) -> tuple[float, float]:
    """(mu, sigma) of a log-normal with the given mean."""
    return math.log(mean) - sigma * sigma / 2, sigma


def sharegpt_lengths(n: int, seed: int, *, prompt_mean: float = 160.0, output_mean: float = 340.0,
                     prompt_sigma: float = 1.0, output_sigma: float = 0.9,
                     max_model_len: int = 2048, min_len: int = 4) -> list[tuple[int, int]]:
    """``n`` (prompt_len, output_len) pairs with ShareGPT's shape: log-normal, long right tails
    (means ≈ 160 and ≈ 340 tokens as in the vLLM paper's ShareGPT statistics), each pair capped
    so prompt + output ≤ ``max_model_len``. Deterministic for a seed."""
    rng = random.Random(seed)
    pmu, ps = lognormal_params(prompt_mean, prompt_sigma)
    omu, os_ = lognormal_params(output_mean, output_sigma)
    out = []
    for _ in range(n):
        p = max(min_len, min(int(rng.lognormvariate(pmu, ps)), max_model_len - min_len))
        o = max(min_len, min(int(rng.lognormvariate(omu, os_)), max_model_len - p))
        out.append((p, o))
    return out


def uniformish_lengths(n: int, seed: int, prompt_range: tuple[int, int],
                       output_range: tuple[int, int]) -> list[tuple[int, int]]:
    """ShareGPT-like lengths squeezed into ranges: log-uniform within each range (many short,
    a long tail), deterministic for a seed."""
    rng = random.Random(seed)

    def draw(lo: int, hi: int) -> int:
        return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))

    return [(draw(*prompt_range), draw(*output_range)) for _ in range(n)]


# -- statistics ---------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan when empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


# -- output -------------------------------------------------------------------------------------

class Tee:
    """Print to stdout and append the same lines to a raw-output file."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.fh = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.fh = path.open("w")

    def __call__(self, *parts: object) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        if self.fh is not None:
            self.fh.write(line + "\n")
            self.fh.flush()

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


class Run(Tee):
    """One benchmark run's outputs in ``out``: the log ``{stem}.txt`` (this object: call it to
    print and log a line), the raw ``{stem}.json`` and plots. ``stem`` is the benchmark's name,
    with ``_quick`` for a ``--quick`` run of a script that keeps its quick outputs apart."""

    def __init__(self, out: Path, name: str, *, quick: bool = False,
                 argv: list[str] | None = None) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.name = out, name
        self.suffix = "_quick" if quick else ""
        self.stem = f"{name}{self.suffix}"
        super().__init__(out / f"{self.stem}.txt")
        self(f"{name}:", " ".join(sys.argv[1:] if argv is None else argv))
        self(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; {machine_info()}")

    def section(self, title: str, rows: Sequence[Sequence[object]] | None = None,
                header: Sequence[str] = ()) -> None:
        """A blank line, ``## title``, then the table of ``rows`` when given."""
        self(f"\n## {title}")
        if rows is not None:
            self(table(rows, header))

    def write_json(self, raw: object, indent: int | None = None) -> Path:
        """The raw results as ``{stem}.json``."""
        path = self.out / f"{self.stem}.json"
        path.write_text(json.dumps(raw, indent=indent))
        return path

    def plot(self, filename: str, draw: Callable[..., None], *, ncols: int = 1,
             figsize: tuple[float, float] = (6.5, 4.2), dpi: int = 110) -> Path | None:
        """``save_figure`` into this run's folder."""
        return save_figure(self.out / filename, draw, ncols=ncols, figsize=figsize, dpi=dpi)


def open_log(out: Path, name: str, quick: bool, argv: list[str] | None) -> tuple[Tee, str]:
    """The run's raw-output log (a ``Run``) and its stem: ``name``, or ``name_quick`` for a
    ``--quick`` run."""
    run = Run(out, name, quick=quick, argv=argv)
    return run, run.stem


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """A plain fixed-width table (also valid inside a Markdown code block)."""
    cells = [[str(h) for h in header]] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def machine_info() -> str:
    import torch

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}",
             f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()})",
             f"torch threads {torch.get_num_threads()}"]
    try:
        import transformers

        parts.append(f"transformers {transformers.__version__}")
    except ImportError:  # pragma: no cover
        pass
    try:
        load = os.getloadavg()
        parts.append(f"load avg {load[0]:.1f}")
    except OSError:  # pragma: no cover
        pass
    return ", ".join(parts)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover
        pass
    return platform.processor() or platform.machine()


def plt():
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        print("matplotlib not installed: skipping plots (pip install matplotlib)", flush=True)
        return None
    return pyplot


def save_figure(path: Path, draw: Callable[..., None], *, ncols: int = 1,
                figsize: tuple[float, float] = (6.5, 4.2), dpi: int = 110) -> Path | None:
    """One figure of ``ncols`` axes, drawn by ``draw(*axes)``, saved to ``path`` with a legend
    on every axis that has labelled artists; None (nothing written) without matplotlib."""
    pyplot = plt()
    if pyplot is None:
        return None
    fig, axes = pyplot.subplots(1, ncols, figsize=figsize, squeeze=False)
    draw(*axes[0])
    for ax in axes[0]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot.close(fig)
    return path


# -- servers ------------------------------------------------------------------------------------

def free_port() -> int:
    """A loopback TCP port free at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ok(url: str, proc: subprocess.Popen | None, timeout: float,
                  log_path: Path | None = None, poll_s: float = 0.5):
    """Poll ``GET url`` until it answers 200 and return that response (an ``httpx.Response``).
    ``RuntimeError`` (with the tail of ``log_path``) when ``proc`` exits first or after
    ``timeout`` seconds."""
    import httpx

    def tail() -> str:
        return log_path.read_text(errors="replace")[-3000:] if log_path else ""

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{tail()}")
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200:
                return r
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s:\n{tail()}")


class Timer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0
