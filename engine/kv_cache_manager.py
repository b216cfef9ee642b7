"""Per-sequence block tables on top of the block pool: prefix hits, session reuse, on-demand
growth, copy-on-write and release.

A sequence may write into a block in place only when it is the block's sole holder and the block
is not published in the prefix cache; otherwise the block is copied first (the copy is queued
for the model runner, which takes it with ``take_pending_copies`` before the next forward pass).

With a host tier (``host_blocks > 0``, prefix caching on) a hashed block whose last holder lets
go is staged for a copy to host memory (``engine.host_kv_tier``), and a prefix lookup continues
past the device's last hit into the host tier: each host hit gets a fresh device block,
published under its hash at once, and a host → device copy that the model runner performs
before the forward that reads it (``take_transfers``). Host hits count as cached tokens.
"""

from dataclasses import dataclass, field

from engine.block_pool import Block, BlockPool, hash_block
from engine.host_kv_tier import HostKVTier
from engine.sequence import Sequence
from engine.session_pins import PinnedSession, SessionPins


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    for x, y in zip(a[:limit], b[:limit], strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class _PrefixMatch:
    num_tokens: int
    blocks: list[Block]
    pinned: PinnedSession | None
    host_hits: list[bytes] = field(default_factory=list)  # hashes after ``blocks``, on the host


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        pin_budget_blocks: int,
        track_pin_changes: bool = False,
        host_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._pins = SessionPins(self.pool, pin_budget_blocks, track_pin_changes)
        self._pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.host_hits = 0  # prompt tokens served from the host tier (part of prefix_hits)
        self.host: HostKVTier | None = None
        self._offloads: list[tuple[int, int]] = []  # (device block, host slot)
        self._reloads: list[tuple[int, int]] = []  # (host slot, device block)
        if host_blocks > 0 and enable_prefix_caching:
            self.host = HostKVTier(host_blocks)
            self.pool.on_evictable = self._stage_offload

    # -- admission ---------------------------------------------------------------------------

    def admit(self, seq: Sequence, token_budget: int) -> tuple[int, int]:
        """Give a waiting sequence its reused prefix and the blocks for its next chunk.

        Returns the number of tokens to compute this step and the number copied back from the
        host tier, or ``(0, 0)`` (and changes nothing) when the free blocks do not suffice.
        The last token is always computed, so logits exist."""
        stale = self._pins.get(seq.session_id) if seq.session_id is not None else None
        if stale is not None and stale.cache_salt != seq.cache_salt:
            self._pins.unpin(stale.session_id)  # another tenant's KV under this session id
        match = self._match_prefix(seq)
        num_new = min(seq.num_tokens - match.num_tokens, token_budget)
        needed = _cdiv(match.num_tokens + num_new, self.block_size) - len(match.blocks)
        if match.pinned is not None:
            partial = match.num_tokens % self.block_size
            if partial and not self._writable(match.blocks[-1]):
                needed += 1
            tail = match.pinned.block_ids[len(match.blocks):]
            available = self.pool.num_free + sum(
                1 for b in tail if self.pool.blocks[b].ref_cnt == 1)
        else:
            available = self.pool.num_free - sum(1 for b in match.blocks if b.ref_cnt == 0)
        if needed > available:
            return 0, 0

        if match.pinned is not None:
            taken = self._pins.take(match.pinned.session_id)
            assert taken is match.pinned
            keep = len(match.blocks)
            self.pool.free(self.pool.blocks[b] for b in reversed(taken.block_ids[keep:]))
        else:
            self.pool.touch(match.blocks)
        seq.block_table = [b.block_id for b in match.blocks]
        if match.host_hits:
            seq.block_table += self._reload(match.host_hits)
        seq.num_computed_tokens = match.num_tokens
        if seq.num_output_tokens == 0:
            seq.num_cached_tokens = match.num_tokens
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += match.num_tokens
            self.host_hits += len(match.host_hits) * self.block_size
        grown = self.grow(seq, num_new)
        assert grown
        return num_new, len(match.host_hits) * self.block_size

    def reload_tokens(self, seq: Sequence) -> int:
        """Tokens that admitting ``seq`` now would copy back from the host tier (what
        :meth:`admit` reports, known before it commits anything)."""
        if self.host is None:
            return 0
        return len(self._match_prefix(seq).host_hits) * self.block_size

    def _match_prefix(self, seq: Sequence) -> _PrefixMatch:
        """The longest reusable prefix: hashed full blocks, or the session's pinned tokens
        (which also reuse the partial last block and tokens the model generated)."""
        blocks: list[Block] = []
        host_hits: list[bytes] = []
        if self.enable_prefix_caching:
            for i in range((seq.num_tokens - 1) // self.block_size):
                block_hash = self._block_hash(seq, i)
                block = None if host_hits else self.pool.lookup(block_hash)
                if block is not None:
                    blocks.append(block)
                elif self.host is not None and self.host.lookup(block_hash) is not None:
                    host_hits.append(block_hash)
                else:
                    break
        best = _PrefixMatch((len(blocks) + len(host_hits)) * self.block_size, blocks, None,
                            host_hits)
        pinned = self._pins.get(seq.session_id) if seq.session_id is not None else None
        if pinned is None or pinned.cache_salt != seq.cache_salt:
            return best
        lcp = _common_prefix(seq.token_ids, pinned.token_ids, seq.num_tokens - 1)
        if lcp <= best.num_tokens:
            return best
        kept = pinned.block_ids[: _cdiv(lcp, self.block_size)]
        return _PrefixMatch(lcp, [self.pool.blocks[b] for b in kept], pinned)

    def _reload(self, host_hits: list[bytes]) -> list[int]:
        """Fresh device blocks for host hits, published under their hashes; their copies back
        are queued (the caller has checked that enough blocks are free)."""
        assert self.host is not None
        blocks = self.pool.allocate(len(host_hits))
        for block, block_hash in zip(blocks, host_hits, strict=True):
            self._reloads.append((self.host.load(block_hash), block.block_id))
            self.pool.cache(block, block_hash)
        return [b.block_id for b in blocks]

    def _stage_offload(self, block: Block) -> None:
        """The pool's ``on_evictable``: queue the block's copy to a host slot (once per hash)."""
        assert self.host is not None and block.block_hash is not None
        slot = self.host.stage(block.block_hash)
        if slot is not None:
            self._offloads.append((block.block_id, slot))

    # -- growth ------------------------------------------------------------------------------

    def grow(self, seq: Sequence, num_new: int) -> bool:
        """Make room for ``num_new`` more tokens: copy a shared partial block, then append
        blocks. Returns False (changing nothing) when the free blocks do not suffice."""
        bs = self.block_size
        needed = _cdiv(seq.num_computed_tokens + num_new, bs) - len(seq.block_table)
        write_index = seq.num_computed_tokens // bs
        copy = (seq.num_computed_tokens % bs != 0
                and not self._writable(self.pool.blocks[seq.block_table[write_index]]))
        if max(needed, 0) + int(copy) > self.pool.num_free:
            return False
        if copy:
            old = self.pool.blocks[seq.block_table[write_index]]
            new = self.pool.allocate(1)[0]
            self._pending_copies.append((old.block_id, new.block_id))
            seq.block_table[write_index] = new.block_id
            self.pool.free([old])
        if needed > 0:
            seq.block_table.extend(b.block_id for b in self.pool.allocate(needed))
        return True

    def _writable(self, block: Block) -> bool:
        return block.ref_cnt == 1 and block.block_hash is None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent``, the partial last one included."""
        child.block_table = list(parent.block_table)
        self.pool.touch(self.pool.blocks[b] for b in child.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.block_hashes = list(parent.block_hashes)

    # -- after a step ------------------------------------------------------------------------

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """Record ``num_computed`` new tokens with KV and publish blocks that became full."""
        bs = self.block_size
        before = seq.num_computed_tokens
        seq.num_computed_tokens = before + num_computed
        if not self.enable_prefix_caching:
            return
        for i in range(before // bs, seq.num_computed_tokens // bs):
            self.pool.cache(self.pool.blocks[seq.block_table[i]], self._block_hash(seq, i))

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past ``seq``'s computed tokens, tail first (after a speculative step:
        the blocks only rejected drafts were written into)."""
        keep = _cdiv(seq.num_computed_tokens, self.block_size)
        self.pool.free(self.pool.blocks[b] for b in reversed(seq.block_table[keep:]))
        del seq.block_table[keep:]

    def _block_hash(self, seq: Sequence, index: int) -> bytes:
        bs = self.block_size
        while len(seq.block_hashes) <= index:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            salt = seq.cache_salt if i == 0 else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs], salt))
        return seq.block_hashes[index]

    # -- release -----------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's blocks, tail first; KV is forgotten (``num_computed_tokens`` 0)."""
        self.pool.free(self.pool.blocks[b] for b in reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0

    def pin(self, seq: Sequence) -> None:
        """Hand a finished sequence's computed tokens and their blocks to its session."""
        assert seq.session_id is not None
        keep = _cdiv(seq.num_computed_tokens, self.block_size)
        self.pool.free(self.pool.blocks[b] for b in reversed(seq.block_table[keep:]))
        self._pins.pin(PinnedSession(
            session_id=seq.session_id,
            token_ids=seq.token_ids[: seq.num_computed_tokens],
            block_ids=seq.block_table[:keep],
            cache_salt=seq.cache_salt,
        ))
        seq.block_table = []
        seq.num_computed_tokens = 0

    # -- session pins and pending copies: what the scheduler and the engine may touch --------

    def pinned(self, session_id: str) -> PinnedSession | None:
        return self._pins.get(session_id)

    def pinned_sessions(self) -> list[PinnedSession]:
        """Every pin, least recently used first."""
        return list(self._pins.pins.values())

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by at least one pin."""
        return self._pins.num_pinned_blocks

    @property
    def pin_budget_blocks(self) -> int:
        return self._pins.budget_blocks

    def unpin(self, session_id: str) -> bool:
        """Unpin a session (its full blocks stay in the prefix cache); False if not pinned."""
        return self._pins.unpin(session_id)

    def unpin_lru(self, keep: str | None = None) -> bool:
        """Unpin the least recently used session other than ``keep``; False if none."""
        return self._pins.unpin_lru(keep)

    def take_pin_changes(self) -> dict[str, list[int] | None]:
        """Sessions pinned (their token ids) or unpinned (None) since the last call."""
        return self._pins.take_changes()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """``(src, dst)`` block copies the model runner must do before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Host-tier copies for the model runner, in order: ``(device block, host slot)`` stores
        (each block still holds its hashed KV: stores go first) and ``(host slot, device block)``
        loads, before the next forward."""
        offloads, self._offloads = self._offloads, []
        reloads, self._reloads = self._reloads, []
        if self.host is not None:
            self.host.take_loading()
        return offloads, reloads

    def complete_offloads(self, slots: list[int]) -> None:
        """The runner's copies into these host slots have completed."""
        if self.host is not None and slots:
            self.host.complete(slots)

    # -- measurement -------------------------------------------------------------------------

    def stored_tokens(self, seqs: list[Sequence]) -> int:
        """Distinct token slots holding KV across running sequences and pins."""
        bs = self.block_size
        full: set[int] = set()
        partial: dict[int, int] = {}  # block id -> most tokens any holder has in it
        holders = [(s.block_table, s.num_computed_tokens) for s in seqs]
        holders += [(p.block_ids, len(p.token_ids)) for p in self._pins.pins.values()]
        for table, computed in holders:
            num_full, rest = divmod(computed, bs)
            full.update(table[:num_full])
            if rest:
                block_id = table[num_full]
                partial[block_id] = max(partial.get(block_id, 0), rest)
        return len(full) * bs + sum(n for b, n in partial.items() if b not in full)
