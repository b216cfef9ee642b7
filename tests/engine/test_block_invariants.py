"""Property tests: the block pool, KV cache manager, session pins and scheduler keep their
invariants under any interleaving of allocate, append, prefix hit, fork, free, pin, unpin,
evict and preempt (driven through the real scheduler, with the model replaced by random
tokens), with steps synchronous or overlapped as ``LLMEngine`` overlaps them (a sampled token
is a placeholder until the next step resolves it, after that step was scheduled).

With a host KV tier, each step performs the scheduled offloads and reloads on a model of the
blocks' contents (a block's content is the chained hash of the tokens whose KV it holds) and
offloads complete at arbitrary later points, as CUDA events do: every block the device or the
host serves under a hash holds that hash's content, no host slot is handed out twice, and
neither tier leaks."""

from collections import Counter, deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.inflight import PLACEHOLDER
from engine.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 4
NUM_BLOCKS = 24
SMALL_POOL = 12
SALTS = [None, "tenant-a", "tenant-b"]
SESSIONS = ["s1", "s2", "s3"]
# a tiny vocabulary and a shared stem make prefix hits and session matches frequent
STEM = [1, 2, 3, 4, 5, 6, 7, 8]


class BlockMachine(RuleBasedStateMachine):
    @initialize(budget_tokens=st.sampled_from([4, 7, 64]), pin_budget=st.sampled_from([6, 24]),
                admission_batch=st.sampled_from([1, 3]), overlap=st.booleans(),
                host_blocks=st.sampled_from([0, 3, 16]), small_pool=st.booleans(),
                synchronous_copies=st.booleans())
    def setup(self, budget_tokens: int, pin_budget: int, admission_batch: int,
              overlap: bool, host_blocks: int, small_pool: bool,
              synchronous_copies: bool) -> None:
        # a small device pool evicts often, so blocks come back from the host tier
        num_blocks = SMALL_POOL if small_pool else NUM_BLOCKS
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, True, min(pin_budget, num_blocks),
                                 host_blocks=host_blocks)
        self.device_content: dict[int, bytes] = {}  # block id -> hash of the KV it holds
        self.host_content: dict[int, bytes] = {}  # host slot -> hash of the KV it holds
        self.storing: deque[list[int]] = deque()  # issued offloads, oldest first
        self.synchronous_copies = synchronous_copies  # as on CPU; else completed by a rule
        self.past: list[tuple[list[int], str | None]] = []  # finished tokens and their salt
        self.scheduler = Scheduler(self.kv, max_num_seqs=6, max_num_batched_tokens=budget_tokens,
                                   admission_batch=admission_batch)
        self.live: list[Sequence] = []
        self.counter = 0
        self.overlap = overlap
        self.inflight: list[Sequence] = []  # sequences whose last token is a placeholder

    # -- rules -------------------------------------------------------------------------------

    @rule(tail=st.lists(st.integers(0, 3), min_size=1, max_size=14),
          stem=st.integers(0, len(STEM)),
          salt=st.sampled_from(SALTS),
          session=st.sampled_from([None, *SESSIONS]))
    def add(self, tail: list[int], stem: int, salt: str | None, session: str | None) -> None:
        self.counter += 1
        seq = Sequence(str(self.counter), 0, STEM[:stem] + tail, SamplingParams(), None,
                       session_id=session, cache_salt=salt)
        self.scheduler.add(seq)
        self.live.append(seq)

    @precondition(lambda self: bool(self.kv.pinned_sessions()))
    @rule(data=st.data(), tail=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def continue_session(self, data: st.DataObject, tail: list[int]) -> None:
        """A next turn (keep everything) or a regenerate/edit (keep a shorter prefix, which may
        end inside a block) of a pinned session."""
        pinned = data.draw(st.sampled_from(list(self.kv.pinned_sessions())))
        keep = data.draw(st.integers(1, len(pinned.token_ids)))
        self.counter += 1
        seq = Sequence(str(self.counter), 0, pinned.token_ids[:keep] + tail, SamplingParams(),
                       None, session_id=pinned.session_id, cache_salt=pinned.cache_salt)
        self.scheduler.add(seq)
        self.live.append(seq)

    @precondition(lambda self: bool(self.past))
    @rule(data=st.data(), tail=st.lists(st.integers(0, 3), min_size=1, max_size=4),
          other_tenant=st.booleans(), evicted=st.booleans())
    def come_back(self, data: st.DataObject, tail: list[int], other_tenant: bool,
                  evicted: bool) -> None:
        """A conversation returns after its pin (and perhaps its device blocks) went away,
        under its own tenant or another one."""
        if evicted:
            self.evict_device_cache()
        tokens, salt = data.draw(st.sampled_from(self.past))
        if other_tenant:
            salt = data.draw(st.sampled_from([s for s in SALTS if s != salt]))
        self.counter += 1
        seq = Sequence(str(self.counter), 0, tokens + tail, SamplingParams(), None,
                       cache_salt=salt)
        self.scheduler.add(seq)
        self.live.append(seq)

    @rule()
    def evict_device_cache(self) -> None:
        """Other traffic takes every free block (their cached hashes are evicted) and lets go."""
        blocks = self.kv.pool.allocate(self.kv.pool.num_free)
        self.kv.pool.free(blocks)

    @rule(token=st.integers(0, 3))
    def step(self, token: int) -> None:
        assert all(seq.token_ids[-1] != PLACEHOLDER for seq in self.scheduler.waiting)
        batch = self.scheduler.schedule()
        self._transfer(batch.offloads, batch.reloads)
        if self.overlap:  # the previous step's tokens arrive after this one was scheduled
            for seq in self.inflight:
                if not seq.is_finished:
                    seq.token_ids[-1] = token
            self.inflight = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            assert seq.status is SequenceStatus.RUNNING
            before = seq.num_computed_tokens
            self.kv.commit(seq, n)
            for i in range(before // BLOCK_SIZE, seq.num_computed_tokens // BLOCK_SIZE):
                self.device_content[seq.block_table[i]] = seq.block_hashes[i]
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(PLACEHOLDER if self.overlap else token)
                if self.overlap:
                    self.inflight.append(seq)

    def _transfer(self, offloads: list[tuple[int, int]], reloads: list[tuple[int, int]]) -> None:
        """What ``engine.kv_transfer`` does to the contents: stores, then loads."""
        host = self.kv.host
        slots = [slot for _, slot in offloads]
        assert len(set(slots)) == len(slots)
        for block, slot in offloads:
            assert host is not None and slot in host.pending.values()
            self.host_content[slot] = self.device_content[block]
        if slots and self.synchronous_copies:
            self.kv.complete_offloads(slots)
        elif slots:
            self.storing.append(slots)
        for slot, block in reloads:
            assert host is not None and slot in host.ready.values()
            self.device_content[block] = self.host_content[slot]

    @precondition(lambda self: bool(self.storing))
    @rule(count=st.integers(1, 3))
    def offloads_complete(self, count: int) -> None:
        """The oldest issued offloads finish (their events complete)."""
        for _ in range(min(count, len(self.storing))):
            self.kv.complete_offloads(self.storing.popleft())

    @precondition(lambda self: any(s.status is SequenceStatus.RUNNING and
                                   s.num_computed_tokens == s.num_tokens - 1
                                   and s.token_ids[-1] != PLACEHOLDER for s in self.live))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parents = [s for s in self.live if s.status is SequenceStatus.RUNNING
                   and s.num_computed_tokens == s.num_tokens - 1
                   and s.token_ids[-1] != PLACEHOLDER]  # the engine forks in synchronous steps
        parent = data.draw(st.sampled_from(parents))
        self.counter += 1
        child = Sequence(str(self.counter), 1, parent.token_ids, parent.params, None,
                         cache_salt=parent.cache_salt)
        self.kv.fork(parent, child)
        self.scheduler.add_running(child)
        self.live.append(child)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """Finish or abort: pins the session's blocks when it has one, else frees them."""
        seq = data.draw(st.sampled_from(self.live))
        self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        if seq.token_ids[-1] == PLACEHOLDER:  # aborted in flight, as LLMEngine.abort does
            seq.token_ids.pop()
        if seq.num_computed_tokens >= BLOCK_SIZE:
            self.past.append((seq.token_ids[:seq.num_computed_tokens], seq.cache_salt))
        self.scheduler.finish(seq)
        self.live.remove(seq)

    @rule(session=st.sampled_from(SESSIONS))
    def unpin_session(self, session: str) -> None:
        self.kv.unpin(session)

    @rule()
    def evict_lru_pin(self) -> None:
        self.kv.unpin_lru()

    # (the engine preempts only while scheduling, and resolves placeholders right after)
    @precondition(lambda self: bool(self.scheduler.running)
                  and self.scheduler.running[-1].token_ids[-1] != PLACEHOLDER)
    @rule()
    def preempt(self) -> None:
        self.scheduler._preempt(self.scheduler.running.pop())

    # -- invariants --------------------------------------------------------------------------

    def _holders(self) -> Counter[int]:
        holders: Counter[int] = Counter()
        for seq in self.live:
            holders.update(seq.block_table)
        for pinned in self.kv.pinned_sessions():
            holders.update(pinned.block_ids)
        return holders

    @invariant()
    def ref_counts_equal_holders(self) -> None:
        holders = self._holders()
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], block

    @invariant()
    def used_blocks_are_the_held_blocks(self) -> None:
        """The pool's count of blocks in use is the number of distinct blocks some sequence or
        pinned session holds (a block out of the free queue that nobody holds is a leak), and
        a block is in the free queue exactly when nobody holds it."""
        pool = self.kv.pool
        assert pool.num_used == len(self._holders())
        in_queue = set(pool.free_queue)
        for block in pool.blocks:
            assert (block.block_id in in_queue) == (block.ref_cnt == 0), block

    @invariant()
    def cache_map_is_consistent(self) -> None:
        for block_hash, block in self.kv.pool.cached.items():
            assert block.block_hash == block_hash

    @invariant()
    def no_block_shared_across_salts(self) -> None:
        salts: dict[int, set[str | None]] = {}
        for seq in self.live:
            for b in seq.block_table:
                salts.setdefault(b, set()).add(seq.cache_salt)
        for pinned in self.kv.pinned_sessions():
            for b in pinned.block_ids:
                salts.setdefault(b, set()).add(pinned.cache_salt)
        assert all(len(s) == 1 for s in salts.values()), salts

    @invariant()
    def tables_cover_computed_tokens(self) -> None:
        for seq in self.live:
            assert len(seq.block_table) * BLOCK_SIZE >= seq.num_computed_tokens
            assert len(set(seq.block_table)) == len(seq.block_table)

    @invariant()
    def placeholders_are_last_and_never_hashed_or_pinned(self) -> None:
        for seq in self.live:
            assert PLACEHOLDER not in seq.token_ids[:-1]
            assert PLACEHOLDER not in seq.token_ids[:len(seq.block_hashes) * BLOCK_SIZE]
            assert PLACEHOLDER not in seq.token_ids[:seq.num_computed_tokens]
        for pinned in self.kv.pinned_sessions():
            assert PLACEHOLDER not in pinned.token_ids

    @invariant()
    def served_blocks_hold_their_hash(self) -> None:
        """A device prefix hit or a host hit yields KV of exactly the hashed tokens (and so of
        the hash's tenant: the salt is in the hash)."""
        for block_hash, block in self.kv.pool.cached.items():
            assert self.device_content.get(block.block_id) == block_hash
        host = self.kv.host
        if host is not None:
            for block_hash, slot in host.ready.items():
                assert self.host_content.get(slot) == block_hash

    @invariant()
    def host_slots_are_partitioned(self) -> None:
        """Each host slot is free, pending or ready, exactly once; a hash is stored once."""
        host = self.kv.host
        if host is None:
            return
        free, pending, ready = host.free, list(host.pending.values()), list(host.ready.values())
        assert sorted(free + pending + ready) == list(range(host.num_slots))
        assert not set(host.pending) & set(host.ready)
        assert host.hash_of == {s: h for h, s in [*host.pending.items(), *host.ready.items()]}
        in_flight = [slot for slots in self.storing for slot in slots]
        assert set(in_flight) <= set(pending)
        assert set(pending) - set(in_flight) <= {s for _, s in self.kv._offloads}

    @invariant()
    def pin_budget_holds(self) -> None:
        assert self.kv.num_pinned_blocks <= self.kv.pin_budget_blocks

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for seq in list(self.live):
            self._finish(seq)
        for session in SESSIONS:
            self.kv.unpin(session)
        self._transfer(*self.kv.take_transfers())
        while self.storing:
            self.kv.complete_offloads(self.storing.popleft())
        host = self.kv.host
        if host is not None:  # nothing pending, no slot lost
            assert not host.pending and len(host.free) + host.num_ready == host.num_slots
        assert self.kv.pool.num_free == self.kv.pool.num_blocks
        assert all(block.ref_cnt == 0 for block in self.kv.pool.blocks)


BlockMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=60,
                                          deadline=None)
TestBlockInvariants = BlockMachine.TestCase
