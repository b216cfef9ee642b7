"""Scale-out and failover, measured on the real pieces: 3 ``chatgate serve`` replicas behind
HAProxy (deploy/haproxy.cfg) sharing one private Redis, all on loopback
(tests/scale_cluster.py).

1. Affinity: ``--sessions`` chat sessions (default 32, all concurrent) hold ``--turns`` turns
   each with every replica up; the share of turns answered by the replica of the session's
   first turn.
2. Failover: during the next turn (longer answers) the replica holding the most sessions is
   SIGKILLed (gateway and engine process) while its streams produce tokens. Reported: turns
   lost (acknowledged to the client but missing from Redis), how long the dead replica's
   streams took to end and how they ended, and when HAProxy marked it down.
3. Cost of the move: the moved sessions' next turn (on another replica: it computes their
   whole history, less any prefix blocks it already caches) and the turn after (only its new
   tokens), beside the same turns of sessions that stayed, and their time to first token.
4. Rejoin: the killed replica is restarted; the time until HAProxy sends it traffic again and
   how many sessions return to it.
5. One session alone: the time cost of a move without other load (its replica is SIGKILLed
   between two turns).

Prints the tables and writes ``{out}/failover.txt`` and ``failover.json``.

    python benchmarks/failover.py            # ~3-4 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # the test machinery

import httpx  # noqa: E402
from scale_cluster import (  # noqa: E402
    ChatSession,
    Cluster,
    TurnResult,
    stored_messages,
    stream_turn,
)

from benchmarks._common import add_out_argument, open_log, table  # noqa: E402

TOPICS = ["the water cycle", "how a CPU cache works", "the history of Rome", "photosynthesis",
          "how vaccines work", "plate tectonics", "the French revolution", "black holes"]


async def wave(client: httpx.AsyncClient, cluster: Cluster, sessions: list[ChatSession],
               turn: int, max_tokens: int, started: dict[str, asyncio.Event] | None = None,
               ignore_eos: bool = True) -> dict[str, TurnResult]:
    """One turn of every session at once; session id → result."""
    def user(i: int) -> str:
        return (f"I am user {i}. Turn {turn}: tell me something about "
                f"{TOPICS[(i + turn) % len(TOPICS)]}.")

    results = await asyncio.gather(*[
        stream_turn(client, cluster.url, s, user(i), max_tokens,
                    started[s.id] if started else None, ignore_eos)
        for i, s in enumerate(sessions)])
    return {s.id: r for s, r in zip(sessions, results, strict=True)}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def affinity(client: httpx.AsyncClient, cluster: Cluster, sessions: list[ChatSession],
                   n_turns: int, max_tokens: int, log) -> list[dict[str, TurnResult]]:
    """1. ``n_turns`` waves with every replica up: the turns' results, wave by wave."""
    history = [await wave(client, cluster, sessions, t, max_tokens) for t in range(n_turns)]
    failed = sum(not r.acknowledged for w in history for r in w.values())
    home = {s.id: s.replicas[0] for s in sessions}
    on_home = sum(r == home[s.id] for s in sessions for r in s.replicas)
    total = sum(len(s.replicas) for s in sessions)
    spread = Counter(home.values())
    log(f"\n## 1. affinity: {len(sessions)} sessions x {n_turns} turns, all replicas up")
    log(f"turns on the session's first replica: {on_home}/{total} "
        f"({100 * on_home / total:.1f} %); failed turns: {failed}; sessions per replica: "
        + ", ".join(f"{k} {v}" for k, v in sorted(spread.items())))
    return history


async def kill_mid_turn(client: httpx.AsyncClient, cluster: Cluster,
                        sessions: list[ChatSession], home: dict[str, str], victim: str,
                        n_turns: int, long_tokens: int, log) -> tuple[dict, dict]:
    """2. SIGKILL ``victim`` while its sessions stream turn ``n_turns + 1``: the figures, and
    that turn's results."""
    moved = [s for s in sessions if home[s.id] == victim]
    stayed = [s for s in sessions if home[s.id] != victim]
    started = {s.id: asyncio.Event() for s in sessions}
    # Answers may end at EOS here: an answer generated past it would not re-render to the
    # same tokens, and the stayed sessions' next turn would recompute from there.
    load = asyncio.ensure_future(wave(client, cluster, sessions, n_turns, long_tokens,
                                      started, ignore_eos=False))
    await asyncio.gather(*[started[s.id].wait() for s in moved])
    killed_at = cluster.replica(victim).kill()
    marked_down = asyncio.ensure_future(asyncio.to_thread(cluster.wait_state, victim, "DOWN"))
    killed_wave = await load
    down_s = await marked_down - killed_at
    cut = [killed_wave[s.id] for s in moved if not killed_wave[s.id].acknowledged]
    end_s = [r.ended_at - killed_at for r in cut]
    errors = Counter((r.error or "").split(":")[0] for r in cut)
    lost = sum(stored_messages(cluster, s.id)[: len(s.messages)] != s.messages
               for s in sessions)
    stayed_ok = sum(killed_wave[s.id].acknowledged and killed_wave[s.id].replica ==
                    home[s.id] for s in stayed)
    log(f"\n## 2. SIGKILL of {victim} ({len(moved)} sessions) during turn {n_turns + 1} "
        f"({long_tokens}-token answers), concurrency {len(sessions)}")
    log(f"streams on {victim} when killed: {len(cut)} cut, "
        f"{len(moved) - len(cut)} had finished; cut streams ended "
        f"{min(end_s, default=float('nan')):.3f}-{max(end_s, default=float('nan')):.3f} s "
        f"after the kill, with: " + ", ".join(f"{k} x{v}" for k, v in errors.items()))
    log(f"HAProxy marked {victim} DOWN {down_s:.2f} s after the kill "
        "(checks every 1 s, a second one 250 ms after a failure, fall 2)")
    log(f"acknowledged turns missing from Redis: {lost}; other sessions' turns answered "
        f"by their own replica: {stayed_ok}/{len(stayed)}")
    return {"moved_sessions": len(moved), "cut_streams": len(cut), "stream_end_s": end_s,
            "stream_errors": dict(errors), "marked_down_s": down_s,
            "acknowledged_lost": lost}, killed_wave


def new_tokens(r: TurnResult, before: TurnResult) -> int:
    """Tokens the client added since ``before``: the end of the last answer, the new user
    message and the generation prompt."""
    return r.prompt_tokens - before.prompt_tokens - before.completion_tokens


async def move_cost(client: httpx.AsyncClient, cluster: Cluster, sessions: list[ChatSession],
                    home: dict[str, str], victim: str, prev: dict[str, TurnResult],
                    n_turns: int, max_tokens: int, log) -> tuple[dict, list[list]]:
    """3. The moved sessions' next turn and the turn after, beside the sessions that stayed:
    the figures and the table's rows."""
    moved = [s for s in sessions if home[s.id] == victim]
    stayed = [s for s in sessions if home[s.id] != victim]
    moved_turn = await wave(client, cluster, sessions, n_turns + 1, max_tokens)
    after_turn = await wave(client, cluster, sessions, n_turns + 2, max_tokens)
    ok_moved = sum(moved_turn[s.id].acknowledged and moved_turn[s.id].replica != victim
                   for s in moved)
    same = sum(after_turn[s.id].replica == moved_turn[s.id].replica for s in moved)
    rows = []
    for label, group in (("moved", moved), ("stayed", stayed)):
        for name, turn_of, before_of in (("next turn", moved_turn, prev),
                                         ("turn after", after_turn, moved_turn)):
            rs = [turn_of[s.id] for s in group]
            rows.append([
                f"{label}: {name}", len(rs),
                median([r.prompt_tokens for r in rs]),
                median([r.cached_tokens for r in rs]),
                median([r.computed_tokens for r in rs]),
                median([new_tokens(turn_of[s.id], before_of[s.id]) for s in group]),
                median([r.ttft_s for r in rs if r.ttft_s is not None]),
            ])
    log(f"\n## 3. the moved sessions' next turn and the turn after "
        f"({max_tokens}-token answers, all {len(sessions)} sessions at once; medians)")
    log(f"moved sessions' next turn answered by another replica: {ok_moved}/{len(moved)}; "
        f"turn after on that same replica: {same}/{len(moved)}")
    log(table(rows, ["turn", "n", "prompt", "cached", "computed", "new tokens", "TTFT s"]))
    log("computed = prompt - cached (the prompt tokens the replica ran through the "
        "model); new tokens = prompt - last turn's prompt - last turn's answer")
    return {"moved_next_turn_ok": ok_moved, "turn_after_same_replica": same}, rows


async def rejoin(client: httpx.AsyncClient, cluster: Cluster, sessions: list[ChatSession],
                 home: dict[str, str], victim: str, turn: int, max_tokens: int,
                 log) -> tuple[dict, dict[str, TurnResult]]:
    """4. Restart ``victim``: the figures, and the results of the turn after it is up."""
    moved = [s for s in sessions if home[s.id] == victim]
    stayed = [s for s in sessions if home[s.id] != victim]
    restarted_at = time.monotonic()
    cluster.replica(victim).launch()
    up_s = await asyncio.to_thread(cluster.wait_state, victim, "UP", 300) - restarted_at
    back = await wave(client, cluster, sessions, turn, max_tokens)
    returned = sum(back[s.id].replica == victim for s in moved)
    others_kept = sum(back[s.id].replica == home[s.id] for s in stayed)
    log(f"\n## 4. {victim} restarted: HAProxy sent it traffic {up_s:.1f} s later "
        f"(model load + 2 good checks); {returned}/{len(moved)} of its sessions returned "
        f"to it, {others_kept}/{len(stayed)} others kept their replica; failed turns: "
        f"{sum(not r.acknowledged for r in back.values())}")
    return {"restart_to_up_s": up_s, "returned": returned}, back


async def alone(client: httpx.AsyncClient, cluster: Cluster, session: ChatSession,
                where: str, turn: int, max_tokens: int, log) -> list[list]:
    """5. One session without other load: its turn where it is pinned, then its replica dies
    and the next turn moves, then the turn after. The table's rows."""
    solo = [(await wave(client, cluster, [session], turn, max_tokens))[session.id]]
    cluster.replica(where).kill()
    for t in (turn + 1, turn + 2):
        solo.append((await wave(client, cluster, [session], t, max_tokens))[session.id])
    rows = [[name, r.replica, r.prompt_tokens, r.cached_tokens, r.computed_tokens,
             r.ttft_s, "yes" if r.acknowledged else r.error]
            for name, r in zip(("pinned turn", "moved turn", "turn after"), solo, strict=True)]
    log(f"\n## 5. one session alone (no other load): {where} is SIGKILLed between its "
        "pinned turn and the next; the next turn is sent at once (before HAProxy marks "
        f"{where} down: the refused connection is redispatched)")
    log(table(rows, ["turn", "replica", "prompt", "cached", "computed", "TTFT s", "answered"]))
    return rows


async def run(cluster: Cluster, n_sessions: int, n_turns: int, max_tokens: int,
              long_tokens: int, log) -> dict:
    prefix = uuid.uuid4().hex[:6]
    sessions = [ChatSession(f"bench-{prefix}-{i}") for i in range(n_sessions)]
    async with httpx.AsyncClient(timeout=600) as client:
        history = await affinity(client, cluster, sessions, n_turns, max_tokens, log)
        home = {s.id: s.replicas[0] for s in sessions}
        on_home = sum(r == home[s.id] for s in sessions for r in s.replicas)
        total = sum(len(s.replicas) for s in sessions)
        spread = Counter(home.values())
        victim = spread.most_common(1)[0][0]
        killed, killed_wave = await kill_mid_turn(client, cluster, sessions, home, victim,
                                                  n_turns, long_tokens, log)
        prev = {s.id: (killed_wave[s.id] if killed_wave[s.id].acknowledged
                       else history[-1][s.id]) for s in sessions}
        cost, rows = await move_cost(client, cluster, sessions, home, victim, prev, n_turns,
                                     max_tokens, log)
        back_figures, back = await rejoin(client, cluster, sessions, home, victim,
                                          n_turns + 3, max_tokens, log)
        stayed = [s for s in sessions if home[s.id] != victim]
        session = max(stayed, key=lambda s: len(s.messages))
        where = back[session.id].replica
        assert where is not None
        solo_rows = await alone(client, cluster, session, where, n_turns + 4, max_tokens, log)
    return {
        "sessions": n_sessions, "turns": n_turns,
        "affinity": on_home / total, "spread": dict(spread), "victim": victim,
        **killed, **cost,
        "cost": [dict(zip(["turn", "n", "prompt", "cached", "computed", "new_tokens",
                           "ttft_s"], r, strict=True)) for r in rows],
        **back_figures,
        "solo": [dict(zip(["turn", "replica", "prompt", "cached", "computed", "ttft_s",
                           "answered"], r, strict=True)) for r in solo_rows],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=32, help="concurrent chat sessions")
    ap.add_argument("--turns", type=int, default=4, help="turns before the kill")
    ap.add_argument("--max-tokens", type=int, default=24, help="answer length of a turn")
    ap.add_argument("--long-tokens", type=int, default=96,
                    help="answer length of the turn during which the replica dies")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log, stem = open_log(args.out, "failover", False, argv)
    with tempfile.TemporaryDirectory() as work:
        cluster = Cluster(Path(work), n=3, replica_args=["--max-model-len", "2048"])
        cluster.start()
        try:
            result = asyncio.run(run(cluster, args.sessions, args.turns, args.max_tokens,
                                     args.long_tokens, log))
        finally:
            cluster.stop()
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
