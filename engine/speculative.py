"""Speculative decoding with n-gram (prompt lookup) drafts: lossless, greedy and sampled.

A speculative step: before scheduling, :meth:`Speculator.propose` gives each running sequence
that decodes (its last token known, no KV for it yet) and may speculate up to K drafts
(``Sequence.draft_token_ids``, :func:`propose_ngram` over its own prompt and output). The
scheduler computes its last token and the drafts in one step (the multi-token query path of
chunked prefill; the token budget may cut drafts off); the runner returns logits at each of
those positions. Row ``j`` is sampled as if drafts ``1..j`` were appended (the noise key of
that output position, penalties and ``min_tokens`` over them: ``StepSampler.sample``'s
``ahead``), and :func:`accepted` keeps the drafts up to the first that differs from the token
sampled before it, plus that token (the bonus). Each token appended (stop checks per token:
nothing past a stop) commits the KV of the token before it; then the blocks past the committed
tokens are freed (``KVCacheManager.trim``).

Invariants: a rejected draft's KV lies only in slots past ``num_computed_tokens``, so it is
never read (attention reads positions below the sequence length, and each of those is written
again by an accepted token first), never hashed (only full committed blocks are), never
pinned (a pin keeps ``token_ids[:num_computed_tokens]``); drafts never enter ``token_ids``.

Lossless: the token row ``j`` draws is the token plain decoding draws at that output position
after the same tokens (greedy: the argmax; sampled: the exponential race under the position's
key), and a draft is accepted exactly when it equals that token. For a deterministic proposal
this is the rejection-sampling rule (accept draft ``d`` with probability ``p(d)``; on rejection
the token is distributed as ``p`` without ``d``, renormalised), and it reproduces plain
decoding token for token, a seeded request included.

Plain decoding instead (no drafts): grammar-constrained sequences (their masks follow the
matcher one token at a time), a step where more than ``disable_by_batch_size`` sequences run,
and a sequence whose drafts were mostly rejected (:class:`_Acceptance`).
"""

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.config import SpeculativeConfig
from engine.sequence import Sequence

# A sequence looks for K drafts while its recent acceptance (an exponential moving average of
# accepted / drafted tokens, weight ``EMA_WEIGHT`` on the newest verify) is at least
# ``MIN_ACCEPTANCE``; otherwise only every ``PROBE_INTERVAL``-th engine step, for one draft (to
# measure it anew at little cost). While a step is in flight (overlapped scheduling), looking
# means reading it first, so it is only done for a sequence that found drafts in the last
# ``QUIET_STEPS`` steps, or for a probe. Steps count whether or not anything drafts. On the
# 2-core CPU a verify of K = 4 drafts costs 1.35 decode steps, of one 1.15 (docs/benchmarks.md):
# drafts pay once 0.35 of 4 are accepted.
EMA_WEIGHT = 0.3
MIN_ACCEPTANCE = 0.3
QUIET_STEPS = 8
PROBE_INTERVAL = 8


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` of ``min_n``..``max_n`` tokens that ``k`` tokens follow, else of the latest
    occurrence (none: no such suffix occurs earlier)."""
    length = len(tokens)
    if length <= min_n or k < 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= length]
            start = int(full[-1] if full.size else hits[-1]) + n
            return tokens[start:start + k]
    return []


def accepted(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verify appends: ``sampled[j]`` (row ``j``'s token) for each draft that
    equals the token sampled before it, then the first token that differs (or the bonus
    token after the last draft). ``len(sampled) == len(drafts) + 1``."""
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return sampled[:n + 1]


@dataclass
class _Acceptance:
    """One sequence's recent acceptance and the engine step of its last verdict (or of its
    first step, before any)."""

    rate: float = 1.0
    since: int = 0

    def drafts(self, k: int, step: int) -> int:
        """How many drafts the sequence looks for at ``step`` (see ``MIN_ACCEPTANCE``)."""
        if self.rate >= MIN_ACCEPTANCE:
            return k
        return 1 if (step - self.since) % PROBE_INTERVAL == 0 else 0

    def worth_waiting(self, step: int) -> bool:
        """Whether to read a step in flight for this sequence's drafts (``QUIET_STEPS``)."""
        idle = step - self.since
        return ((self.rate >= MIN_ACCEPTANCE and idle < QUIET_STEPS)
                or idle % PROBE_INTERVAL == 0)

    def record(self, num_drafts: int, num_accepted: int, step: int) -> None:
        self.rate += EMA_WEIGHT * (num_accepted / num_drafts - self.rate)
        self.since = step


@dataclass
class SpecCounters:
    """vLLM's ``spec_decode_*`` counters: verifies, drafted tokens, accepted drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class Speculator:
    """Drafts for the running sequences and the verdicts on them (see the module docstring)."""

    config: SpeculativeConfig
    max_model_len: int
    counters: SpecCounters = field(default_factory=SpecCounters)
    _acceptance: dict[int, _Acceptance] = field(default_factory=dict)
    _step: int = 0  # engine steps so far: ``active`` is asked once a step

    @staticmethod
    def of(options: dict[str, Any] | None, max_model_len: int) -> "Speculator | None":
        """The speculator of ``EngineConfig.speculative_config`` (None: off)."""
        if options is None:
            return None
        return Speculator(SpeculativeConfig.from_dict(options), max_model_len)

    def active(self, running: list[Sequence], in_flight: bool) -> bool:
        """Whether this step may draft (asked once each engine step, which it counts): no
        more running sequences than the limit, and one of them looks for drafts; with a step
        ``in_flight`` (which is then read first: see ``engine.llm_engine``), one worth waiting
        for. Forgets the acceptance of sequences no longer running (at such a step)."""
        self._step += 1
        if not 0 < len(running) <= self.config.disable_by_batch_size:
            return False
        step = self._step
        known = self._acceptance
        self._acceptance = {s.seq_id: known.get(s.seq_id) or _Acceptance(since=step)
                            for s in running}
        states = [self._acceptance[s.seq_id] for s in running if s.matcher is None]
        return any(s.worth_waiting(step) if in_flight else s.drafts(1, step) for s in states)

    def propose(self, running: list[Sequence]) -> None:
        """Set ``draft_token_ids`` of each running sequence that may speculate (module
        docstring)."""
        c = self.config
        for seq in running:
            state = self._acceptance.get(seq.seq_id) or _Acceptance(since=self._step)
            k = (min(state.drafts(c.num_speculative_tokens, self._step), self._room(seq))
                 if self._may_draft(seq) else 0)
            if k > 0:
                seq.draft_token_ids = propose_ngram(seq.token_ids, k, c.prompt_lookup_min,
                                                    c.prompt_lookup_max)

    def _may_draft(self, seq: Sequence) -> bool:
        return (seq.num_computed_tokens == seq.num_tokens - 1 and seq.num_output_tokens > 0
                and seq.matcher is None)

    def _room(self, seq: Sequence) -> int:
        """Drafts that can still count: the bonus token comes on top, and neither
        ``max_tokens`` nor the context length may be passed."""
        room = min(self.config.num_speculative_tokens, self.max_model_len - seq.num_tokens)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return room

    def verdict(self, seq: Sequence, sampled: list[int]) -> list[int]:
        """The tokens to append to ``seq`` given its rows' ``sampled`` tokens (counted, and
        its drafts cleared)."""
        drafts = seq.draft_token_ids
        tokens = accepted(drafts, sampled)
        self.counters.num_drafts += 1
        self.counters.num_draft_tokens += len(drafts)
        self.counters.num_accepted_tokens += len(tokens) - 1
        seq.num_draft_tokens += len(drafts)
        seq.num_accepted_tokens += len(tokens) - 1
        state = self._acceptance.get(seq.seq_id)
        if state is not None:
            state.record(len(drafts), len(tokens) - 1, self._step)
        seq.draft_token_ids = []
        return tokens

    def settle(self, rows: list[tuple[Sequence, int, Any]]
               ) -> tuple[list[tuple[Sequence, int, Any]], set[int]]:
        """A step's sampled ``rows`` (sequence, token, logprob; a speculative sequence's rows
        consecutive, drafts first) with each speculative sequence's rows replaced by the
        tokens its verdict appends; and the seq ids of those sequences."""
        out: list[tuple[Sequence, int, Any]] = []
        verified: set[int] = set()
        i = 0
        while i < len(rows):
            seq = rows[i][0]
            width = 1 + len(seq.draft_token_ids)
            if width > 1:
                verified.add(seq.seq_id)
                tokens = self.verdict(seq, [token for _, token, _ in rows[i:i + width]])
                out += rows[i:i + len(tokens)]
            else:
                out.append(rows[i])
            i += width
        return out, verified
