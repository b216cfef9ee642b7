"""The host KV tier (``--kv-offloading-size``): its books (engine.host_kv_tier) and, on the real
SmolLM2 engine, blocks that leave the device pool coming back by copy: the same greedy tokens as
without the tier, a returning session computing only its new tokens, and no hit across tenants.
"""

import itertools
import random

import pytest

from engine import LLM, SamplingParams
from engine.host_kv_tier import HostKVTier

BS = 16
POOL = 40  # blocks: three 200-token histories do not fit together
HOST_GIB = 0.1  # SmolLM2 float32: 720 KiB a block, so 145 host blocks


def test_a_slot_being_loaded_is_never_handed_out() -> None:
    tier = HostKVTier(2)
    first, second = tier.stage(b"a"), tier.stage(b"b")
    tier.complete([first, second])
    assert {tier.load(b"a"), tier.load(b"b")} == {first, second}
    assert tier.stage(b"c") is None  # both slots must still be read
    tier.take_loading()
    assert tier.stage(b"c") == first  # "a" is now the least recently used
    assert tier.lookup(b"a") is None and tier.lookup(b"b") == second


def test_a_hash_is_stored_once_and_hits_refresh_it() -> None:
    tier = HostKVTier(2)
    slot = tier.stage(b"a")
    assert tier.stage(b"a") is None  # staged already: no second slot
    assert tier.lookup(b"a") is None  # not findable before its copy completed
    tier.complete([slot])
    other = tier.stage(b"b")
    tier.complete([other])
    assert tier.stage(b"a") is None  # stored already; now the most recently used
    assert tier.stage(b"c") == other  # so "b" goes first
    assert tier.lookup(b"a") == slot and tier.num_evicted == 1


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _engine(gib: float) -> LLM:
    return LLM("smollm2", num_kv_blocks=POOL, kv_offloading_size=gib)


_fillers = itertools.count(1000)


def _evict_device(llm: LLM) -> None:
    """Other traffic (never seen before) cycles the whole device pool: every block is handed
    out again, so every cached hash is evicted from the device."""
    for _ in range(2):
        llm.generate(_ids(next(_fillers), POOL * BS // 2 - 8), SamplingParams(max_tokens=1))


def _computed(llm: LLM) -> int:
    return llm.stats().num_prefill_tokens_computed


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiered() -> LLM:
    return _engine(HOST_GIB)


@pytest.fixture(scope="module")
def untiered() -> LLM:
    return _engine(0.0)


def test_greedy_output_is_the_same_with_the_tier_on_and_off(tiered, untiered) -> None:
    prompts = [_ids(seed, 150 + 20 * seed) for seed in range(3)]
    outputs = {}
    for name, llm in (("on", tiered), ("off", untiered)):
        before = llm.stats().host_cache_hits
        first = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
        _evict_device(llm)
        again = [llm.generate(p, GREEDY)[0] for p in prompts]
        outputs[name] = (first, [o.outputs[0].token_ids for o in again],
                         [o.num_cached_tokens for o in again])
        outputs[name + "_hits"] = llm.stats().host_cache_hits - before
    on, off = outputs["on"], outputs["off"]
    assert on[0] == off[0] and on[1] == off[1] and on[0] == on[1]
    assert outputs["off_hits"] == 0 and off[2] == [0, 0, 0]
    # the second pass came back from the host tier: every full block of each prompt but
    # the last token's
    assert on[2] == [(len(p) - 1) // BS * BS for p in prompts]
    assert outputs["on_hits"] == sum(on[2])


def test_an_evicted_session_computes_only_its_new_tokens(tiered) -> None:
    llm = tiered
    history = _ids(7, 200)
    first = llm.generate(history, GREEDY, session_id="s-evicted")[0]
    answer = first.outputs[0].token_ids
    pinned = len(history) + len(answer) - 1  # the last sampled token has no KV yet
    assert len(llm.engine.kv.pinned("s-evicted").token_ids) == pinned
    # other sessions take the pool: the LRU pin goes, then its cached blocks
    for i in range(2):
        llm.generate(_ids(20 + i, 280), GREEDY, session_id=f"s-other-{i}")
    _evict_device(llm)
    assert llm.engine.kv.pinned("s-evicted") is None
    stats = llm.stats()
    turn = history + answer + _ids(8, 9)
    again = llm.generate(turn, GREEDY, session_id="s-evicted")[0]
    after = llm.stats()
    reused = pinned // BS * BS  # its full blocks; the partial last one is recomputed
    assert again.num_cached_tokens == reused
    assert after.host_cache_hits - stats.host_cache_hits == reused
    assert after.num_prefill_tokens_computed - stats.num_prefill_tokens_computed == (
        len(turn) - reused)
    assert after.num_blocks_reloaded - stats.num_blocks_reloaded == reused // BS
    assert after.kv_reload_bytes - stats.kv_reload_bytes == (
        reused // BS * llm.engine.runner.bytes_per_block)


def test_a_host_block_is_never_served_to_another_tenant(tiered) -> None:
    llm = tiered
    prompt = _ids(42, 120)
    llm.generate(prompt, GREEDY, cache_salt="tenant-a")
    _evict_device(llm)
    hits = llm.stats().host_cache_hits
    other = llm.generate(prompt, GREEDY, cache_salt="tenant-b")[0]
    assert other.num_cached_tokens == 0 and llm.stats().host_cache_hits == hits
    _evict_device(llm)
    same = llm.generate(prompt, GREEDY, cache_salt="tenant-a")[0]
    assert same.num_cached_tokens == (len(prompt) - 1) // BS * BS
    assert llm.stats().host_cache_hits == hits + same.num_cached_tokens
