"""Structured outputs: JSON-schema decoding against unconstrained decoding of the same requests.

``--num-requests`` chat requests (all submitted together, so the engine batches them) ask for a
person as JSON. (a) under a JSON schema (xgrammar: a token bitmask per row per step); then
(b) unconstrained, each request forced (``ignore_eos``) to exactly the token count it had in
(a), so both generate the same tokens per request. Prints tokens/s of each (the best of
``--repeat`` alternating runs), their ratio, the median of each repeat's own (a)/(b) (a run's
two halves are next to each other in time, so the host's drift cancels more), and how many
outputs of (a) and of a free run (c: unconstrained, the model's own stop) parse as
the schema. A warm-up run compiles the grammar first. Results: ``structured.txt``/``.json``.

    python benchmarks/structured.py                       # SmolLM2 on CPU, 64 requests
    python benchmarks/structured.py --device cuda --dtype bfloat16 --repeat 3 \
        --model dummy:llama-3.1-8b --tokenizer DIR     # 8B shapes, SmolLM2's tokenizer
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks._common import add_out_argument, machine_info, open_log, ratio, table  # noqa: E402

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "birth_year": {"type": "integer", "minimum": 0, "maximum": 3000},
                         "field": {"type": "string", "maxLength": 40}},
          "required": ["name", "birth_year", "field"], "additionalProperties": False}
PEOPLE = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Marie Curie", "Isaac Newton",
          "Nikola Tesla", "Rosalind Franklin", "Charles Darwin", "Emmy Noether", "Leonhard Euler",
          "Katherine Johnson", "Albert Einstein", "Barbara McClintock", "Carl Gauss",
          "Lise Meitner", "John von Neumann"]


def conversations(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Give {PEOPLE[i % len(PEOPLE)]}'s name, birth year "
              "and field as a JSON object."}] for i in range(n)]


def valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"])
            and isinstance(value["birth_year"], int))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer folder (for a dummy model: it borrows one)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=1,
                   help="time (a) and (b) this many times, alternately; the best of each counts")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 requests")
    add_out_argument(p)
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_tokens = 4, 128
    log, stem = open_log(args.out, "structured", args.quick, argv)  # creates args.out

    from engine import LLM, SamplingParams
    from engine.structured_output import StructuredOutput

    llm = LLM(args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype)
    convs = conversations(args.num_requests)
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))

    def params(**kw) -> SamplingParams:
        return SamplingParams(temperature=0.7, seed=kw.pop("seed", 0), **kw)

    def timed(label: str, plist: list[SamplingParams]) -> tuple[float, list]:
        t0 = time.perf_counter()
        outs = llm.chat(convs, plist)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        log(f"  {label}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tok/s")
        return tokens / wall, outs

    log("warm-up (grammar compiled, kernels used) ...")
    llm.chat(convs[:2], params(max_tokens=8, structured=spec))
    schema_tok_s = free_tok_s = 0.0
    pair_ratios = []  # (a)/(b) of each repeat: the two runs next to each other in time
    for _ in range(args.repeat):
        tok_s, constrained = timed("(a) JSON schema", [
            params(seed=i, max_tokens=args.max_tokens, structured=spec)
            for i in range(len(convs))])
        schema_tok_s = max(schema_tok_s, tok_s)
        lengths = [len(o.outputs[0].token_ids) for o in constrained]
        paired, _ = timed("(b) unconstrained, same token counts", [
            params(seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)])
        free_tok_s = max(free_tok_s, paired)
        pair_ratios.append(ratio(tok_s, paired))
    _, free = timed("(c) unconstrained, own stop", [
        params(seed=i, max_tokens=args.max_tokens) for i in range(len(convs))])
    valid_a = sum(valid(o.outputs[0].text) for o in constrained)
    valid_c = sum(valid(o.outputs[0].text) for o in free)
    rows = [["(a) JSON schema", f"{schema_tok_s:.1f}", f"{ratio(schema_tok_s, free_tok_s):.2f}",
             f"{valid_a}/{len(convs)}"],
            ["(b) unconstrained, same tokens", f"{free_tok_s:.1f}", "1.00", "-"],
            ["(c) unconstrained, own stop", "-", "-", f"{valid_c}/{len(convs)}"]]
    log(table(rows, ["run", "tok/s", "vs (b)", "valid for the schema"]))
    log(f"(a)/(b) of each repeat: median {statistics.median(pair_ratios):.2f} over "
        f"{len(pair_ratios)} (range {min(pair_ratios):.2f}-{max(pair_ratios):.2f})")
    (args.out / f"{stem}.json").write_text(json.dumps({
        "argv": sys.argv[1:] if argv is None else argv, "machine": machine_info(),
        "schema_tok_s": schema_tok_s, "unconstrained_tok_s": free_tok_s,
        "ratio": ratio(schema_tok_s, free_tok_s),
        "median_repeat_ratio": statistics.median(pair_ratios), "valid_schema": valid_a,
        "valid_unconstrained": valid_c, "num_requests": len(convs)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
