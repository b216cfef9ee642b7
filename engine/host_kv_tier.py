"""The host-memory KV tier's bookkeeping: which host slot holds which block hash.

Full device blocks that become evictable (their last holder lets go: a finished request, an
unpinned session) are *staged*: given a host slot and queued for a device → host copy. Once the
copy has completed (:meth:`HostKVTier.complete`) the slot is *ready*: findable by the block's
hash, which is the same chained hash as on the device (the tenant's cache salt is in the first
block's hash, so a host hit never crosses tenants). A later prefix lookup that misses on the
device but hits here *loads* the slot (host → device copy into a fresh device block) instead of
recomputing it. Ready slots are evicted least recently used first.

This module only keeps the books; the copies themselves are ``engine.kv_transfer``'s.

Invariants:
- every slot is in exactly one of: free, pending (staged, copy not complete), ready;
- ``hash_of[slot] == h`` iff ``ready[h] == slot`` or ``pending[h] == slot``; a hash is in at
  most one of ``ready`` and ``pending`` (a block is never stored twice);
- only ready slots are returned by :meth:`lookup`; a slot loaded since the last
  :meth:`take_loading` (its copy not yet issued) is never evicted, so no slot is handed out
  for a new copy while a load still has to read it.
"""

from collections import OrderedDict


class HostKVTier:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.pending: dict[bytes, int] = {}
        self.ready: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.hash_of: dict[int, bytes] = {}
        self.loading: set[int] = set()
        self.num_stored = 0  # blocks whose copy to the host completed
        self.num_loaded = 0  # blocks handed out for a copy back
        self.num_evicted = 0

    def stage(self, block_hash: bytes) -> int | None:
        """A device block with this hash is about to become evictable: the host slot to copy it
        into, or None (already stored or staged, or every slot pending or being loaded)."""
        if block_hash in self.ready:
            self.ready.move_to_end(block_hash)
            return None
        if block_hash in self.pending:
            return None
        slot = self._free_slot()
        if slot is None:
            return None
        self.pending[block_hash] = slot
        self.hash_of[slot] = block_hash
        return slot

    def _free_slot(self) -> int | None:
        if self.free:
            return self.free.pop()
        for block_hash, slot in self.ready.items():  # evict the least recently used
            if slot not in self.loading:
                del self.ready[block_hash]
                del self.hash_of[slot]
                self.num_evicted += 1
                return slot
        return None

    def complete(self, slots: list[int]) -> None:
        """The copies into ``slots`` have completed: their hashes become findable."""
        for slot in slots:
            block_hash = self.hash_of[slot]
            assert self.pending.pop(block_hash) == slot
            self.ready[block_hash] = slot
            self.num_stored += 1

    def lookup(self, block_hash: bytes) -> int | None:
        """The ready slot holding ``block_hash``, or None."""
        return self.ready.get(block_hash)

    def load(self, block_hash: bytes) -> int:
        """Take a ready hit for a copy back: the slot, kept safe until :meth:`take_loading`."""
        slot = self.ready[block_hash]
        self.ready.move_to_end(block_hash)
        self.loading.add(slot)
        self.num_loaded += 1
        return slot

    def take_loading(self) -> None:
        """The loads so far have been issued (copies ordered before any later store)."""
        self.loading.clear()

    @property
    def num_ready(self) -> int:
        return len(self.ready)
