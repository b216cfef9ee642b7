"""Decode step at batch 256 against its roofline under four conditions: a fresh engine whose KV
cache is all zeros, the same cache filled with random values, after 20 s of back-to-back decode
steps, and after 15 s idle again; each with the GPU's SM clock, power draw and throttle reasons
(nvidia-smi).

It explains why the figure of ``gpu_e2e.py`` (measured after its throughput run, over real K/V)
moves between runs: at 256 rows the GEMMs are compute-bound and draw the board to its power cap,
which lowers the SM clock; memory bandwidth, and so the roofline, does not move with it.

    PYTHONUNBUFFERED=1 TQDM_DISABLE=1 python benchmarks/decode_power.py   # CUDA only, ~1 min
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_e2e import copy_bandwidth, decode_step_roofline  # noqa: E402
from engine import LLM  # noqa: E402
from engine.loader import load_model  # noqa: E402

STARTED = time.perf_counter()
SMI_FIELDS = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active"


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f}s] {msg}", flush=True)


def gpu_state() -> str:
    """SM clock, memory clock, temperature, power and throttle-reason bits (0x4: power cap)."""
    return subprocess.run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()


def plot(rows: list[dict], path: Path) -> None:
    """Fraction of roofline per condition and context, each condition labelled with its SM
    clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conditions = list(dict.fromkeys(r["condition"] for r in rows))
    contexts = sorted({r["ctx"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(contexts)
    for j, ctx in enumerate(contexts):
        fractions = [next(r["fraction"] for r in rows if r["condition"] == c and r["ctx"] == ctx)
                     for c in conditions]
        ax.bar([i + (j - (len(contexts) - 1) / 2) * width for i in range(len(conditions))],
               fractions, width=width, label=f"ctx {ctx}")
    clocks = [next(r["gpu"].split(",")[0] for r in rows if r["condition"] == c)
              for c in conditions]
    ax.set_xticks(range(len(conditions)),
                  [f"{c}\nSM {mhz.strip()}" for c, mhz in zip(conditions, clocks, strict=True)],
                  fontsize=8)
    ax.axhline(0.7, color="k", ls="--", lw=0.8)
    ax.set_ylabel("roofline time / measured time")
    ax.set_title("Decode step, batch 256: the SM clock under the power cap")
    ax.set_ylim(0, 1.1)
    ax.legend(ncol=len(contexts), loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--sustain-s", type=float, default=20.0)
    ap.add_argument("--idle-s", type=float, default=15.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_power.py needs a CUDA GPU (it replays the engine's decode graphs)")
    device = torch.device("cuda")
    loaded = load_model(args.model, device, torch.bfloat16, seed=0, use_cache=False)
    llm = LLM(model=args.model, device="cuda", dtype="bfloat16", max_num_seqs=args.batch,
              max_num_batched_tokens=8192, max_model_len=max(2048, max(args.ctx)),
              enable_prefix_caching=False, loaded=loaded)
    runner = llm.engine.runner
    copy_bw = copy_bandwidth(device)
    rows: list[dict] = []

    def measure(condition: str) -> None:
        for ctx in args.ctx:
            r = decode_step_roofline(llm, args.batch, ctx, copy_bw, device)
            rows.append({"condition": condition, "gpu": gpu_state(), **r})
            log(f"{condition}, ctx {ctx}: {r['step_s'] * 1e3:.2f} ms = {r['fraction']:.1%} of "
                f"roofline | {rows[-1]['gpu']}")

    log(f"idle | {gpu_state()}")
    measure("fresh, KV zeros")
    with torch.inference_mode():
        runner.kv_cache.normal_()
    measure("fresh, KV random")
    graph = runner.graphs[args.batch][0]
    steps, end = 0, time.perf_counter() + args.sustain_s
    while time.perf_counter() < end:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        steps += 20
    log(f"{steps} back-to-back decode steps in {args.sustain_s:.0f} s | {gpu_state()}")
    measure(f"after {args.sustain_s:.0f} s of decode steps")
    time.sleep(args.idle_s)
    measure(f"then {args.idle_s:.0f} s idle")

    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode_power.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "copy_bw_Bps": copy_bw, "rows": rows},
        indent=1))
    plot(rows, out_dir / "decode_power.png")
    print(f"\n{torch.cuda.get_device_name()}; copy bandwidth {copy_bw / 1e9:.0f} GB/s; "
          f"batch {args.batch}; GPU state = SM MHz, memory MHz, °C, W, throttle reasons")
    for r in rows:
        print(f"{r['condition']:30s} ctx {r['ctx']:5d} {r['step_s'] * 1e3:7.2f} ms "
              f"{r['fraction']:6.1%}  {r['gpu']}")


if __name__ == "__main__":
    main()
