"""Continuous batching: each step, running sequences first, then waiting ones, under a token
budget (chunked prefill) and a sequence cap. While sequences run, waiting ones are admitted
once ``admission_batch`` slots are free or all of them fit, so prefills come in groups.
Tokens copied back from the host KV tier count against the token budget like computed ones,
except a step's first such copy, which is never refused: a burst of returning sessions comes
back over several steps (the first ones answer first, running requests keep stepping) rather
than all in one long step, and a history longer than the budget still comes back.

A running sequence with speculative drafts (``Sequence.draft_token_ids``) is scheduled with
them (its last token and the drafts, in one step); drafts the token budget cuts off, or those
of a sequence not scheduled this step or preempted, are dropped.

When blocks run out, the least recently used pinned session is released first; only then is
the lowest-priority running sequence preempted (its blocks freed, to be recomputed later from
the front of the waiting queue).
"""

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """``num_new_tokens[i]`` tokens of ``seqs[i]`` are computed this step, starting at its
    ``num_computed_tokens``; ``copies`` are (src, dst) block copies to perform first;
    ``offloads`` (device block, host slot) and ``reloads`` (host slot, device block) are the
    host tier's copies, to perform before those (``engine.kv_transfer``)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    offloads: list[tuple[int, int]] = field(default_factory=list)
    reloads: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 admission_batch: int = 1) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.admission_batch = admission_batch
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens + len(seq.draft_token_ids) - seq.num_computed_tokens,
                          budget)
            del seq.draft_token_ids[max(0, num_new - seq.num_tokens
                                        + seq.num_computed_tokens):]
            while not self.kv.grow(seq, num_new):
                if self.kv.unpin_lru():
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
        for seq in self.running[i:]:
            seq.draft_token_ids.clear()

        free_slots = self.max_num_seqs - len(self.running)
        if self.running and free_slots < min(self.admission_batch, len(self.waiting)):
            free_slots = 0
        reloading = False
        while not preempted and self.waiting and budget > 0 and free_slots > 0:
            seq = self.waiting[0]
            if reloading and self.kv.reload_tokens(seq) >= budget:
                break  # a second copy-back this step must leave room for a computed token
            num_new, reload = self.kv.admit(seq, budget)
            while num_new == 0:
                if not (self.kv.unpin_lru(keep=seq.session_id)
                        or (not self.running and self.kv.unpin_lru())):
                    break
                num_new, reload = self.kv.admit(seq, budget)
            if num_new == 0:
                break
            self.waiting.popleft()
            free_slots -= 1
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new + reload
            reloading = reloading or reload > 0

        batch.copies = self.kv.take_pending_copies()
        batch.offloads, batch.reloads = self.kv.take_transfers()
        return batch

    def _preempt(self, seq: Sequence) -> None:
        seq.draft_token_ids.clear()
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def add_running(self, seq: Sequence) -> None:
        """Admit an already prepared sequence (a forked sample) straight into running."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence: pin its blocks under its session, or free them."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.session_id is not None and seq.num_computed_tokens > 0:
            self.kv.pin(seq)
        else:
            self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
