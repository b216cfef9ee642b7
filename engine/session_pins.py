"""Pinned sessions: a finished turn's tokens and blocks, kept for the session's next turn.

Each pin holds one reference on each of its blocks (so they are never evicted or handed out).
Pins are kept in LRU order; when the distinct pinned blocks exceed the budget, or when the
scheduler needs memory, the least recently used pin is released: its full blocks stay hashed in
the prefix cache, so even an unpinned session usually hits.
"""

from collections import Counter, OrderedDict
from dataclasses import dataclass

from engine.block_pool import BlockPool


@dataclass
class PinnedSession:
    """``token_ids`` all have their KV in ``block_ids`` (``len(block_ids)`` covers them)."""

    session_id: str
    token_ids: list[int]
    block_ids: list[int]
    cache_salt: str | None


class SessionPins:
    def __init__(self, pool: BlockPool, budget_blocks: int, track_changes: bool = False) -> None:
        self.pool = pool
        self.budget_blocks = budget_blocks
        self.pins: OrderedDict[str, PinnedSession] = OrderedDict()
        self._pin_counts: Counter[int] = Counter()
        self._changes: dict[str, list[int] | None] | None = {} if track_changes else None

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by at least one pin."""
        return len(self._pin_counts)

    def get(self, session_id: str) -> PinnedSession | None:
        return self.pins.get(session_id)

    def pin(self, pinned: PinnedSession) -> None:
        """Keep ``pinned``; the caller hands over one reference per block. Replaces an older pin
        of the same session and then trims to the budget, least recently used first."""
        self.unpin(pinned.session_id)
        self.pins[pinned.session_id] = pinned
        self._pin_counts.update(pinned.block_ids)
        if self._changes is not None:
            self._changes[pinned.session_id] = pinned.token_ids
        while self.num_pinned_blocks > self.budget_blocks and self.pins:
            self.unpin_lru()

    def take(self, session_id: str) -> PinnedSession | None:
        """Remove the pin and hand its references to the caller (nothing is freed)."""
        pinned = self.pins.pop(session_id, None)
        if pinned is not None:
            self._forget(pinned)
            if self._changes is not None:
                self._changes[session_id] = None
        return pinned

    def take_changes(self) -> dict[str, list[int] | None]:
        """Each session pinned (its token ids) or unpinned (None) since the last call, latest
        state only; empty unless tracking."""
        if not self._changes:
            return {}
        changes, self._changes = self._changes, {}
        return changes

    def unpin(self, session_id: str) -> bool:
        pinned = self.take(session_id)
        if pinned is None:
            return False
        self.pool.free(self.pool.blocks[b] for b in reversed(pinned.block_ids))
        return True

    def unpin_lru(self, keep: str | None = None) -> bool:
        """Unpin the least recently used session other than ``keep``; False if there is none."""
        for session_id in self.pins:
            if session_id != keep:
                return self.unpin(session_id)
        return False

    def _forget(self, pinned: PinnedSession) -> None:
        self._pin_counts.subtract(pinned.block_ids)
        for block_id in set(pinned.block_ids):
            if self._pin_counts[block_id] <= 0:
                del self._pin_counts[block_id]
