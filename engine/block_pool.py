"""Physical KV blocks: ref counts, an LRU free queue and the hash → block prefix cache.

Invariants:
- a block is in the free queue iff its ref count is 0; ref count = number of holders
  (running sequences and pinned sessions);
- ``cached[h] is b`` implies ``b.block_hash == h``; a freed block keeps its hash (a later
  prefix hit may revive it) and loses it only when it is handed out again;
- ``num_free + num_used == num_blocks``;
- ``on_evictable`` (when set) is called once each time a hashed block's ref count drops to 0,
  before anything can hand it out again (the host KV tier stages its copy there).
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: str | None) -> bytes:
    """Chained hash of one full block; ``extra`` (the cache salt) goes into the first block only,
    so every later block of a salted chain differs from an unsalted one too."""
    h = hashlib.sha256()
    h.update(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    if extra is not None:
        h.update(b"salt:" + extra.encode())
    return h.digest()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class OutOfBlocks(Exception):
    """Raised when more blocks are asked for than are free."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, Block] = {}
        self.on_evictable: Callable[[Block], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self, n: int) -> list[Block]:
        """Hand out ``n`` blocks from the LRU head, evicting their cached hashes."""
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a holder to each block, taking free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop a holder from each block; blocks reaching 0 join the LRU tail in the order
        given (callers pass tails first, so a chain's tail is evicted before its head)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed with no holder"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None
                if block.block_hash is not None and self.on_evictable is not None:
                    self.on_evictable(block)

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Publish a full block under its hash; a duplicate of an already cached block stays
        unhashed (the first one keeps serving hits)."""
        if block.block_hash is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            block.block_hash = block_hash
