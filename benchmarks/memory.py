"""KV-cache memory: paged blocks against contiguous reservation, on one ShareGPT-shaped stream.

A fixed-seed stream of requests (log-normal lengths, mean prompt ≈ 160 and mean output ≈ 340
tokens, long tails, prompt + output ≤ max_model_len 2048) is replayed against one fixed KV
budget (in token slots) under three policies, with the same step model (continuous batching:
running requests first, each step one decode token per running request, prefill chunks under a
token budget, FCFS admission):

  (a) ours   — the real ``engine.scheduler.Scheduler`` + ``engine.kv_cache_manager.KVCacheManager``
               (blocks of 16 on demand, preemption by recompute), the model replaced by a fake
               step that appends a random token (as tests/engine/test_block_invariants.py does);
  (b) max    — contiguous reservation of max_model_len slots per request (transformers' static
               cache / the "traditional" server): admitted only when max_model_len slots are free;
  (c) oracle — contiguous reservation of exactly prompt + output slots (needs the output length
               in advance, which no real server has).

Waste = reserved but unused slots / reserved slots, where "used" = slots holding KV of a token
(for (a) the engine's own measure: ``1 − stored tokens / slots of the blocks in use``). Reported
over time, at peak (mean over the steps where reserved memory is ≥ 90% of its maximum) and
overall (Σ unused / Σ reserved over all steps); in-flight requests at most and on average while
requests are queued (the steady state). A sweep of KV budgets gives in-flight vs budget.

Then the real engine on CPU (SmolLM2, a small pool, a scaled-down stream from the same
distribution, ignore_eos so lengths are exact) is stepped by hand and its ``stats()``
(kv_waste, kv_cache_usage, running) sampled every step, beside the simulator of (a) on the
identical stream and pool: the two must agree step for step.

    python benchmarks/memory.py            # full run (~1-3 min without the engine part)
    python benchmarks/memory.py --quick    # seconds; used by the smoke test
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks._common import (  # noqa: E402
    Run,
    Tee,
    add_out_argument,
    args_json,
    mean,
    ratio,
    sharegpt_lengths,
    table,
)
from engine.kv_cache_manager import KVCacheManager  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.sequence import Sequence, SequenceStatus  # noqa: E402

VOCAB = 49152


@dataclass
class Trace:
    policy: str
    budget_slots: int
    steps: list[int] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    stored: list[int] = field(default_factory=list)
    preemptions: int = 0
    finished_at: int = 0

    def record(self, step: int, in_flight: int, waiting: int, reserved: int, stored: int) -> None:
        self.steps.append(step)
        self.in_flight.append(in_flight)
        self.waiting.append(waiting)
        self.reserved.append(reserved)
        self.stored.append(stored)

    def waste(self) -> list[float]:
        return [1 - s / r if r else 0.0 for s, r in zip(self.stored, self.reserved, strict=True)]

    def summary(self) -> dict:
        waste = self.waste()
        top = max(self.reserved) if self.reserved else 0
        peak = [w for w, r in zip(waste, self.reserved, strict=True) if r >= 0.9 * top and r]
        queued = [n for n, w in zip(self.in_flight, self.waiting, strict=True) if w > 0]
        total_r, total_s = sum(self.reserved), sum(self.stored)
        return {
            "policy": self.policy,
            "budget_slots": self.budget_slots,
            "steps": self.finished_at,
            "max_in_flight": max(self.in_flight, default=0),
            "mean_in_flight_queued": mean(queued) if queued else mean(self.in_flight),
            "waste_at_peak": mean(peak),
            "max_waste_at_peak": max(peak, default=float("nan")),
            "waste_overall": 1 - total_s / total_r if total_r else 0.0,
            "peak_usage": top / self.budget_slots,
            "preemptions": self.preemptions,
        }


def make_prompts(lengths: list[tuple[int, int]], seed: int) -> list[list[int]]:
    rng = random.Random(seed + 1)
    return [[rng.randrange(VOCAB) for _ in range(p)] for p, _ in lengths]


def simulate_paged(lengths: list[tuple[int, int]], prompts: list[list[int]], *, num_blocks: int,
                   block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                   max_model_len: int, enable_prefix_caching: bool = True, seed: int = 0,
                   max_steps: int | None = None, stop_when_drained: bool = False,
                   check_every: int = 10) -> Trace:
    """Policy (a): the engine's own scheduler and KV cache manager, the model faked.

    Stored tokens per step = Σ num_computed_tokens of the running sequences (no block is shared
    in this stream: random prompts, n = 1, no sessions); every ``check_every`` steps this is
    asserted equal to the engine's own measure, ``KVCacheManager.stored_tokens`` (what
    ``stats().kv_waste`` uses), which is too slow to call on every step of a long replay."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, pin_budget_blocks=0)
    scheduler = Scheduler(kv, max_num_seqs, max_num_batched_tokens)
    max_len = min(max_model_len, num_blocks * block_size)
    rng = random.Random(seed + 2)
    for i, ((_, out), prompt) in enumerate(zip(lengths, prompts, strict=True)):
        params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
        scheduler.add(Sequence(str(i), 0, prompt, params, None))
    trace = Trace("(a) ours: paged", num_blocks * block_size)
    step = 0
    while scheduler.has_work():
        batch = scheduler.schedule()
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            kv.commit(seq, n)
        for seq in batch.seqs:
            if seq.num_computed_tokens != seq.num_tokens:
                continue  # a prefill chunk that does not reach the last token samples nothing
            seq.token_ids.append(rng.randrange(VOCAB))
            if (seq.num_output_tokens >= seq.params.max_tokens
                    or seq.num_tokens >= max_len):
                seq.finish_reason = "length"
                scheduler.finish(seq)
        step += 1
        # measured like LLMEngine.stats() after the step
        stored = sum(s.num_computed_tokens for s in scheduler.running)
        if check_every and step % check_every == 0:
            assert stored == kv.stored_tokens(scheduler.running), step
        trace.record(step, len(scheduler.running), len(scheduler.waiting),
                     kv.pool.num_used * block_size, stored)
        if max_steps is not None and step >= max_steps:
            break
        if stop_when_drained and not scheduler.waiting:
            break
    trace.preemptions = scheduler.num_preemptions
    trace.finished_at = step
    assert all(s.status is not SequenceStatus.RUNNING or s.block_table for s in scheduler.running)
    return trace


def simulate_contiguous(lengths: list[tuple[int, int]], *, budget_slots: int, reserve: str,
                        max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                        max_steps: int | None = None, stop_when_drained: bool = False) -> Trace:
    """Policies (b) and (c): each request reserves one contiguous region when admitted
    (max_model_len slots, or exactly prompt + output) and holds it until it finishes.
    External fragmentation is ignored (a generous assumption for the baselines)."""
    name = "(b) contiguous max_model_len" if reserve == "max" else "(c) contiguous exact (oracle)"
    trace = Trace(name, budget_slots)
    waiting = list(range(len(lengths)))
    waiting.reverse()  # pop() from the end = FCFS
    running: list[list[int]] = []  # [index, computed, outputs, reserved]
    free = budget_slots
    step = 0
    while waiting or running:
        budget = max_num_batched_tokens
        work: list[tuple[list[int], int]] = []
        for r in running:
            if budget <= 0:
                break
            p, _ = lengths[r[0]]
            total = p + r[2]
            n = min(total - r[1], budget)
            work.append((r, n))
            budget -= n
        while waiting and budget > 0 and len(running) < max_num_seqs:
            i = waiting[-1]
            p, o = lengths[i]
            need = max_model_len if reserve == "max" else p + o
            if need > free:
                break
            waiting.pop()
            free -= need
            r = [i, 0, 0, need]
            running.append(r)
            n = min(p, budget)
            work.append((r, n))
            budget -= n
        for r, n in work:
            r[1] += n
            p, o = lengths[r[0]]
            if r[1] == p + r[2]:  # reached the last token: sample one
                r[2] += 1
                if r[2] >= o:
                    running.remove(r)
                    free += r[3]
        step += 1
        trace.record(step, len(running), len(waiting), sum(r[3] for r in running),
                     sum(r[1] for r in running))
        if max_steps is not None and step >= max_steps:
            break
        if stop_when_drained and not waiting:
            break
    trace.finished_at = step
    return trace


# -- the real engine ------------------------------------------------------------------------------

def run_engine(lengths: list[tuple[int, int]], prompts: list[list[int]], *, num_blocks: int,
               block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
               max_model_len: int, log: Tee, model: str = "smollm2") -> dict:
    """Step the real engine by hand and sample its stats after every step."""
    from engine import LLM

    llm = LLM(model, num_kv_blocks=num_blocks, block_size=block_size,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              max_model_len=max_model_len, seed=0)
    engine = llm.engine
    for i, ((_, out), prompt) in enumerate(zip(lengths, prompts, strict=True)):
        engine.add_request(f"m{i}", prompt,
                           SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
    samples = []
    t0 = time.perf_counter()
    step = 0
    while engine.has_unfinished():
        engine.step()
        step += 1
        s = llm.stats()
        samples.append({"step": step, "running": s.num_requests_running,
                        "waiting": s.num_requests_waiting, "kv_usage": s.kv_cache_usage,
                        "kv_waste": s.kv_waste, "blocks_used": s.num_blocks_used,
                        "tokens_stored": s.num_tokens_stored,
                        "preemptions": s.num_preemptions})
        if step % 25 == 0:
            log(f"  engine step {step}: running {s.num_requests_running}, waiting "
                f"{s.num_requests_waiting}, kv usage {s.kv_cache_usage:.1%}, "
                f"waste {s.kv_waste:.2%}, preemptions {s.num_preemptions} "
                f"({time.perf_counter() - t0:.0f} s)")
    return {"samples": samples, "seconds": time.perf_counter() - t0,
            "final": llm.stats()}


# -- the three parts ----------------------------------------------------------------------------

def replay(args: argparse.Namespace, lengths: list[tuple[int, int]], prompts: list[list[int]],
           common: dict, log: Tee) -> list[Trace]:
    """The main replay at one budget under (a), (b) and (c)."""
    bs = args.block_size
    log(f"\n## replay at a KV budget of {args.budget_slots} slots "
        f"({args.budget_slots // bs} blocks of {bs})")
    traces = []
    t = time.perf_counter()
    traces.append(simulate_paged(lengths, prompts, num_blocks=args.budget_slots // bs,
                                 block_size=bs, seed=args.seed, **common))
    log(f"  (a) done: {traces[-1].finished_at} steps ({time.perf_counter() - t:.1f} s)")
    for reserve in ("max", "exact"):
        t = time.perf_counter()
        traces.append(simulate_contiguous(lengths, budget_slots=args.budget_slots,
                                          reserve=reserve, **common))
        log(f"  {traces[-1].policy} done: {traces[-1].finished_at} steps "
            f"({time.perf_counter() - t:.1f} s)")
    return traces


def sweep_budgets(args: argparse.Namespace, common: dict, log: Tee) -> list[dict]:
    """In flight vs budget, steady state only: each run stops once the queue is drained."""
    log("\n## in-flight requests vs KV budget (until the queue drains)")
    bs, sweep = args.block_size, []
    for budget in [int(x) for x in args.sweep.split(",") if x]:
        n = max(args.num_requests, budget // 40) if not args.quick else args.num_requests
        sw_lengths = sharegpt_lengths(n, args.seed, max_model_len=args.max_model_len)
        sw_prompts = make_prompts(sw_lengths, args.seed)
        t = time.perf_counter()
        row = {"budget_slots": budget}
        a = simulate_paged(sw_lengths, sw_prompts, num_blocks=budget // bs, block_size=bs,
                           seed=args.seed, stop_when_drained=True, check_every=0,
                           **common).summary()
        b = simulate_contiguous(sw_lengths, budget_slots=budget, reserve="max",
                                stop_when_drained=True, **common).summary()
        c = simulate_contiguous(sw_lengths, budget_slots=budget, reserve="exact",
                                stop_when_drained=True, **common).summary()
        for key, s in (("a", a), ("b", b), ("c", c)):
            row[f"{key}_mean"] = s["mean_in_flight_queued"]
            row[f"{key}_max"] = s["max_in_flight"]
            row[f"{key}_waste_peak"] = s["waste_at_peak"]
        sweep.append(row)
        log(f"  budget {budget:>6} slots ({n} requests): in flight (mean while queued / max) "
            f"a {row['a_mean']:.0f}/{row['a_max']}, b {row['b_mean']:.0f}/{row['b_max']}, "
            f"c {row['c_mean']:.0f}/{row['c_max']} ({time.perf_counter() - t:.1f} s)")
    return sweep


def engine_vs_simulator(args: argparse.Namespace, log: Tee) -> tuple[dict, Trace]:
    """The real engine beside the simulator of (a) on the identical stream and pool: the
    engine's stats summarised, and the simulator's trace."""
    bs = args.block_size
    log(f"\n## real engine (SmolLM2, CPU) vs the simulator of (a): "
        f"{args.engine_requests} requests, lengths × {args.engine_scale}, "
        f"{args.engine_blocks} blocks of {bs}")
    e_lengths = [(max(2, int(p * args.engine_scale)), max(2, int(o * args.engine_scale)))
                 for p, o in sharegpt_lengths(args.engine_requests, args.seed + 7,
                                              max_model_len=args.max_model_len)]
    e_prompts = make_prompts(e_lengths, args.seed + 7)
    e_common = {"max_num_seqs": 256, "max_num_batched_tokens": 512,
                "max_model_len": args.max_model_len}
    result = run_engine(e_lengths, e_prompts, num_blocks=args.engine_blocks,
                        block_size=bs, log=log, model=args.model, **e_common)
    sim = simulate_paged(e_lengths, e_prompts, num_blocks=args.engine_blocks, block_size=bs,
                         seed=args.seed, check_every=1, **e_common)
    samples = result["samples"]
    e_waste = [s["kv_waste"] for s in samples]
    e_usage = [s["kv_usage"] for s in samples]
    same = (len(samples) == len(sim.steps)
            and all(s["running"] == r and s["blocks_used"] * bs == res
                    and s["tokens_stored"] == st
                    for s, r, res, st in zip(samples, sim.in_flight, sim.reserved,
                                             sim.stored, strict=True)))
    top = max(e_usage)
    peak = [w for w, u in zip(e_waste, e_usage, strict=True) if u >= 0.9 * top]
    total_slots = sum(s["blocks_used"] * bs for s in samples)
    result.update({
        "steps": len(samples), "sim_steps": sim.finished_at, "agree": same,
        "peak_usage": top, "waste_at_peak": mean(peak),
        "waste_overall": 1 - sum(s["tokens_stored"] for s in samples) / total_slots
        if total_slots else 0.0,
        "sim_waste_at_peak": sim.summary()["waste_at_peak"],
        "max_running": max(s["running"] for s in samples),
        "preemptions": samples[-1]["preemptions"] if samples else 0,
        "sim_preemptions": sim.preemptions,
    })
    log(f"  engine: {len(samples)} steps in {result['seconds']:.0f} s, peak KV "
        f"usage {top:.1%}, waste at peak {result['waste_at_peak']:.2%}, overall "
        f"{result['waste_overall']:.2%}, max running {result['max_running']}, "
        f"preemptions {result['preemptions']}")
    log(f"  simulator: {sim.finished_at} steps, waste at peak "
        f"{result['sim_waste_at_peak']:.2%}, preemptions {sim.preemptions}; "
        f"step-for-step identical (running, blocks, tokens stored): {same}")
    return result, sim


# -- plots and tables ---------------------------------------------------------------------------

def plot(run: Run, args: argparse.Namespace, traces: list[Trace], sweep: list[dict],
         engine: tuple[dict, Trace] | None) -> None:
    def waste_and_in_flight(ax1, ax2) -> None:
        for tr in traces:
            ax1.plot(tr.steps, [100 * w for w in tr.waste()], label=tr.policy, lw=1.2)
            ax2.plot(tr.steps, tr.in_flight, label=tr.policy, lw=1.2)
        ax1.set(xlabel="engine step", ylabel="KV waste (% of reserved slots)",
                title=f"KV waste over time, budget {args.budget_slots} slots", ylim=(0, 100))
        ax2.set(xlabel="engine step", ylabel="requests in flight",
                title="requests in flight over time")

    def in_flight_vs_budget(ax) -> None:
        xs = [r["budget_slots"] for r in sweep]
        for key, label in (("a", "(a) ours: paged"), ("b", "(b) contiguous max_model_len"),
                           ("c", "(c) contiguous exact (oracle)")):
            ax.plot(xs, [r[f"{key}_mean"] for r in sweep], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="KV budget (token slots)",
               ylabel="requests in flight (mean while queued)",
               title="in-flight requests vs KV budget")

    run.plot(f"memory_waste{run.suffix}.png", waste_and_in_flight, ncols=2, figsize=(12, 4.2))
    run.plot(f"memory_inflight{run.suffix}.png", in_flight_vs_budget)
    if engine is None:
        return
    result, sim = engine

    def engine_stats(ax) -> None:
        steps = [s["step"] for s in result["samples"]]
        ax.plot(steps, [100 * s["kv_usage"] for s in result["samples"]],
                label="engine kv_cache_usage %")
        ax.plot(steps, [100 * s["kv_waste"] for s in result["samples"]],
                label="engine kv_waste %")
        ax.plot(sim.steps, [100 * w for w in sim.waste()], ls="--",
                label="simulator (a) waste %")
        ax.set(xlabel="engine step", ylabel="%", title="real engine stats (SmolLM2, CPU)")

    run.plot(f"memory_engine{run.suffix}.png", engine_stats)


def met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(run: Run, args: argparse.Namespace, n_requests: int, sums: list[dict],
           sweep: list[dict], engine: dict | None) -> None:
    """The tables, last."""
    a, b, _ = sums
    in_flight = ratio(a["mean_in_flight_queued"], b["mean_in_flight_queued"])
    run.section(f"KV memory, budget {args.budget_slots} slots, {n_requests} requests", [
        [s["policy"], f"{s['waste_at_peak']:.2%}", f"{s['waste_overall']:.2%}",
         s["max_in_flight"], f"{s['mean_in_flight_queued']:.1f}", s["steps"], s["preemptions"]]
        for s in sums], ["policy", "waste@peak", "waste overall", "max in flight",
                         "in flight (queued)", "steps", "preempt"])
    run("")
    run(table([
        ["waste at peak (a) vs (b)", f"{a['waste_at_peak']:.2%}", f"{b['waste_at_peak']:.2%}",
         "target (a) ≤ 2%, (b) 60–80%", met(a["waste_at_peak"] <= 0.02)],
        ["in flight (a)/(b), mean while queued",
         f"{a['mean_in_flight_queued']:.1f}", f"{b['mean_in_flight_queued']:.1f}",
         f"ratio {in_flight:.1f}× (≥ 5×)", met(in_flight >= 5)],
        ["max in flight (a)/(b)", a["max_in_flight"], b["max_in_flight"],
         f"ratio {ratio(a['max_in_flight'], b['max_in_flight']):.1f}× (≥ 5×)",
         met(ratio(a["max_in_flight"], b["max_in_flight"]) >= 5)],
        ["steps to drain the stream (a)/(b)", a["steps"], b["steps"],
         f"(b) takes {ratio(b['steps'], a['steps']):.1f}× as many", ""],
    ], ["figure", "ours (a)", "baseline (b)", "ratio / target", "status"]))
    run("")
    run(table([[r["budget_slots"], f"{r['a_mean']:.1f}", f"{r['b_mean']:.1f}",
                f"{r['c_mean']:.1f}", f"{ratio(r['a_mean'], r['b_mean']):.1f}×",
                f"{r['a_waste_peak']:.2%}", f"{r['b_waste_peak']:.2%}"] for r in sweep],
              ["budget slots", "in flight (a)", "(b)", "(c)", "(a)/(b)", "waste@peak (a)",
               "(b)"]))
    if engine is None:
        return
    run("")
    run(table([["real engine stats()", f"{engine['waste_at_peak']:.2%}",
                f"{engine['waste_overall']:.2%}", f"{engine['peak_usage']:.1%}",
                engine["max_running"], engine["preemptions"], engine["steps"]],
               ["simulator (a), same stream", f"{engine['sim_waste_at_peak']:.2%}",
                "", "", "", engine["sim_preemptions"], engine["sim_steps"]]],
              ["source", "waste@peak", "waste overall", "peak kv usage", "max running",
               "preempt", "steps"]))
    run(f"engine == simulator step for step: {engine['agree']}")


# -- main ---------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget-slots", type=int, default=32768,
                    help="KV budget in token slots (default 32768 = 16 × max_model_len)")
    ap.add_argument("--sweep", default="8192,16384,32768,65536",
                    help="KV budgets (token slots) for the in-flight vs budget sweep")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--engine-requests", type=int, default=48)
    ap.add_argument("--engine-blocks", type=int, default=96)
    ap.add_argument("--engine-scale", type=float, default=0.25,
                    help="length scale of the engine stream (CPU time)")
    ap.add_argument("--no-engine", action="store_true", help="skip the real-engine check")
    ap.add_argument("--model", default="smollm2", help="model of the real-engine check")
    ap.add_argument("--quick", action="store_true", help="a tiny run (smoke test)")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.num_requests, args.budget_slots, args.sweep = 40, 4096, "2048,4096"
        args.engine_requests, args.engine_blocks, args.engine_scale = 6, 16, 0.05
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args.out, "memory", quick=args.quick, argv=argv)
    lengths = sharegpt_lengths(args.num_requests, args.seed, max_model_len=args.max_model_len)
    prompts = make_prompts(lengths, args.seed)
    ps, os_ = [p for p, _ in lengths], [o for _, o in lengths]
    run(f"stream: {len(lengths)} requests, seed {args.seed}; prompt mean {mean(ps):.0f} "
        f"(median {sorted(ps)[len(ps) // 2]}, max {max(ps)}), output mean {mean(os_):.0f} "
        f"(median {sorted(os_)[len(os_) // 2]}, max {max(os_)}), prompt+output ≤ "
        f"{args.max_model_len}")
    common = {"max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_model_len": args.max_model_len}
    traces = replay(args, lengths, prompts, common, run)
    sums = [tr.summary() for tr in traces]
    sweep = sweep_budgets(args, common, run)
    engine = None if args.no_engine else engine_vs_simulator(args, run)

    plot(run, args, traces, sweep, engine)
    raw = {"args": args_json(args), "summaries": sums, "sweep": sweep,
           "traces": [{"policy": tr.policy, "in_flight": tr.in_flight,
                       "reserved": tr.reserved, "stored": tr.stored} for tr in traces]}
    if engine is not None:
        raw["engine"] = {k: v for k, v in engine[0].items() if k != "final"}
    run.write_json(raw)
    report(run, args, len(lengths), sums, sweep, engine[0] if engine else None)
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
