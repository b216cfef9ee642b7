"""Property test: with speculative drafts, the KV a step writes for rejected drafts is never
visible. Driven through the real scheduler and KV cache manager with the model replaced by
random tokens, the machine mirrors ``LLMEngine``'s speculative step (drafts scheduled with the
last token and cut by the token budget, a verdict by ``engine.speculative.accepted``, the KV
of the token before each appended token committed, a stop part-way, then ``trim``) among
admissions, prefix hits, session continuations, forks, preemptions, pins and unpins.

Each KV slot's content is modelled as the token written there. Invariants: every position a
sequence or pinned session counts as computed holds that sequence's (session's) token; every
block served under a hash holds exactly the tokens hashed; reference counts equal holders;
a running sequence holds no block past its computed tokens; no draft outlives a step."""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.speculative import accepted

BS = 4
STEM = [1, 2, 3, 1, 2, 3, 1, 2]
SESSIONS = ["s1", "s2"]


class SpecMachine(RuleBasedStateMachine):
    @initialize(budget=st.sampled_from([3, 6, 64]), num_blocks=st.sampled_from([10, 24]))
    def setup(self, budget: int, num_blocks: int) -> None:
        self.kv = KVCacheManager(num_blocks, BS, True, num_blocks // 2)
        self.scheduler = Scheduler(self.kv, max_num_seqs=4, max_num_batched_tokens=budget)
        self.slots: dict[int, int] = {}  # block_id * BS + offset -> token whose KV it holds
        self.hashed: dict[bytes, tuple[int, ...]] = {}  # block hash -> the tokens hashed
        self.live: list[Sequence] = []
        self.counter = 0

    def _add(self, tokens: list[int], session: str | None) -> None:
        self.counter += 1
        seq = Sequence(str(self.counter), 0, tokens, SamplingParams(), None, session_id=session)
        self.scheduler.add(seq)
        self.live.append(seq)

    @rule(tail=st.lists(st.integers(1, 3), min_size=1, max_size=9),
          stem=st.integers(0, len(STEM)), session=st.sampled_from([None, *SESSIONS]))
    def add(self, tail: list[int], stem: int, session: str | None) -> None:
        self._add(STEM[:stem] + tail, session)

    @precondition(lambda self: bool(self.kv.pinned_sessions()))
    @rule(data=st.data(), tail=st.lists(st.integers(1, 3), min_size=1, max_size=4))
    def continue_session(self, data: st.DataObject, tail: list[int]) -> None:
        pinned = data.draw(st.sampled_from(self.kv.pinned_sessions()))
        keep = data.draw(st.integers(1, len(pinned.token_ids)))
        self._add(pinned.token_ids[:keep] + tail, pinned.session_id)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        for seq in self.scheduler.running:  # what Speculator.propose does, with random drafts
            if seq.num_computed_tokens == seq.num_tokens - 1 and data.draw(st.booleans()):
                seq.draft_token_ids = data.draw(st.lists(st.integers(1, 3), max_size=4))
        batch = self.scheduler.schedule()
        for seq in self.live:
            if seq not in batch.seqs:
                assert not seq.draft_token_ids
        for src, dst in batch.copies:
            for offset in range(BS):
                if src * BS + offset in self.slots:
                    self.slots[dst * BS + offset] = self.slots[src * BS + offset]
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            written = seq.token_ids + seq.draft_token_ids
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.slots[seq.block_table[pos // BS] * BS + pos % BS] = written[pos]
            if not seq.draft_token_ids:
                self.kv.commit(seq, n)
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.token_ids.append(data.draw(st.integers(1, 3)))
                continue
            sampled = data.draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
            tokens = accepted(seq.draft_token_ids, sampled)
            seq.draft_token_ids = []
            stop_after = data.draw(st.integers(1, len(tokens) + 1))  # a stop part-way, or none
            for i, token in enumerate(tokens):
                self.kv.commit(seq, 1)
                seq.token_ids.append(token)
                if i + 1 == stop_after:
                    self._finish(seq)
                    break
            else:
                self.kv.trim(seq)
        self._record_hashes()

    def _record_hashes(self) -> None:
        for seq in self.live:
            for i, block_hash in enumerate(seq.block_hashes):
                self.hashed.setdefault(block_hash, tuple(seq.token_ids[i * BS:(i + 1) * BS]))

    @precondition(lambda self: any(s.status is SequenceStatus.RUNNING
                                   and s.num_computed_tokens == s.num_tokens - 1
                                   for s in self.live))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from([s for s in self.live
                                            if s.status is SequenceStatus.RUNNING
                                            and s.num_computed_tokens == s.num_tokens - 1]))
        self.counter += 1
        child = Sequence(str(self.counter), 1, parent.token_ids, parent.params, None)
        self.kv.fork(parent, child)
        self.scheduler.add_running(child)
        self.live.append(child)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._finish(data.draw(st.sampled_from(self.live)))

    def _finish(self, seq: Sequence) -> None:
        self._record_hashes()
        self.scheduler.finish(seq)
        self.live.remove(seq)

    @precondition(lambda self: bool(self.scheduler.running))
    @rule()
    def preempt(self) -> None:
        self.scheduler._preempt(self.scheduler.running.pop())

    @rule(session=st.sampled_from(SESSIONS))
    def unpin(self, session: str) -> None:
        self.kv.unpin(session)

    # -- invariants --------------------------------------------------------------------------

    def _content(self, table: list[int], num_tokens: int) -> list[int | None]:
        return [self.slots.get(table[pos // BS] * BS + pos % BS) for pos in range(num_tokens)]

    @invariant()
    def computed_positions_hold_their_own_tokens(self) -> None:
        for seq in self.live:
            assert not seq.draft_token_ids
            assert (self._content(seq.block_table, seq.num_computed_tokens)
                    == seq.token_ids[:seq.num_computed_tokens]), seq
        for pinned in self.kv.pinned_sessions():
            assert (self._content(pinned.block_ids, len(pinned.token_ids))
                    == pinned.token_ids), pinned.session_id

    @invariant()
    def hashed_blocks_hold_the_hashed_tokens(self) -> None:
        for block_hash, block in self.kv.pool.cached.items():
            assert tuple(self._content([block.block_id], BS)) == self.hashed[block_hash]

    @invariant()
    def running_sequences_hold_no_block_past_their_kv(self) -> None:
        for seq in self.scheduler.running:
            assert len(seq.block_table) == -(-seq.num_computed_tokens // BS), seq

    @invariant()
    def ref_counts_equal_holders(self) -> None:
        holders: Counter[int] = Counter()
        for seq in self.live:
            holders.update(seq.block_table)
        for pinned in self.kv.pinned_sessions():
            holders.update(pinned.block_ids)
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], block
        assert self.kv.pool.num_used == len(holders)

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for seq in list(self.live):
            self._finish(seq)
        for session in SESSIONS:
            self.kv.unpin(session)
        assert self.kv.pool.num_free == self.kv.pool.num_blocks


SpecMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50,
                                         deadline=None)
TestSpecBlockInvariants = SpecMachine.TestCase
