"""Tiered KV (``--kv-offloading-size``): chat sessions that leave the device pool
come back by copy from host memory instead of by recompute.

Workload: ``--sessions`` chat sessions, each with a ``--history``-token conversation so far
(random token ids, distinct per session; set up by a first round that is not a turn of the
run), then ``--turns`` turns each: a turn appends the previous answer (``--answer`` greedy
tokens) and a ``--user``-token message. Rounds go one after another (turn t of every session,
``--batch`` sessions at a time, each batch run to completion), so between two turns of a
session every other session runs one turn. The device pool holds about ``--fit-sessions``
sessions' histories, so a returning session's KV has left the device. Measured, tier on and
tier off, same weights, same run:

- TTFT of the turns (every one returns to a history; request added → its first token), p50;
- prefill tokens computed by the model (``num_prefill_tokens_computed``) over the turns, and
  also counting the round that set the histories up (computed alike in both runs);
- decode throughput of ``--decoders`` other requests generating while sessions return:
  their tokens per second with the returning sessions' KV on the host (reload traffic, plus
  the offloads of sessions pushed out) against the same returning turns with the pool large
  enough that every session stays pinned on the device (no copy traffic).

    python benchmarks/tiered_kv.py --quick                      # tiny random model (the test)
    python benchmarks/tiered_kv.py                               # CPU smoke: SmolLM2
    python benchmarks/tiered_kv.py --h200                        # one H200 (see --h200's help)

Writes ``tiered_kv.txt``/``.json``/``.png`` to ``--out``; the table with the targets is last.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks._common import (  # noqa: E402
    add_out_argument,
    open_log,
    percentile,
    ratio,
    save_figure,
    table,
)

TARGETS = {"ttft": 0.25, "prefill": 0.2, "decode": 0.95}


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


def _drain(engine, submitted: dict[str, float], ttft: dict[str, float]) -> dict[str, list[int]]:
    """Step until every submitted request finished; their output token ids."""
    out: dict[str, list[int]] = {r: [] for r in submitted}
    done: set[str] = set()
    while len(done) < len(submitted):
        for o in engine.step():
            if o.request_id not in submitted:
                continue
            if o.outputs[0].token_ids and o.request_id not in ttft:
                ttft[o.request_id] = time.perf_counter() - submitted[o.request_id]
            out[o.request_id] += o.outputs[0].token_ids
            if o.finished:
                done.add(o.request_id)
    return out


def chat_rounds(engine, args, seed: int) -> dict:
    """Every session's history, then its turns, round by round (round 0 sets the histories
    up); per-round TTFT and prefill tokens computed."""
    from engine import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=args.answer, ignore_eos=True)
    prompts = [_ids(rng, args.history) for _ in range(args.sessions)]
    rounds = args.turns + 1
    res: dict = {"ttft": [[] for _ in range(rounds)], "computed": [0] * rounds, "answers": []}
    for turn in range(rounds):
        before = engine.stats().num_prefill_tokens_computed
        for start in range(0, args.sessions, args.batch):
            group = range(start, min(start + args.batch, args.sessions))
            submitted, ttft = {}, {}
            for s in group:
                rid = f"t{turn}-s{s}"
                submitted[rid] = time.perf_counter()
                engine.add_request(rid, prompts[s], params, session_id=f"s{s}")
            outs = _drain(engine, submitted, ttft)
            for s in group:
                answer = outs[f"t{turn}-s{s}"]
                res["answers"].append(answer)
                prompts[s] = prompts[s] + answer + _ids(rng, args.user)
            res["ttft"][turn] += list(ttft.values())
        res["computed"][turn] = engine.stats().num_prefill_tokens_computed - before
    res["stats"] = {k: getattr(engine.stats(), k) for k in (
        "host_cache_hits", "num_blocks_offloaded", "num_blocks_reloaded", "kv_offload_bytes",
        "kv_reload_bytes", "kv_reload_seconds", "num_preemptions")}
    return res


def decode_under_traffic(engine, args, seed: int) -> dict:
    """Decode tokens/s of ``--decoders`` requests while ``--traffic-sessions`` sessions (their
    first turn run before) return one after another."""
    from engine import SamplingParams

    rng = random.Random(seed)
    greedy = SamplingParams(temperature=0, max_tokens=args.answer, ignore_eos=True)
    n = args.traffic_sessions
    prompts = [_ids(rng, args.history) for _ in range(n)]
    for s in range(n):  # first turns; with a small pool most end up on the host
        engine.add_request(f"w{s}", prompts[s], greedy, session_id=f"d{s}")
        answer = _drain(engine, {f"w{s}": time.perf_counter()}, {})[f"w{s}"]
        prompts[s] = prompts[s] + answer + _ids(rng, args.user)
    long = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for d in range(args.decoders):
        engine.add_request(f"bg{d}", _ids(rng, 32), long)
    produced = 0
    while produced < args.decoders:  # every decoder past its prefill
        produced += sum(len(o.outputs[0].token_ids) for o in engine.step())
    stats0, t0, produced = engine.stats(), time.perf_counter(), 0
    pending = list(range(n))
    active: set[str] = set()
    while pending or active:
        if len(active) < args.batch and pending:
            s = pending.pop(0)
            engine.add_request(f"r{s}", prompts[s], greedy, session_id=f"d{s}")
            active.add(f"r{s}")
        for o in engine.step():
            if o.request_id.startswith("bg"):
                produced += len(o.outputs[0].token_ids)
            elif o.finished:
                active.discard(o.request_id)
    wall = time.perf_counter() - t0
    stats1 = engine.stats()
    for d in range(args.decoders):
        engine.abort(f"bg{d}")
    while engine.has_unfinished():
        engine.step()
    return {"decode_tokens_per_s": produced / wall, "wall_s": wall,
            "reloaded_blocks": stats1.num_blocks_reloaded - stats0.num_blocks_reloaded,
            "offloaded_blocks": stats1.num_blocks_offloaded - stats0.num_blocks_offloaded}


PRESETS = {
    "quick": dict(sessions=4, turns=2, history=64, answer=4, user=8, fit_sessions=1, batch=2,
                  decoders=2, traffic_sessions=3, kv_offloading_size=0.05),
    "cpu": dict(model="smollm2", sessions=8, turns=2, history=384, answer=8, user=24,
                fit_sessions=2, batch=2, decoders=4, traffic_sessions=4, kv_offloading_size=1.0),
    # the 512 sessions × 4 turns with a pool for ~64 is scaled down 4× (128 sessions,
    # a pool for 16: the same 1/8 fraction) to finish in a few minutes on one H200
    "h200": dict(model="dummy:llama-3.1-8b", dtype="bfloat16", device="cuda", sessions=128,
                 turns=4, history=2000, answer=32, user=64, fit_sessions=16, batch=16,
                 decoders=32, traffic_sessions=32, kv_offloading_size=48.0, max_num_seqs=64,
                 max_num_batched_tokens=8192),
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    for name, default in [("sessions", 8), ("turns", 2), ("history", 384), ("answer", 8),
                          ("user", 24), ("fit-sessions", 2), ("batch", 2), ("decoders", 4),
                          ("traffic-sessions", 4), ("max-num-seqs", 32),
                          ("max-num-batched-tokens", 2048), ("seed", 0)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--kv-offloading-size", type=float, default=1.0, help="GiB")
    ap.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    ap.add_argument("--h200", action="store_true",
                    help="one H200: dummy:llama-3.1-8b bf16, 128 sessions with 2,000-token "
                         "histories x 4 turns, a pool for 16 sessions, 48 GiB host tier")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    preset = "quick" if args.quick else "h200" if args.h200 else None
    if preset is not None:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or sys.argv[1:])}
        for key, value in PRESETS[preset].items():
            if key not in given:
                setattr(args, key, value)
    return args


def _session_blocks(args) -> int:
    return -(-(args.history + (args.turns + 1) * (args.answer + args.user)) // 16)


def _engine(args, loaded, num_blocks: int, gib: float):
    from engine import LLM

    return LLM(args.model, loaded=loaded, device=args.device, dtype=args.dtype,
               num_kv_blocks=num_blocks, kv_offloading_size=gib, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)


def _release(llm) -> None:
    import torch

    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_all(args, log) -> dict:
    import torch

    from engine.config import EngineConfig
    from engine.device import torch_device, torch_dtype
    from engine.loader import load_model

    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype)
    loaded = load_model(args.model, torch_device(config), torch_dtype(config), seed=args.seed)
    small = args.fit_sessions * _session_blocks(args)
    raw: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "pool_blocks": small}
    for name, gib in (("off", 0.0), ("on", args.kv_offloading_size)):
        llm = _engine(args, loaded, small, gib)
        llm.generate([[1, 2, 3]], None)  # first-call overheads, not counted
        t = time.perf_counter()
        raw[name] = chat_rounds(llm.engine, args, args.seed)
        raw[name]["wall_s"] = time.perf_counter() - t
        log(f"tier {name}: {raw[name]['wall_s']:.1f}s, prefill computed per turn "
            f"{raw[name]['computed']}, {raw[name]['stats']}")
        _release(llm)
    big = 2 * (args.traffic_sessions + args.decoders + args.batch) * _session_blocks(args)
    for name, blocks in (("quiet", big), ("traffic", small)):
        llm = _engine(args, loaded, blocks, args.kv_offloading_size)
        llm.generate([[1, 2, 3]], None)
        raw["decode_" + name] = decode_under_traffic(llm.engine, args, args.seed + 1)
        log(f"decode, {name} ({blocks} blocks): {raw['decode_' + name]}")
        _release(llm)
    raw["device"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    return raw


def summary(raw: dict, args) -> tuple[list[list], dict]:
    on, off = raw["on"], raw["off"]
    back_on = [t for turn in on["ttft"][1:] for t in turn]
    back_off = [t for turn in off["ttft"][1:] for t in turn]
    ttft = ratio(percentile(back_on, 50), percentile(back_off, 50))
    prefill = ratio(sum(on["computed"][1:]), sum(off["computed"][1:]))
    with_setup = ratio(sum(on["computed"]), sum(off["computed"]))
    decode = ratio(raw["decode_traffic"]["decode_tokens_per_s"],
                   raw["decode_quiet"]["decode_tokens_per_s"])
    same = sum(a == b for a, b in zip(on["answers"], off["answers"], strict=True))
    figures = {"ttft_ratio": ttft, "prefill_ratio": prefill, "with_setup_prefill_ratio": with_setup,
               "decode_ratio": decode, "same_answers": same}

    def verdict(value: float, target: float, at_least: bool = False) -> str:
        ok = value >= target if at_least else value <= target
        return f"{'>=' if at_least else '<='} {target}: {'met' if ok else 'MISSED'}"

    rows = [
        ["returning-turn TTFT p50 (ms)", percentile(back_on, 50) * 1e3,
         percentile(back_off, 50) * 1e3, ttft, verdict(ttft, TARGETS["ttft"])],
        ["prefill tokens computed, all turns", sum(on["computed"][1:]),
         sum(off["computed"][1:]), prefill, verdict(prefill, TARGETS["prefill"])],
        ["  and setting the histories up", sum(on["computed"]), sum(off["computed"]),
         with_setup, "(the first round: alike in both)"],
        ["decode tok/s of other requests", raw["decode_traffic"]["decode_tokens_per_s"],
         raw["decode_quiet"]["decode_tokens_per_s"], decode,
         verdict(decode, TARGETS["decode"], at_least=True) + " (vs no copy traffic)"],
        ["blocks reloaded / offloaded (tier on)",
         f"{on['stats']['num_blocks_reloaded']} / {on['stats']['num_blocks_offloaded']}", "",
         "", f"{on['stats']['kv_reload_bytes'] / 2**20:.0f} MiB back in "
             f"{on['stats']['kv_reload_seconds'] * 1e3:.1f} ms"],
        ["greedy answers identical", f"{same}/{len(on['answers'])}", "", "", ""],
    ]
    return rows, figures


def plot(raw: dict, args, ax1, ax2) -> None:
    turns = list(range(args.turns + 1))
    for name, label in (("on", "host tier on"), ("off", "off")):
        ax1.plot(turns, [percentile(t, 50) * 1e3 for t in raw[name]["ttft"]], marker="o",
                 label=label)
        ax2.plot(turns, raw[name]["computed"], marker="o", label=label)
    ax1.set(xlabel="turn (0: the histories set up)", ylabel="TTFT p50 (ms)",
            title="time to first token per turn")
    ax2.set(xlabel="turn", ylabel="prefill tokens computed",
            title=f"{args.sessions} sessions, pool for {args.fit_sessions}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log, stem = open_log(args.out, "tiered_kv", args.quick, argv)
    log(f"{args.sessions} sessions with {args.history}-token histories x {args.turns} turns, "
        f"pool for {args.fit_sessions} sessions, host tier {args.kv_offloading_size} GiB, "
        f"model {args.model} on {args.device}")
    raw = run_all(args, log)
    rows, raw["figures"] = summary(raw, args)
    (args.out / f"{stem}.json").write_text(json.dumps(raw, indent=1))
    save_figure(args.out / f"{stem}.png", functools.partial(plot, raw, args), ncols=2,
                figsize=(11, 4))
    log("")
    log(table(rows, ["figure", "tier on", "tier off", "on/off", "target"]))
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
