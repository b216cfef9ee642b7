"""Grouped admission: while sequences run, waiting ones join only once ``admission_batch``
slots are free or all of them fit; with nothing running they join at once. Copies back from
the host KV tier share the step's token budget."""

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


def _through_the_host_tier(scheduler: Scheduler, prompts: list[list[int]]) -> None:
    """Run each prompt once and push its blocks out of the device pool into the host tier (the
    offloads' copies reported complete at once, as on CPU)."""
    kv = scheduler.kv
    fillers = (list(range(5000 + 100 * i, 5000 + 100 * i + 4 * kv.pool.num_blocks))
               for i in range(len(prompts)))
    for prompt in prompts:
        for tokens in (prompt, next(fillers)):
            seq = Sequence(str(tokens[0]), 0, tokens, SamplingParams(), None)
            scheduler.add(seq)
            while seq.num_computed_tokens < seq.num_tokens:
                batch = scheduler.schedule()
                kv.complete_offloads([slot for _, slot in batch.offloads])
                for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
                    kv.commit(s, n)
            scheduler.finish(seq)
    kv.complete_offloads([slot for _, slot in kv.take_transfers()[0]])


def test_host_tier_reloads_count_against_the_token_budget() -> None:
    """Three returning prompts whose 16-token prefixes are all on the host, with a budget of
    20 tokens a step: one comes back per step (its reload always admitted, the next one's
    refused once it exceeds what is left), not all three in the first step."""
    kv = KVCacheManager(24, 4, True, 0, host_blocks=128)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=20)
    prompts = [[100 * (i + 1) + t for t in range(17)] for i in range(3)]
    _through_the_host_tier(scheduler, prompts)
    returning = [Sequence(f"r{i}", 0, list(p), SamplingParams(), None)
                 for i, p in enumerate(prompts)]
    assert [kv.reload_tokens(seq) for seq in returning] == [16, 16, 16]
    for seq in returning:
        scheduler.add(seq)
    admitted_per_step = []
    for _ in range(3):
        batch = scheduler.schedule()
        admitted_per_step.append([s.request_id for s, n in
                                  zip(batch.seqs, batch.num_new_tokens, strict=True)
                                  if s.num_computed_tokens == 16 and n == 1])
        assert len(batch.reloads) == 4 * len(admitted_per_step[-1])
        for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            kv.commit(s, n)
            s.token_ids.append(0)
    assert admitted_per_step == [["r0"], ["r1"], ["r2"]]
    assert all(seq.num_cached_tokens == 16 for seq in returning)


def test_a_reload_longer_than_the_budget_still_comes_back() -> None:
    kv = KVCacheManager(24, 4, True, 0, host_blocks=128)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8)
    prompt = [300 + t for t in range(17)]
    _through_the_host_tier(scheduler, [prompt])
    seq = Sequence("back", 0, list(prompt), SamplingParams(), None)
    scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.seqs == [seq] and batch.num_new_tokens == [1] and len(batch.reloads) == 4
