"""Step timing (``LLMEngine.step_timings``) on the CPU: with it on, every step records spans
whose sections are non-negative and sum to no more than its host time (no device time off a
GPU) and the step's batch: its rows, their context, the tokens it computed as the engine counts
them, and no CUDA graph; with it off, nothing is recorded. On CUDA, pure-decode steps note the
graph they replayed and its replay's device time."""

import pytest
import torch

from engine import LLM, SamplingParams

PROMPTS = ["What is the capital of France?", "Tell me a story about a robot."]


def _run(llm: LLM) -> tuple[int, list[list[int]]]:
    """Both prompts to the end, stepping by hand; returns the steps taken and the prompts."""
    engine = llm.engine
    prompts = [engine.render_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=8,
                                                       ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps, prompts


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_each_step_records_sections_within_its_host_time(overlap: bool) -> None:
    llm = LLM("smollm2", max_model_len=512, num_kv_blocks=64, async_scheduling=overlap,
              time_steps=True)
    steps, _ = _run(llm)
    timings = llm.engine.step_timings
    assert timings is not None and len(timings) == steps
    for timing in timings:
        assert timing.device_s is None
        assert timing.sections and all(s >= 0 for s in timing.sections.values())
        assert sum(timing.sections.values()) <= timing.host_s
    names = set().union(*(t.sections for t in timings))
    assert {"schedule", "prepare", "forward", "outputs"} <= names
    assert ("draw" in names) == overlap and ("sample" in names) != overlap


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_each_step_records_its_batch(overlap: bool) -> None:
    llm = LLM("smollm2", max_model_len=512, num_kv_blocks=64, async_scheduling=overlap,
              enable_prefix_caching=False, time_steps=True)
    _, prompts = _run(llm)
    engine, timings = llm.engine, llm.engine.step_timings
    first = timings[0]  # both prompts prefilled whole
    assert first.rows == 2
    assert first.context_tokens == first.tokens_computed == sum(len(p) for p in prompts)
    # then both decode: each step's context grows by one token a row
    decodes = [t for t in timings[1:] if t.rows == 2]
    assert len(decodes) >= 6
    for before, after in zip(decodes, decodes[1:], strict=False):
        assert after.context_tokens == before.context_tokens + 2
    assert sum(t.tokens_computed for t in timings) == (engine.num_prefill_tokens
                                                       + engine.num_decode_tokens)
    assert all(t.graph_size is None and t.graph_device_s is None for t in timings)


def test_nothing_is_recorded_by_default(llm: LLM) -> None:
    assert llm.engine.step_timings is None
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4))
    assert llm.engine.step_timings is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_decode_steps_time_their_graph_replay_on_cuda() -> None:
    llm = LLM("smollm2", max_model_len=512, max_num_seqs=4, dtype="bfloat16",
              time_steps=True)
    _run(llm)
    graphs = [t for t in llm.engine.step_timings if t.graph_size is not None]
    assert graphs and all(t.graph_size == 2 for t in graphs)
    for t in graphs:
        assert 0 < t.graph_device_s <= t.device_s
    eager = [t for t in llm.engine.step_timings if t.graph_size is None]
    assert all(t.graph_device_s is None and t.device_s is not None for t in eager)
