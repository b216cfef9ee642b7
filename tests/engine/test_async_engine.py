"""``AsyncEngine`` runs the engine in its own process: many consumers stream from it in one
event loop and get exactly the offline engine's tokens, a cancelled consumer's request is gone
within one engine step, a slow consumer gets merged deltas, and the process starts, fails,
dies and stops cleanly."""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import pytest_asyncio

from engine import (
    LLM,
    AsyncEngine,
    EngineConfig,
    EngineDeadError,
    EngineStartupError,
    SamplingParams,
)
from engine.launch import openmp_wait

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONFIG = EngineConfig(model="smollm2", num_kv_blocks=512, max_model_len=1024)


def _alive(pid: int) -> bool:
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _wait_gone(pid: int, timeout: float) -> float:
    start = time.monotonic()
    while _alive(pid):
        assert time.monotonic() - start < timeout, f"process {pid} still alive"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    engine = AsyncEngine(CONFIG)
    await engine.start()
    yield engine
    await engine.shutdown()


async def _collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams,
                   request_id: str, **kwargs) -> tuple[list[int], str, list]:
    tokens, text, outputs = [], "", []
    async for out in engine.generate(prompt, params, request_id, **kwargs):
        outputs.append(out)
        tokens += out.outputs[0].token_ids
        text += out.outputs[0].text
    return tokens, text, outputs


async def test_concurrent_streams_equal_the_offline_engine(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [engine.tokenizer.encode(f"Stream number {i}: tell me something.")
               for i in range(32)]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    ticking = asyncio.create_task(ticker())
    results = await asyncio.gather(*(_collect(engine, p, params, f"req-{i}")
                                     for i, p in enumerate(prompts)))
    ticking.cancel()
    offline = LLM(model=CONFIG.model, num_kv_blocks=512, max_model_len=1024)
    expected = offline.generate(prompts, params)
    for (tokens, text, outputs), want in zip(results, expected, strict=True):
        assert tokens == want.outputs[0].token_ids
        assert text == want.outputs[0].text
        assert len(outputs) > 1 and outputs[-1].finished  # streamed, not all at the end
    assert ticks > 10  # the event loop kept running while the engine process worked


async def test_the_engine_process_sends_text_only_for_requests_with_stop_strings(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: dict[str, str] = {}
    route = engine._route

    def recording_route(message):  # noqa: ANN001, ANN202 - what arrives, before routing
        for output in message.outputs:
            sent[output.request_id] = sent.get(output.request_id, "") + "".join(
                c.text for c in output.outputs)
        route(message)

    monkeypatch.setattr(engine, "_route", recording_route)
    prompt = engine.tokenizer.encode("Describe the sea in two sentences.")
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    stopping = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["zzz"])
    (_, plain_text, _), (_, stop_text, _) = await asyncio.gather(
        _collect(engine, prompt, plain, "ids-only"), _collect(engine, prompt, stopping, "text"))
    assert plain_text and plain_text == stop_text  # the client's text and the engine's agree
    assert sent == {"ids-only": "", "text": stop_text}


async def test_cancelling_a_consumer_frees_its_blocks_within_one_step(
        engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    prompt = engine.tokenizer.encode("Write a very long story about a lighthouse keeper.")
    started = asyncio.Event()

    async def consume() -> None:
        async for out in engine.generate(prompt, params, "to-cancel"):
            if out.outputs[0].token_ids:
                started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    while engine.stats().num_blocks_used == 0:  # the snapshot may predate the admission
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    decoded = engine.stats().num_decode_tokens_computed
    while engine.stats().num_blocks_used > 0:
        await asyncio.sleep(0.005)
    assert engine.stats().num_decode_tokens_computed - decoded <= 2  # the step in flight
    assert engine.stats().num_requests_running == 0


async def test_a_slow_consumer_gets_merged_deltas(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = engine.tokenizer.encode("Count slowly from one to forty.")
    fast_tokens, fast_text, _ = await _collect(engine, prompt, params, "fast")
    tokens, text, outputs = [], "", []
    async for out in engine.generate(prompt, params, "slow"):
        outputs.append(out)
        tokens += out.outputs[0].token_ids
        text += out.outputs[0].text
        await asyncio.sleep(0.3)  # far slower than a step
    assert (tokens, text) == (fast_tokens, fast_text)
    assert len(outputs) < 20 and max(len(o.outputs[0].token_ids) for o in outputs) > 1


async def test_a_stream_interval_streams_the_same_tokens_and_text_in_groups_of_n(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """(The rule itself, delta by delta: ``test_output_stream.py``.)"""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompt = engine.tokenizer.encode("Count from one to thirty.")
    every_tokens, every_text, _ = await _collect(engine, prompt, params, "every-token")
    monkeypatch.setattr(engine, "stream_interval", 4)
    tokens, text, grouped = await _collect(engine, prompt, params, "grouped")
    assert (tokens, text) == (every_tokens, every_text)
    sizes = [len(o.outputs[0].token_ids) for o in grouped]
    assert all(n >= 4 for n in sizes[1:-1]) and grouped[-1].finished
    assert 1 < len(grouped) <= 1 + -(-29 // 4)  # the first token, then groups of 4


async def test_session_turns_continue_the_pinned_tokens(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=16)
    chat = [{"role": "user", "content": "Name a fruit."}]
    prompt = await engine.render_chat(chat, "fruit")
    _, answer, outputs = await _collect(engine, prompt, params, "turn-1", session_id="fruit")
    assert outputs[-1].finished
    chat += [{"role": "assistant", "content": answer},
             {"role": "user", "content": "And a vegetable?"}]
    second = await engine.render_chat(chat, "fruit")
    _, _, outputs = await _collect(engine, second, params, "turn-2", session_id="fruit")
    # the first turn's prompt and answer (but its last token, which has no KV yet) are reused
    assert outputs[0].num_cached_tokens >= len(prompt) + 1
    assert await engine.unpin_session("fruit") is True
    assert await engine.unpin_session("fruit") is False


async def test_invalid_input_raises_before_queueing(engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="prompt must not be empty"):
        async for _ in engine.generate([], SamplingParams(), request_id="bad"):
            pass
    with pytest.raises(ValueError, match="max_model_len"):
        async for _ in engine.generate([1] * 2000, SamplingParams(), request_id="long"):
            pass
    assert engine.stats().num_blocks_used == 0


async def test_a_bad_model_fails_startup_with_the_engine_error() -> None:
    engine = AsyncEngine(EngineConfig(model="/no/such/model"))
    with pytest.raises(EngineStartupError, match="is not a known model name"):
        await engine.start()


async def test_a_killed_engine_fails_open_streams_at_once_and_later_calls() -> None:
    engine = AsyncEngine(CONFIG)
    await engine.start()
    deaths: list[str] = []
    engine.on_death.append(deaths.append)
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    prompt = engine.tokenizer.encode("Tell me a long story.")
    first = asyncio.Event()
    killed_at = 0.0

    async def consume() -> None:
        async for _ in engine.generate(prompt, params, "doomed"):
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    pid = engine.pid
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="code -9"):
        await task
    assert time.monotonic() - killed_at < 1.0
    assert deaths and "code -9" in deaths[0]
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate(prompt, params, "after"):
            pass
    await engine.shutdown()


async def test_the_engine_process_runs_openmp_threads_that_spin_briefly_then_sleep(
        engine: AsyncEngine) -> None:
    """GOMP_SPINCOUNT bounded and OMP_WAIT_POLICY=PASSIVE in the engine process, unless the
    caller's environment sets either (spinning threads starve each other on a CPU the gateway
    shares; threads that sleep at once make one stream wait for wake-ups)."""
    with open(f"/proc/{engine.pid}/environ", "rb") as f:
        environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    expected = {k.encode(): v.encode()
                for k, v in openmp_wait(os.environ).items()}
    for name in (b"OMP_WAIT_POLICY", b"GOMP_SPINCOUNT"):
        assert environ.get(name) == (expected.get(name) or os.environb.get(name))


async def test_a_caller_that_sets_an_openmp_wait_variable_rules_alone() -> None:
    assert openmp_wait({}) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}
    assert openmp_wait({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert openmp_wait({"GOMP_SPINCOUNT": "0", "PATH": "/bin"}) == {}
    assert openmp_wait({"PATH": "/bin"})["GOMP_SPINCOUNT"] == "20000"


async def test_shutdown_stops_the_engine_process() -> None:
    engine = AsyncEngine(CONFIG)
    await engine.start()
    pid = engine.pid
    assert _alive(pid)
    await engine.shutdown()
    assert not _alive(pid)


async def test_the_engine_exits_when_its_parent_is_killed(tmp_path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import asyncio, sys
        from engine import AsyncEngine, EngineConfig

        async def main():
            engine = AsyncEngine(EngineConfig(model="smollm2", num_kv_blocks=64))
            await engine.start()
            print(engine.pid, flush=True)
            await asyncio.sleep(3600)

        asyncio.run(main())
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        pid = int(await asyncio.to_thread(parent.stdout.readline))
        assert _alive(pid)
        parent.kill()
        parent.wait()
        await _wait_gone(pid, timeout=5.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            parent.kill()
