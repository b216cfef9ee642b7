"""Grouped admission: while sequences run, waiting ones join only once ``admission_batch``
slots are free or all of them fit; with nothing running they join at once."""

import pytest

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


def make(n: int, start: int = 0) -> list[Sequence]:
    return [Sequence(str(start + i), 0, [1, 2, 3], SamplingParams(), None) for i in range(n)]


def run_step(scheduler: Scheduler) -> list[Sequence]:
    batch = scheduler.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        scheduler.kv.commit(seq, n)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(0)
    return [seq for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if n > 1]


def test_waiting_sequences_join_in_groups_while_others_run() -> None:
    scheduler = Scheduler(KVCacheManager(64, 4, False, 0), max_num_seqs=8,
                          max_num_batched_tokens=1024, admission_batch=3)
    first = make(8)
    for seq in first:
        scheduler.add(seq)
    assert len(run_step(scheduler)) == 8  # nothing ran: all admitted at once
    for seq in make(5, start=100):
        scheduler.add(seq)
    for freed in range(1, 4):
        scheduler.finish(first[freed - 1])
        admitted = run_step(scheduler)
        if freed < 3:
            assert admitted == [], f"admitted with only {freed} free slots"
    assert len(admitted) == 3
    assert len(scheduler.waiting) == 2
    scheduler.finish(first[3])
    scheduler.finish(first[4])
    assert len(run_step(scheduler)) == 2  # fewer waiting than the group size: all of them fit


def test_default_admits_as_soon_as_a_slot_frees() -> None:
    scheduler = Scheduler(KVCacheManager(64, 4, False, 0), max_num_seqs=2,
                          max_num_batched_tokens=1024)
    first = make(2)
    for seq in [*first, *make(3, start=10)]:
        scheduler.add(seq)
    run_step(scheduler)
    scheduler.finish(first[0])
    assert len(run_step(scheduler)) == 1


def test_admission_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="admission_batch"):
        EngineConfig(admission_batch=0)
