"""``gpu_e2e.py``'s final table and figure, from the result it writes to ``gpu_e2e.json``:
set-up, correctness, offline throughput against its floors and transformers, then the decode
steps against their roofline and the steady decode step against its graph replay."""

from __future__ import annotations

import argparse

import numpy as np


def print_summary(args: argparse.Namespace, result: dict, corr: dict, copy_bw: float) -> None:
    """The table, last: set-up, correctness and throughput."""
    info, et = result["info"], result["engine_throughput"]
    print()
    print(f"{info['device']}; torch {info['torch']}, triton {info['triton']}, transformers "
          f"{info['transformers']}; {args.model} {args.dtype}; copy bw {copy_bw / 1e9:.0f} GB/s")
    engine = result["engine"]
    print(f"KV pool {engine['num_kv_blocks']} blocks ({engine['kv_cache_gib']:.1f} GiB); "
          f"engine init {engine['init_s']:.1f}s")
    for name, c in corr.items():
        diverged = [r for r in c["rows"] if not r["equal"]]
        extra = "".join(f"; p{r['prompt']}@{r['first_divergence']} margin "
                        f"{r['margin_at_divergence']:.3f} gap {r['hf_top2_gap_at_divergence']:.3f}"
                        for r in diverged)
        # a quantized run's engine (not its float32 check) computes with FP8 products
        engine = (f"{name}, {args.quantization} products"
                  if args.quantization and name == args.dtype else name)
        print(f"correctness ({engine}): {c['num_equal']}/{c['num_prompts']} prompts x "
              f"{c['num_tokens']} tokens equal{extra}")
        print(f"  transformers {name} as one left-padded batch vs one prompt at a time: "
              f"{c['hf_batched_num_equal']}/{c['num_prompts']} equal")
        for who, a in c.get("fp32_reference", {}).items():
            print(f"  {who} {engine if who == 'engine' else name} greedy path vs float32 of the "
                  f"same weights: fp32 argmax at "
                  f"{a['fp32_argmax']}/{a['steps']} steps, largest fp32 deficit "
                  f"{a['max_deficit']:.4f}, mean {a['mean_deficit']:.5f}")
    print(f"{'':28}{'tok/s':>10}{'seconds':>10}")
    mode = "overlapped" if result["async_scheduling"] else "synchronous"
    print(f"{'engine (' + mode + ')':28}{et['output_tokens_per_s']:>10.0f}{et['seconds']:>10.1f}")
    other = result.get("engine_throughput_other_mode")
    if other:
        mode = "synchronous" if result["async_scheduling"] else "overlapped"
        print(f"{'engine (' + mode + ')':28}{other['output_tokens_per_s']:>10.0f}"
              f"{other['seconds']:>10.1f}")
    if "floor" in result:
        fl = result["floor"]
        print(f"{'floor of the same steps':28}{fl['output_tokens_per_s']:>10.0f}"
              f"{fl['floor_s']:>10.1f}  (matmul {fl['matmul_flops'] / 1e12:.0f} TFLOP/s"
              f"{' FP8' if args.quantization == 'fp8' else ''}, copy "
              f"{copy_bw / 1e9:.0f} GB/s) -> engine at {fl['fraction']:.0%} of it")
        print(f"{'serial floor, same steps':28}"
              f"{et['output_tokens'] / fl['serial_s']:>10.0f}{fl['serial_s']:>10.1f}  (GEMMs, "
              f"then attention's KV reads) -> engine at {fl['serial_fraction']:.0%} of it")
        print(f"{'overlap floor, same steps':28}"
              f"{et['output_tokens'] / fl['overlap_s']:>10.0f}{fl['overlap_s']:>10.1f}  (as much "
              f"beside attention as dependencies allow) -> engine at "
              f"{fl['overlap_fraction']:.0%} of it; the floor is "
              f"{fl['floor_s'] / fl['overlap_s']:.0%} of it")
    hft = result.get("hf_throughput")
    if hft:
        print(f"{'transformers (b=' + str(hft['batch_size']) + ')':28}"
              f"{hft['output_tokens_per_s']:>10.0f}{hft['seconds_all']:>10.1f}  ({hft['how']})")
        print(f"throughput ratio engine / transformers: {result['ratio']:.1f}x")


def print_steps(args: argparse.Namespace, result: dict) -> None:
    """The table, last: decode steps against their roofline, graph and eager time, the
    profile, the steady decode step against its graph alone."""
    et = result["engine_throughput"]
    other = result.get("engine_throughput_other_mode")
    for r in result["decode_step"]:
        if "skipped" in r:
            print(f"decode step: skipped ({r['skipped']})")
            continue
        gb = (r["weight_bytes"] + r["kv_bytes"]) / 1e9
        print(f"decode step batch {r['batch']} ctx {r['ctx']}: {r['step_s'] * 1e3:.2f} ms, "
              f"roofline {r['roofline_s'] * 1e3:.2f} ms ({gb:.1f} GB) -> {r['fraction']:.0%} "
              f"of roofline")
        if "serial_s" in r:
            floor = max(r["flop_s"], r["roofline_s"])
            print(f"  FLOP floor {r['flop_s'] * 1e3:.2f} ms: step / max(FLOPs, bytes) "
                  f"{r['step_s'] / floor:.2f}x (target <= 1.15x); serial floor "
                  f"{r['serial_s'] * 1e3:.2f} ms: step / serial {r['step_s'] / r['serial_s']:.2f}x")
            print(f"  overlap floor {r['overlap_s'] * 1e3:.2f} ms = "
                  f"{r['overlap_s'] / floor:.2f}x max(FLOPs, bytes): step / overlap floor "
                  f"{r['step_s'] / r['overlap_s']:.2f}x")
    print(f"engine time in CUDA-graph decode steps {et['graph_steps_seconds']:.1f}s "
          f"({et['graph_steps']} steps), in eager (prefill/mixed) steps "
          f"{et['eager_steps_seconds']:.1f}s ({et['eager_steps']} steps)")
    if "profile" in result:
        pr = result["profile"]
        print(f"decode batch {args.decode_batch} ctx {pr['ctx']}: graph {pr['graph_s'] * 1e3:.2f}"
              f" ms vs eager {pr['eager_s'] * 1e3:.2f} ms; prefill forward of "
              f"{pr['prefill_tokens']} tokens {pr['prefill_s'] * 1e3:.1f} ms = "
              f"{pr['prefill_tflops']:.0f} TFLOP/s")
    graph = result.get("full_step_graph", {})
    for mode, run in (("", et), (" (other mode)", other)):
        if not run or not run["full_decode_step_median_s"]:
            continue
        step = run["full_decode_step_median_s"]
        print(f"steady decode step{mode}, host included: median {step * 1e3:.2f} ms over "
              f"{run['full_decode_steps']} steps (median {run['full_decode_step_median_rows']} "
              f"rows, context {run['full_decode_step_median_ctx']})")
        in_situ = run.get("full_decode_graph_median_s")
        if in_situ:
            print(f"  its CUDA graph replays, timed on the device in the same steps: "
                  f"{in_situ * 1e3:.2f} ms -> host-visible {(step - in_situ) * 1e3:.2f} ms, "
                  f"step / graph {step / in_situ:.3f}")
        if "step_s" in graph:
            print(f"  CUDA graph replayed alone afterwards ({graph['batch']} rows, context "
                  f"{graph['ctx']}): {graph['step_s'] * 1e3:.2f} ms -> host-visible "
                  f"{(step - graph['step_s']) * 1e3:.2f} ms, step / graph "
                  f"{step / graph['step_s']:.3f}")
            if "serial_s" in graph:
                print(f"  that step's serial floor {graph['serial_s'] * 1e3:.2f} ms: graph replays"
                      f" in the run {(in_situ or step) / graph['serial_s']:.2f}x of it")


def plot(result: dict, throughput_ax, decode_ax) -> None:
    """Offline throughput (engine, its floor, transformers) and the decode step against its
    roofline."""
    et, hft = result["engine_throughput"], result.get("hf_throughput")
    bars = {"chatgate engine": et["output_tokens_per_s"]}
    if "floor" in result:
        bars["floor of its steps"] = result["floor"]["output_tokens_per_s"]
    if hft:
        mode = "compiled" if hft["compiled"] else "eager"
        bars[f"transformers\nstatic, {mode}, b={hft['batch_size']}"] = hft["output_tokens_per_s"]
    throughput_ax.bar(list(bars), list(bars.values()), color=[f"C{i}" for i in range(len(bars))])
    throughput_ax.set_ylabel("output tokens/s")
    throughput_ax.set_title("Offline throughput")
    steps = [r for r in result["decode_step"] if "skipped" not in r]
    if steps:
        labels = [f"ctx {r['ctx']}" for r in steps]
        x = np.arange(len(steps))
        decode_ax.bar(x - 0.2, [r["step_s"] * 1e3 for r in steps], 0.4, label="measured")
        decode_ax.bar(x + 0.2, [r["roofline_s"] * 1e3 for r in steps], 0.4, label="roofline")
        decode_ax.set_xticks(x, labels)
        decode_ax.set_ylabel("ms")
        decode_ax.set_title(f"Decode step, batch {steps[0]['batch']}")


