"""Step timing (``LLMEngine.step_timings``) on the CPU: with it on, every step records spans
whose sections are non-negative and sum to no more than its host time (no device time off a
GPU); with it off, nothing is recorded."""

import pytest

from engine import LLM, SamplingParams

PROMPTS = ["What is the capital of France?", "Tell me a story about a robot."]


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_each_step_records_sections_within_its_host_time(overlap: bool) -> None:
    llm = LLM("smollm2", max_model_len=512, num_kv_blocks=64, async_scheduling=overlap,
              time_steps=True)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), engine.render_chat([{"role": "user", "content": prompt}]),
                           SamplingParams(temperature=0, max_tokens=8))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    timings = engine.step_timings
    assert timings is not None and len(timings) == steps
    for timing in timings:
        assert timing.device_s is None
        assert timing.sections and all(s >= 0 for s in timing.sections.values())
        assert sum(timing.sections.values()) <= timing.host_s
    names = set().union(*(t.sections for t in timings))
    assert {"schedule", "prepare", "forward", "outputs"} <= names
    assert ("draw" in names) == overlap and ("sample" in names) != overlap


def test_nothing_is_recorded_by_default(llm: LLM) -> None:
    assert llm.engine.step_timings is None
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4))
    assert llm.engine.step_timings is None
