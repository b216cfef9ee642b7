"""The engine's greedy tokens equal transformers' greedy tokens, with steps that
mix prefill and decode, for several block sizes, chunked prefill, overlapped scheduling and a
pool small enough to force preemption (with steps synchronous and overlapped)."""

import pytest

from engine import LLM, SamplingParams
from tests.engine.conftest import MAX_NEW_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


def _assert_equal(outputs, hf_greedy) -> None:
    for i, (output, expected) in enumerate(zip(outputs, hf_greedy, strict=True)):
        assert output.outputs[0].token_ids == expected, f"prompt {i} diverges"


@pytest.mark.parametrize("config", [
    {"block_size": 16},
    {"block_size": 8},
    {"block_size": 32},
    {"max_num_batched_tokens": 64},
    {"async_scheduling": True, "max_num_batched_tokens": 256},
], ids=["block16", "block8", "block32", "chunked-prefill-64", "overlapped"])
def test_greedy_matches_transformers(config, prompt_ids, hf_greedy) -> None:
    llm = LLM("smollm2", **config)
    outputs = llm.generate(prompt_ids, GREEDY)
    _assert_equal(outputs, hf_greedy)
    stats = llm.stats()
    assert stats.num_blocks_used == 0
    if "max_num_batched_tokens" in config:
        assert max(len(p) for p in prompt_ids) > 64  # so some prefill really was chunked


@pytest.mark.parametrize("overlapped", [False, True], ids=["synchronous", "overlapped"])
def test_greedy_matches_transformers_under_preemption(prompt_ids, hf_greedy,
                                                      overlapped: bool) -> None:
    longest = max(len(p) for p in prompt_ids) + MAX_NEW_TOKENS
    num_blocks = -(-longest // 16) + 8  # the longest request fits, all 16 together do not
    llm = LLM("smollm2", num_kv_blocks=num_blocks, enable_prefix_caching=False,
              async_scheduling=overlapped)
    outputs = llm.generate(prompt_ids, GREEDY)
    _assert_equal(outputs, hf_greedy)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.num_blocks_used == 0


def test_batch_mixes_prefill_and_decode(prompt_ids) -> None:
    """A request arriving while others decode shares their steps (continuous batching)."""
    llm = LLM("smollm2")
    engine = llm.engine
    engine.add_request("early", prompt_ids[0], GREEDY)
    engine.step()
    engine.add_request("late", prompt_ids[1], GREEDY)
    batch = engine.scheduler.schedule()
    kinds = {n == 1 for n in batch.num_new_tokens}
    assert kinds == {True, False}
