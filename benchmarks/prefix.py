"""Prefill work saved by prefix caching and pinned sessions, on the real engine (SmolLM2, CPU).

(1) Shared system prompt: one ~1,000-token system prompt, 64 users each asking a short
    question; the users arrive one after another (each request runs to its first tokens before
    the next arrives). Engines with prefix caching on and off are loaded side by side and the
    users alternate between them (user i on "on", then user i on "off", ...), so background
    load hits both alike. Reported: model-computed prefill tokens (the engine's
    ``num_prefill_tokens_computed`` counter), time to first token (TTFT) per user, and whether
    the greedy answers agree.

(2) Multi-turn: several 10-turn conversations at once (each turn of every conversation submitted
    together), greedy answers fed back into the history, under three engines turn by turn:
    pinned sessions (``session_id``), prefix caching only, no caching. Per turn: tokens computed
    by the model per conversation, the turn's new tokens (its prompt minus the previous prompt
    and answer), and TTFT.

    python benchmarks/prefix.py             # full run (several minutes on 2 cores)
    python benchmarks/prefix.py --quick     # a tiny run; the smoke test
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks._common import (  # noqa: E402
    Run,
    Tee,
    add_out_argument,
    args_json,
    mean,
    percentile,
    ratio,
)
from engine.outputs import merge_outputs  # noqa: E402

TOPICS = [
    "billing", "refunds", "shipping", "passwords", "two-factor login", "API keys", "rate limits",
    "invoices", "data export", "account deletion", "team seats", "SSO", "webhooks", "outages",
    "mobile app", "browser support", "privacy", "GDPR requests", "pricing tiers", "discounts",
]

QUESTIONS = [
    "How do I reset my password?", "Can I get a refund for last month?",
    "Why was my card declined?", "How do I add a teammate?", "Where is my invoice?",
    "Is there an API rate limit?", "How do I export my data?", "Can I change my plan?",
    "What is your uptime?", "Do you support SSO with Okta?", "How do I delete my account?",
    "Can I pay yearly?", "Is my data encrypted?", "How do webhooks retry?",
    "Why am I logged out?", "What browsers work best?",
]

FOLLOW_UPS = [
    "Tell me about the history of the printing press.",
    "Why did it spread so quickly across Europe?",
    "Which cities became printing centres, and why?",
    "How did it change the way scientists shared results?",
    "What role did it play in the Reformation?",
    "How did censorship respond?",
    "Compare that with how the internet spread.",
    "What are the main differences in speed?",
    "Summarise our conversation in three bullet points.",
    "Thanks! One last question: what should I read next?",
    "Could you expand on the second point?",
    "Give me a short quiz on this topic.",
]


def system_prompt(tokenizer, target_tokens: int, seed: int) -> str:
    """A deterministic support-desk policy text of about ``target_tokens`` tokens."""
    rng = random.Random(seed)
    lines = ["You are the support assistant of Acme Cloud. Follow this policy exactly."]
    i = 0
    while len(tokenizer.encode("\n".join(lines), add_special_tokens=False)) < target_tokens:
        topic = TOPICS[i % len(TOPICS)]
        lines.append(f"Rule {i + 1} ({topic}): when a customer asks about {topic}, first confirm "
                     f"their account email, then explain the {topic} policy in at most "
                     f"{rng.randint(2, 5)} sentences, link section {rng.randint(1, 40)}."
                     f"{rng.randint(1, 9)} of the handbook, and never promise more than "
                     f"{rng.randint(5, 30)} days.")
        i += 1
    return "\n".join(lines)


def first_token_times(engine, submitted: dict[str, float]) -> tuple[dict[str, float], dict]:
    """Step until every request in ``submitted`` has finished; TTFT per request id and the
    whole outputs (each request's deltas merged)."""
    ttft: dict[str, float] = {}
    outputs: dict = {}
    while any(r not in outputs or not outputs[r].finished for r in submitted):
        for out in engine.step():
            if out.request_id not in submitted:
                continue
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = time.perf_counter() - submitted[out.request_id]
            if out.request_id in outputs:
                merge_outputs(outputs[out.request_id], out)
            else:
                outputs[out.request_id] = out
    return ttft, outputs


# -- (1) shared system prompt -------------------------------------------------------------------

def shared_prompt(llms: dict, users: int, sys_tokens: int, max_tokens: int, seed: int,
                  log: Tee, off_every: int = 1) -> dict:
    """Every user runs with caching on; every ``off_every``-th user also runs with it off
    (caching off computes each prompt in full, so the sample gives its TTFT; its prefill total
    over all users is the sum of the prompt lengths, checked on the sampled users)."""
    from engine import SamplingParams

    tok = next(iter(llms.values())).tokenizer
    system = system_prompt(tok, sys_tokens, seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    res = {name: {"ttft": [], "prefill": [], "cached": [], "prompt": [], "answers": []}
           for name in llms}
    for u in range(users):
        conv = [{"role": "system", "content": system},
                {"role": "user", "content": f"(user {u}) {QUESTIONS[u % len(QUESTIONS)]}"}]
        names = list(llms) if u % 2 == 0 else list(reversed(llms))
        if u % off_every:
            names = [n for n in names if n != "off"]
        for name in names:
            llm = llms[name]
            engine = llm.engine
            ids = engine.render_chat(conv)
            before = llm.stats().num_prefill_tokens_computed
            rid = f"sp-{name}-{u}"
            t = time.perf_counter()
            engine.add_request(rid, ids, params)
            ttft, outs = first_token_times(engine, {rid: t})
            r = res[name]
            r["ttft"].append(ttft[rid])
            r["prefill"].append(llm.stats().num_prefill_tokens_computed - before)
            r["cached"].append(outs[rid].num_cached_tokens)
            r["prompt"].append(len(ids))
            r["answers"].append(outs[rid].outputs[0].token_ids)
            r.setdefault("users", []).append(u)
        if u % off_every == 0:
            log(f"  user {u + 1}/{users}: prompt {res['on']['prompt'][-1]} tokens; computed "
                f"on {res['on']['prefill'][-1]} / off {res['off']['prefill'][-1]}; TTFT on "
                f"{res['on']['ttft'][-1] * 1e3:.0f} ms / off {res['off']['ttft'][-1] * 1e3:.0f} ms")
    res["all_prompt_tokens"] = sum(res["on"]["prompt"])
    return res


# -- (2) multi-turn -----------------------------------------------------------------------------

def multi_turn(llms: dict, convs: int, turns: int, max_tokens: int, log: Tee) -> dict:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    histories = {name: [[{"role": "system",
                          "content": f"You are a friendly history tutor (conversation {c})."}]
                         for c in range(convs)] for name in llms}
    prev_len = {name: [0] * convs for name in llms}
    res = {name: {"computed": [], "new": [], "ttft": [], "cached": [], "prompt": []}
           for name in llms}
    for turn in range(turns):
        order = list(llms) if turn % 2 == 0 else list(reversed(llms))
        for name in order:
            llm = llms[name]
            engine = llm.engine
            sessions = name == "sessions"
            submitted: dict[str, float] = {}
            new_tokens, prompts = [], []
            before = llm.stats().num_prefill_tokens_computed
            for c in range(convs):
                hist = histories[name][c]
                hist.append({"role": "user",
                             "content": FOLLOW_UPS[(turn + c) % len(FOLLOW_UPS)]})
                sid = f"conv-{c}" if sessions else None
                ids = engine.render_chat(hist, sid)
                new_tokens.append(len(ids) - prev_len[name][c])
                prompts.append(len(ids))
                rid = f"mt-{name}-{turn}-{c}"
                submitted[rid] = time.perf_counter()
                engine.add_request(rid, ids, params, session_id=sid)
            ttft, outs = first_token_times(engine, submitted)
            computed = llm.stats().num_prefill_tokens_computed - before
            for c in range(convs):
                out = outs[f"mt-{name}-{turn}-{c}"]
                histories[name][c].append({"role": "assistant", "content": out.outputs[0].text})
                prev_len[name][c] = prompts[c] + len(out.outputs[0].token_ids)
            r = res[name]
            r["computed"].append(computed / convs)
            r["new"].append(mean(new_tokens))
            r["ttft"].append(mean(ttft.values()))
            r["cached"].append(mean(o.num_cached_tokens for o in outs.values()))
            r["prompt"].append(mean(prompts))
        log(f"  turn {turn + 1}/{turns}: prompt ≈ {res['none']['prompt'][-1]:.0f} tokens, new "
            f"{res['sessions']['new'][-1]:.0f}; computed sessions "
            f"{res['sessions']['computed'][-1]:.0f} / prefix {res['prefix']['computed'][-1]:.0f}"
            f" / none {res['none']['computed'][-1]:.0f}; TTFT "
            f"{res['sessions']['ttft'][-1] * 1e3:.0f} / {res['prefix']['ttft'][-1] * 1e3:.0f} / "
            f"{res['none']['ttft'][-1] * 1e3:.0f} ms")
    for name, llm in llms.items():
        if name == "sessions":
            for c in range(convs):
                llm.unpin_session(f"conv-{c}")
    return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--off-every", type=int, default=16,
                    help="run every N-th user with caching off too (1 = all users; off costs a "
                         "full prefill per user, minutes on 2 cores)")
    ap.add_argument("--answer-tokens", type=int, default=4,
                    help="max_tokens per user in (1) (TTFT is what is measured)")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--turn-tokens", type=int, default=16, help="max_tokens per answer in (2)")
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--skip-shared", action="store_true")
    ap.add_argument("--skip-turns", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a tiny run (smoke test)")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.users, args.system_tokens, args.answer_tokens, args.off_every = 3, 64, 2, 1
        args.conversations, args.turns, args.turn_tokens = 1, 3, 4
        args.num_kv_blocks = 64
    return args


def warm_engines(args: argparse.Namespace, caching: dict[str, bool]) -> dict:
    """One engine per name, prefix caching as given, each warmed by one tiny request (first-call
    overheads, not counted)."""
    from engine import LLM

    llms = {name: LLM(args.model, num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=on,
                      seed=args.seed) for name, on in caching.items()}
    for llm in llms.values():
        llm.generate([[1, 2, 3]], None)
    return llms


def plot(run: Run, args: argparse.Namespace, shared: dict | None, turns: dict | None) -> None:
    def per_turn(ax1, ax2) -> None:
        xs = list(range(1, args.turns + 1))
        labels = {"sessions": "pinned sessions", "prefix": "prefix caching only",
                  "none": "no caching"}
        for name, label in labels.items():
            ax1.plot(xs, [t * 1e3 for t in turns[name]["ttft"]], marker="o", label=label)
            ax2.plot(xs, turns[name]["computed"], marker="o", label=label)
        ax2.plot(xs, turns["sessions"]["new"], ls=":", color="k", label="new tokens of the turn")
        ax1.set(xlabel="turn", ylabel="TTFT (ms, mean over conversations)",
                title=f"TTFT per turn ({args.conversations} conversations at once)")
        ax2.set(xlabel="turn", ylabel="prefill tokens computed per conversation",
                title="tokens computed per turn")

    def per_user(ax) -> None:
        ax.plot([u + 1 for u in shared["on"]["users"]], [t * 1e3 for t in shared["on"]["ttft"]],
                marker=".", label="prefix caching on")
        ax.plot([u + 1 for u in shared["off"]["users"]],
                [t * 1e3 for t in shared["off"]["ttft"]], marker="o", label="off")
        ax.set(xlabel="user", ylabel="TTFT (ms)", yscale="log",
               title=f"shared {args.system_tokens}-token system prompt: TTFT per user")

    if turns is not None:
        run.plot(f"{run.stem}_turns.png", per_turn, ncols=2, figsize=(12, 4.2))
    if shared is not None:
        run.plot(f"{run.stem}_shared.png", per_user)


def report_shared(run: Run, args: argparse.Namespace, shared: dict) -> None:
    on, off = shared["on"], shared["off"]
    # caching off computes every prompt token: verified on the users it ran
    off_exact = all(c == p for c, p in zip(off["prefill"], off["prompt"], strict=True))
    off_total = shared["all_prompt_tokens"] if off_exact else float("nan")
    cut = 1 - ratio(sum(on["prefill"]), off_total)
    paired = {u: i for i, u in enumerate(on["users"])}
    same = sum(on["answers"][paired[u]] == a for u, a in zip(off["users"], off["answers"],
                                                              strict=True))
    on_paired = [on["ttft"][paired[u]] for u in off["users"]]
    on_later = on["ttft"][1:]
    run.section(
        f"(1) shared system prompt ({mean(on['prompt']):.0f}-token prompts, "
        f"{args.users} users one at a time; caching off run on {len(off['users'])} of them)", [
            ["prefill tokens computed, all users", sum(on["prefill"]), off_total,
             f"{cut:.1%} fewer"],
            ["prefill tokens computed, user 1", on["prefill"][0], off["prefill"][0], ""],
            ["prefill tokens computed, users 2.. (mean)", mean(on["prefill"][1:]),
             mean(off["prompt"]), ""],
            ["cached tokens per user (mean)", mean(on["cached"]), mean(off["cached"]), ""],
            ["TTFT p50 (ms), users 2..", percentile(on_later, 50) * 1e3,
             percentile(off["ttft"], 50) * 1e3,
             f"{ratio(percentile(off['ttft'], 50), percentile(on_later, 50)):.1f}× faster"],
            ["TTFT p99 (ms), users 2..", percentile(on_later, 99) * 1e3,
             percentile(off["ttft"], 99) * 1e3, ""],
            ["TTFT mean (ms), same users", mean(on_paired) * 1e3, mean(off["ttft"]) * 1e3,
             f"{ratio(mean(off['ttft']), mean(on_paired)):.1f}× faster"],
            ["greedy answers identical", f"{same}/{len(off['users'])}", "", ""],
        ], ["figure", "caching on", "caching off", "saving"])
    run(f"off computes the full prompt on every user it ran: {off_exact}")
    run(f"target prefill cut ≥ 90%: {cut:.1%} — {'met' if cut >= 0.9 else 'MISSED'}")


def report_turns(run: Run, args: argparse.Namespace, turns: dict) -> None:
    s, p, n = turns["sessions"], turns["prefix"], turns["none"]
    rows = [[t + 1, f"{n['prompt'][t]:.0f}", f"{s['new'][t]:.0f}", f"{s['computed'][t]:.0f}",
             f"{p['computed'][t]:.0f}", f"{n['computed'][t]:.0f}", s["ttft"][t] * 1e3,
             p["ttft"][t] * 1e3, n["ttft"][t] * 1e3, f"{ratio(n['ttft'][t], s['ttft'][t]):.1f}×"]
            for t in range(args.turns)]
    run.section(f"(2) multi-turn: {args.conversations} conversations × {args.turns} turns "
                f"(per conversation, mean)", rows,
                ["turn", "prompt", "new", "computed: sessions", "prefix", "none",
                 "TTFT ms: sessions", "prefix", "none", "none/sessions"])
    extra = [s["computed"][t] - s["new"][t] for t in range(1, args.turns)]
    exact = all(0 <= e <= 1 for e in extra)
    last = args.turns - 1
    ttft_ratio = ratio(s["ttft"][last], n["ttft"][last])
    run(f"target: from turn 2 computed = the turn's new tokens with sessions: computed − new "
        f"per turn {[round(e, 2) for e in extra]} — "
        f"{'met' if exact else 'MISSED'} (the +1 is the previous answer's last token, "
        f"sampled but never fed back)")
    run(f"target: TTFT turn {last + 1} with sessions ≤ 1/3 of no-cache: "
        f"{s['ttft'][last] * 1e3:.0f} ms vs {n['ttft'][last] * 1e3:.0f} ms = "
        f"{ttft_ratio:.2f} — {'met' if ttft_ratio <= 1 / 3 else 'MISSED'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args.out, "prefix", quick=args.quick, argv=argv)
    raw: dict = {"args": args_json(args)}
    shared = turns = None
    if not args.skip_shared:
        run(f"\n## (1) one ~{args.system_tokens}-token system prompt, {args.users} users")
        llms = warm_engines(args, {"on": True, "off": False})
        shared = raw["shared"] = shared_prompt(llms, args.users, args.system_tokens,
                                               args.answer_tokens, args.seed, run,
                                               args.off_every)
        del llms
    if not args.skip_turns:
        run(f"\n## (2) {args.conversations} conversations × {args.turns} turns, "
            f"{args.turn_tokens}-token answers")
        llms = warm_engines(args, {"sessions": True, "prefix": True, "none": False})
        turns = raw["turns"] = multi_turn(llms, args.conversations, args.turns,
                                          args.turn_tokens, run)
        del llms
    run.write_json(raw, indent=1)
    plot(run, args, shared, turns)
    if shared is not None:
        report_shared(run, args, shared)
    if turns is not None:
        report_turns(run, args, turns)
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
