"""Speculative decoding with n-gram drafts against plain decoding, same engine settings.

Workloads (greedy; each prompt run by both engines back to back, either first in turn, so the
host's drift cancels):
  edit     one stream: a ~300-token Python snippet and an instruction to rename two names in
           it (``--prompts`` prompts): tokens/s with and without speculation, their ratio,
           the acceptance rate (accepted / drafted tokens) and the mean accepted length (tokens
           appended per verify, the bonus included)
  prose    one stream, free prose (no copying): tokens/s ratio
  batch    ``--concurrency`` prompts (edits and prose) submitted together: throughput ratio
  lossless ``--lossless N`` prompts (float32 on CPU): greedy output with and without
           speculation, token for token; mismatches are listed (``--lossless-batching``:
           also plain decoding one prompt at a time against 16 at a time)
  verify   (``--verify-model``, CUDA) one sequence of ``--verify-context`` tokens: the cost of
           a verify step with K = 1..8 drafts (its CUDA graph, and eager) against one decode
           step (CUDA graph), and the speed it implies at the acceptance measured on the edit
           workload

    python benchmarks/spec_decode.py                      # CPU, serving defaults (int8)
    python benchmarks/spec_decode.py --workloads lossless --lossless 200 --quantization none
    python benchmarks/spec_decode.py --device cuda --dtype bfloat16 --concurrency 256 \
        --verify-model dummy:llama-3.1-8b --tokenizer DIR
Results: ``spec_decode.txt``/``.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks._common import add_out_argument, machine_info, open_log, ratio, table  # noqa: E402

SNIPPET_A = '''def load_orders(path, currency):
    orders = []
    with open(path) as handle:
        for line in handle:
            order_id, customer, amount = line.strip().split(",")
            orders.append({"id": order_id, "customer": customer,
                           "amount": float(amount), "currency": currency})
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        totals[order["customer"]] = totals.get(order["customer"], 0.0) + order["amount"]
    return totals


def largest_customer(orders):
    totals = total_by_customer(orders)
    best, best_total = None, 0.0
    for customer, total in totals.items():
        if total > best_total:
            best, best_total = customer, total
    return best, best_total
'''
SNIPPET_B = '''class Inventory:
    def __init__(self, warehouse):
        self.warehouse = warehouse
        self.items = {}

    def add_item(self, name, quantity, price):
        if name in self.items:
            self.items[name]["quantity"] += quantity
        else:
            self.items[name] = {"quantity": quantity, "price": price}

    def remove_item(self, name, quantity):
        item = self.items.get(name)
        if item is None or item["quantity"] < quantity:
            raise ValueError(f"not enough {name} in {self.warehouse}")
        item["quantity"] -= quantity

    def total_value(self):
        return sum(item["quantity"] * item["price"] for item in self.items.values())
'''
RENAMES = {SNIPPET_A: [("orders", "purchases"), ("customer", "client"), ("handle", "stream"),
                       ("totals", "sums"), ("load_orders", "read_orders"),
                       ("amount", "value"), ("best", "top"), ("currency", "unit")],
           SNIPPET_B: [("items", "stock"), ("warehouse", "site"), ("add_item", "put"),
                       ("quantity", "count"), ("remove_item", "take"), ("price", "cost"),
                       ("Inventory", "Store"), ("item", "entry")]}
TOPICS = ["a lighthouse keeper", "the first snow of winter", "a robot learning to paint",
          "a market at dawn", "an old violin", "a city without cars", "a fox in a library",
          "the last day of summer", "a ship made of glass", "a garden on the moon",
          "a baker who cannot sleep", "a letter that arrives fifty years late"]


def edit_chats(n: int) -> list[list[dict]]:
    chats = []
    pairs = [(s, r) for i in range(8) for s, rs in RENAMES.items() for r in [rs[i]]]
    for i in range(n):
        snippet, (old, new) = pairs[i % len(pairs)]
        second = RENAMES[snippet][(i + 3) % 8]
        chats.append([{"role": "user", "content":
                       f"Rename `{old}` to `{new}` and `{second[0]}` to `{second[1]}` in this "
                       f"code. Reply with the whole updated code only.\n\n```python\n"
                       f"{snippet}```"}])
    return chats


def prose_chats(n: int) -> list[list[dict]]:
    forms = ["Write a short story about {}.", "Describe {} in a vivid paragraph.",
             "Write a poem about {}.", "Tell me about {} as if you were a travel guide."]
    return [[{"role": "user", "content": forms[(i // len(TOPICS)) % len(forms)].format(
        TOPICS[i % len(TOPICS)])}] for i in range(n)]


def one_stream(plain, spec, chats: list[list[dict]], params, log) -> dict[str, float]:
    """Each chat alone, plain and speculative one after the other (either first, in turn):
    tokens/s of each over the whole request and over its decode (first token to last), and
    the drafts' figures."""
    keys = ("plain", "spec")
    wall = dict.fromkeys(keys, 0.0)
    decode = dict.fromkeys(keys, 0.0)
    tokens = dict.fromkeys(keys, 0)
    drafted = accepted = verifies = 0
    for i, chat in enumerate(chats):
        pair = [("plain", plain), ("spec", spec)]
        for name, llm in pair if i % 2 == 0 else pair[::-1]:  # either first, in turn
            engine = llm.engine
            before = engine.stats().spec_decode_num_drafts
            ids = engine.render_chat(chat)
            t0 = time.perf_counter()
            engine.add_request(f"{name}-{i}", ids, params)
            first = last = None
            while engine.has_unfinished():
                for out in engine.step():
                    tokens[name] += len(out.outputs[0].token_ids) if out.outputs else 0
                    first = first or time.perf_counter()
                    last = out
            end = time.perf_counter()
            wall[name] += end - t0
            decode[name] += end - first
            if name == "spec":
                verifies += engine.stats().spec_decode_num_drafts - before
                drafted += last.num_draft_tokens
                accepted += last.num_accepted_tokens
        log(f"  {i + 1}/{len(chats)}: plain {tokens['plain'] / wall['plain']:.1f} tok/s, "
            f"spec {tokens['spec'] / wall['spec']:.1f} tok/s")
    rates = {f"{name}_{kind}": (tokens[name] - (len(chats) if kind == "decode_tok_s" else 0))
             / (decode if kind == "decode_tok_s" else wall)[name]
             for name in keys for kind in ("tok_s", "decode_tok_s")}
    return {**rates, "ratio": ratio(rates["spec_tok_s"], rates["plain_tok_s"]),
            "decode_ratio": ratio(rates["spec_decode_tok_s"], rates["plain_decode_tok_s"]),
            "acceptance": accepted / drafted if drafted else 0.0,
            "accepted_length": (accepted + verifies) / verifies if verifies else 1.0,
            "tokens": tokens["spec"]}


def batched(plain, spec, chats: list[list[dict]], params, log) -> dict[str, float]:
    """All chats submitted together: throughput of each engine over two runs, in the order
    plain, spec, spec, plain (so that the host's drift weighs on both alike)."""
    tokens = {"plain": 0, "spec": 0}
    wall = {"plain": 0.0, "spec": 0.0}
    for name, llm in (("plain", plain), ("spec", spec), ("spec", spec), ("plain", plain)):
        t0 = time.perf_counter()
        outs = llm.chat(chats, params)
        seconds = time.perf_counter() - t0
        count = sum(len(o.outputs[0].token_ids) for o in outs)
        tokens[name] += count
        wall[name] += seconds
        log(f"  {name}: {count / seconds:.1f} tok/s")
    result = {f"{name}_tok_s": tokens[name] / wall[name] for name in tokens}
    result["ratio"] = ratio(result["spec_tok_s"], result["plain_tok_s"])
    return result


def lossless(plain, spec, n: int, max_tokens: int, log, batching: bool = False
             ) -> dict[str, object]:
    """``n`` prompts (edits, prose, lists), 16 at a time, greedy: mismatching prompts
    (``spec`` drafts at any batch size). With ``batching``, also those where ``plain`` run one
    prompt at a time differs from ``plain`` run 16 at a time: what batch shape alone changes."""
    from engine import SamplingParams

    lists = [[{"role": "user", "content": f"List {k} {thing}, one per line, then repeat the "
               "list in reverse order."}] for k in range(3, 9)
             for thing in ["fruits", "rivers", "colours", "tools", "birds", "cities"]]
    chats = (edit_chats(n) + prose_chats(n) + lists)
    chats = [chats[i * len(chats) // n] for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    mismatches: list[int] = []
    alone: list[int] = []
    for start in range(0, n, 16):
        group = chats[start:start + 16]
        a = [o.outputs[0].token_ids for o in plain.chat(group, params)]
        b = [o.outputs[0].token_ids for o in spec.chat(group, params)]
        mismatches += [start + i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        if batching:
            c = [plain.chat([chat], params)[0].outputs[0].token_ids for chat in group]
            alone += [start + i for i, (x, y) in enumerate(zip(a, c, strict=True)) if x != y]
        log(f"  {min(start + 16, n)}/{n}: {len(mismatches)} mismatching"
            + (f" (plain one at a time: {len(alone)})" if batching else ""))
    result: dict[str, object] = {"prompts": n, "mismatches": mismatches,
                                 "identical": n - len(mismatches)}
    if batching:
        result["plain_one_at_a_time_mismatches"] = alone
    return result


VERIFY_ROUNDS = 5


def verify_cost(args, log) -> list[list[object]]:
    """A ``--verify-context``-token sequence decoding: the time of a step with K forced drafts,
    through the verify CUDA graph and run eagerly, against a plain decode step (a CUDA graph
    where there is one); each the median of ``VERIFY_ROUNDS`` rounds over every K."""
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(args.verify_model, tokenizer=args.tokenizer, device=args.device,
              dtype=args.dtype, quantization=quantization(args),
              num_kv_blocks=args.num_kv_blocks,
              speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    engine = llm.engine
    prompt = [100 + i % 1000 for i in range(args.verify_context)]
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    graphs = engine.runner.verify_graphs
    requests = itertools.count()

    def step_ms(k: int, eager: bool = False, steps: int = 30) -> float:
        """A fresh request of the prompt (its KV from the prefix cache after the first), so
        that every measurement starts at the same context."""
        def propose(running: list) -> None:
            for seq in running:
                seq.draft_token_ids = [seq.token_ids[-1]] * k
        for request_id in list(engine.requests):
            engine.abort(request_id)
        engine.speculator.propose = propose
        engine.speculator.active = lambda running, in_flight: False
        engine.add_request(f"v{next(requests)}", prompt, SamplingParams(
            temperature=0, max_tokens=100000, ignore_eos=True))
        engine.step()  # the prefill
        engine.speculator.active = lambda running, in_flight: k > 0  # K = 0: overlapped decode
        engine.runner.verify_graphs = None if eager else graphs
        for _ in range(3):
            engine.step()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        return (time.perf_counter() - t0) / steps * 1e3

    if graphs is not None:
        check_verify_graphs(engine, step_ms, log)
    # (K, eager): K = 0 is the decode step; eager apart only where there are verify graphs
    shapes = [(0, False)] + [(k, eager) for k in range(1, 9)
                             for eager in ((True, False) if graphs is not None else (True,))]
    times: dict[tuple[int, bool], list[float]] = {shape: [] for shape in shapes}
    for _ in range(VERIFY_ROUNDS):  # in turn, so that the host's drift weighs on all alike
        for k, eager in shapes:
            times[k, eager].append(step_ms(k, eager))
    ms = {shape: statistics.median(t) for shape, t in times.items()}
    decode = ms[0, False]
    rows = [["decode", "-", f"{decode:.2f}", "1.00", "-"]]
    for k in range(1, 9):
        eager = ms[k, True]
        cost = ms.get((k, False), eager)
        rows.append([f"verify K={k}", f"{eager:.2f}", f"{cost:.2f}", f"{cost / decode:.2f}",
                     f"{(1 + min(k, args.accepted_per_verify)) * decode / cost:.2f}"])
    log(table(rows, ["step", "eager ms", "graph ms", "graph vs decode",
                     "speed-up at the edit acceptance"]))
    return rows


def check_verify_graphs(engine, step_ms, log) -> None:
    """Run verify steps of K = 1, 3 and 8 drafts through the verify graph and eagerly (the
    eager result goes on) and log how their logits differ."""
    from benchmarks.graph_check import GraphVsEager

    with GraphVsEager(engine.runner, "verify_graphs") as check:
        for k in (1, 3, 8):
            step_ms(k, steps=3)
    log(check.summary("verify"))


def quantization(args: argparse.Namespace) -> str | None:
    return None if args.quantization == "none" else args.quantization


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder for a dummy model")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", default="auto", help="serving's default: auto")
    p.add_argument("--speculative-config", default='{"method": "ngram", '
                   '"num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    p.add_argument("--workloads", default="edit,prose,batch")
    p.add_argument("--prompts", type=int, default=32, help="one-stream prompts per workload")
    p.add_argument("--max-tokens", type=int, default=320)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--lossless", type=int, default=200)
    p.add_argument("--lossless-max-tokens", type=int, default=48)
    p.add_argument("--lossless-batching", action="store_true",
                   help="also compare plain decoding one prompt at a time with 16 at a time")
    p.add_argument("--verify-model", default=None, help="e.g. dummy:llama-3.1-8b (CUDA)")
    p.add_argument("--verify-context", type=int, default=1024)
    p.add_argument("--accepted-per-verify", type=float, default=None,
                   help="drafts accepted per verify for the implied speed (default: the edit "
                        "workload's, measured in this run)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks of each engine (default: 16384 on CUDA, where several "
                        "engines share the device; the CPU budget otherwise)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, 48 tokens")
    add_out_argument(p)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.concurrency, args.lossless = 2, 48, 4, 16
    log, stem = open_log(args.out, "spec_decode", args.quick, argv)
    from engine import LLM, SamplingParams

    workloads = args.workloads.split(",")
    if args.num_kv_blocks is None and args.device and args.device.startswith("cuda"):
        args.num_kv_blocks = 16384
    options = dict(device=args.device, dtype=args.dtype, tokenizer=args.tokenizer,
                   quantization=quantization(args), num_kv_blocks=args.num_kv_blocks)
    spec_config = json.loads(args.speculative_config)
    needs_engines = set(workloads) & {"edit", "prose", "batch", "lossless"}
    plain = LLM(args.model, **options) if needs_engines else None
    spec = LLM(args.model, speculative_config=spec_config, **options) if needs_engines else None
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results: dict[str, object] = {"machine": machine_info(), "speculative_config": spec_config}
    rows = []
    for name, chats in (("edit", edit_chats(args.prompts)), ("prose", prose_chats(args.prompts))):
        if name in workloads:
            log(f"{name}, one stream, {len(chats)} prompts ...")
            r = one_stream(plain, spec, chats, params, log)
            results[name] = r
            rows.append([name, f"{r['plain_tok_s']:.1f}", f"{r['spec_tok_s']:.1f}",
                         f"{r['ratio']:.2f}", f"{r['decode_ratio']:.2f}",
                         f"{r['acceptance']:.2f}", f"{r['accepted_length']:.2f}"])
    if "batch" in workloads:
        half = args.concurrency // 2
        chats = edit_chats(half) + prose_chats(args.concurrency - half)
        log(f"batch of {len(chats)} ...")
        r = batched(plain, spec, chats, params, log)
        results["batch"] = r
        rows.append([f"concurrency {len(chats)}", f"{r['plain_tok_s']:.1f}",
                     f"{r['spec_tok_s']:.1f}", f"{r['ratio']:.2f}", "-", "-", "-"])
    if rows:
        log(table(rows, ["workload", "plain tok/s", "spec tok/s", "ratio", "decode ratio",
                         "acceptance", "tokens per verify"]))
    if "lossless" in workloads:
        log(f"lossless: {args.lossless} prompts ...")
        anywhere = LLM(args.model, speculative_config={
            **spec_config, "prompt_lookup_min": 1, "disable_by_batch_size": 64}, **options)
        results["lossless"] = r = lossless(plain, anywhere, args.lossless,
                                           args.lossless_max_tokens, log,
                                           args.lossless_batching)
        log(f"lossless: {r['identical']}/{r['prompts']} identical; mismatching: "
            f"{r['mismatches']}")
        if args.lossless_batching:
            log(f"plain one prompt at a time vs 16 at a time: "
                f"{len(r['plain_one_at_a_time_mismatches'])} mismatching: "
                f"{r['plain_one_at_a_time_mismatches']}")
    if args.verify_model:
        if args.accepted_per_verify is None:
            edit = results.get("edit")
            args.accepted_per_verify = (edit["accepted_length"] - 1) if edit else 2.0
        del plain, spec
        results["verify"] = verify_cost(args, log)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
