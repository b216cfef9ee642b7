"""The grammar worker's two xgrammar calls a step (accept the rows' tokens, fill their masks),
timed alone and beside a busy Python thread, through xgrammar's public wrappers and through
the calls the grammar worker makes (``engine.grammar_process``: straight into xgrammar's core).

``--num-matchers`` matchers of structured.py's schema (compiled as the engine compiles it)
walk through valid answers token by token; each step's accept + fill runs on a thread of its
own. "Beside a busy thread": the main thread runs Python until the job is done, as an engine
thread sharing the interpreter would (the engine runs the calls in a process of their own,
``engine.grammar_worker``, where nothing competes for its GIL). Prints the median ms per step
of each call. Log: ``grammar_fill.txt``/``.json``.

    python benchmarks/grammar_fill.py                 # SmolLM2's tokenizer, 64 matchers
    python benchmarks/grammar_fill.py --tokenizer DIR # a tokenizer saved to DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks._common import DEFAULT_OUT, open_log, ratio, table  # noqa: E402
from benchmarks.structured import PEOPLE, SCHEMA  # noqa: E402


def answers(tokenizer: Any, n: int) -> list[list[int]]:
    """``n`` valid answers to structured.py's schema, as token ids, cut to a common length."""
    texts = [json.dumps({"name": PEOPLE[i % len(PEOPLE)], "birth_year": 1800 + 7 * i,
                         "field": "Mathematics and physics"}) for i in range(n)]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    length = min(map(len, ids))
    return [t[:length] for t in ids]


def wrapper_calls() -> tuple[Callable, Callable, Callable]:
    """How matchers are passed (as they are), accept(matchers, tokens) and
    fill(matchers, bitmask, rows), through xgrammar's wrappers."""
    import xgrammar as xgr

    batch = xgr.BatchGrammarMatcher()
    return (list, xgr.BatchGrammarMatcher.batch_accept_token,
            lambda ms, bitmask, rows: batch.batch_fill_next_token_bitmask(ms, bitmask, rows))


def engine_calls() -> tuple[Callable, Callable, Callable]:
    """The same as the grammar worker makes them: on xgrammar's core matchers (the worker's
    matchers are those from the start)."""
    from engine import grammar_process

    return (lambda ms: [m._handle for m in ms], grammar_process.accept_tokens,
            grammar_process.fill_bitmask)


def walk(grammar: Any, tokens: list[list[int]], calls: tuple[Callable, Callable, Callable],
         busy: bool, bitmask: Any) -> tuple[list[float], list[float]]:
    """Each step's accept and fill time (seconds) over the answers ``tokens``."""
    import xgrammar as xgr

    passed, accept, fill = calls
    matchers = passed([xgr.GrammarMatcher(grammar) for _ in tokens])
    rows = list(range(len(tokens)))
    accepts: list[float] = []
    fills: list[float] = []

    def job(step: int) -> None:
        start = time.perf_counter()
        if step:
            accept(matchers, [t[step - 1] for t in tokens])
        mid = time.perf_counter()
        fill(matchers, bitmask, rows)
        if step:
            accepts.append(mid - start)
        fills.append(time.perf_counter() - mid)

    with ThreadPoolExecutor(1) as thread:
        for step in range(len(tokens[0])):
            future = thread.submit(job, step)
            while busy and not future.done():
                sum(range(50))  # a thread beside it, running Python meanwhile
            future.result()
    return accepts, fills


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: SmolLM2's)")
    p.add_argument("--num-matchers", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="walks per path and condition")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 matchers, one walk")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.num_matchers, args.repeat = 4, 1
    log, _ = open_log(args.out, "grammar_fill", args.quick, argv)

    import torch
    import xgrammar as xgr

    from engine.loader import load_tokenizer
    from engine.structured import GrammarCompiler
    from engine.structured_output import StructuredOutput

    tokenizer = load_tokenizer("smollm2", tokenizer=args.tokenizer)
    grammars = GrammarCompiler(tokenizer, len(tokenizer), torch.device("cpu"))
    grammar = grammars._compile(StructuredOutput(json_schema=json.dumps(SCHEMA)))
    tokens = answers(tokenizer, args.num_matchers)
    bitmask = torch.empty(xgr.get_bitmask_shape(len(tokens), grammars.vocab_size),
                          dtype=xgr.bitmask_dtype)
    log(f"{len(tokens)} matchers, {len(tokens[0])} steps a walk, {args.repeat} walks each")
    results: dict[str, dict[str, float]] = {}
    for _ in range(args.repeat):  # paths and conditions alternate
        for path, calls in (("xgrammar wrappers", wrapper_calls()),
                            ("engine (core calls)", engine_calls())):
            for condition, busy in (("alone", False), ("beside a busy thread", True)):
                accepts, fills = walk(grammar, tokens, calls, busy, bitmask)
                key = f"{path}, {condition}"
                best = results.setdefault(key, {"accept_ms": float("inf"),
                                                "fill_ms": float("inf")})
                best["accept_ms"] = min(best["accept_ms"], statistics.median(accepts) * 1e3)
                best["fill_ms"] = min(best["fill_ms"], statistics.median(fills) * 1e3)
    wrapped = results["xgrammar wrappers, beside a busy thread"]
    baseline = wrapped["accept_ms"] + wrapped["fill_ms"]
    rows = [[key, r["accept_ms"], r["fill_ms"],
             f"{ratio(r['accept_ms'] + r['fill_ms'], baseline):.2f}"]
            for key, r in results.items()]
    log(table(rows, ["calls, condition", "accept ms", "fill ms",
                     "vs wrappers beside a busy thread"]))
    log.write_json({"argv": sys.argv[1:] if argv is None else argv,
                    "num_matchers": len(tokens), "steps": len(tokens[0]), "results": results})
    log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
