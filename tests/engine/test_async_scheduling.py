"""Overlapped scheduling (``async_scheduling``) on the CPU path: outputs arrive one step later
but are those of synchronous steps (lengths, stops, seeds, sessions; penalties, sampled once
the previous token is read; grammars, drawn at the next step once their masks are filled;
logprobs and n > 1, which run synchronously); grammar rows are drawn once their masks are
filled, however late, and a failed mask job, or a grammar worker that dies, fails the step
that reads its tokens; an abort while a token is in flight reports nothing of it and frees every
block."""

import json
import os
import signal
import threading

import pytest

from engine import LLM, SamplingParams
from engine.grammar_worker import GrammarWorker, MaskJob
from engine.inflight import PLACEHOLDER
from engine.structured_output import StructuredOutput

CITY = StructuredOutput(json_schema=json.dumps(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
CHATS = ["Write a haiku about the sea.", "What is the capital of France?",
         "List three uses of copper.", "Tell me a story about a robot."]


@pytest.fixture(scope="module")
def engines() -> dict[bool, LLM]:
    return {mode: LLM("smollm2", max_model_len=1024, num_kv_blocks=256, async_scheduling=mode)
            for mode in (False, True)}


def _prompts(llm: LLM) -> list[list[int]]:
    return [llm.engine.render_chat([{"role": "user", "content": c}]) for c in CHATS]


def _run(llm: LLM, params: list[SamplingParams]) -> list[tuple]:
    outs = llm.generate(_prompts(llm), params)
    assert llm.engine.kv.pool.num_used == 0
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
             [lp.logprob for lp in c.logprobs] if c.logprobs is not None else None)
            for o in outs for c in o.outputs]


def test_overlapped_outputs_equal_synchronous_for_lengths_stops_and_seeds(engines) -> None:
    params = [SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(temperature=0, max_tokens=200),  # runs to its end of turn
              SamplingParams(temperature=0, max_tokens=40, stop=["."]),
              SamplingParams(temperature=0.9, seed=5, max_tokens=30)]
    sync, overlapped = _run(engines[False], params), _run(engines[True], params)
    assert overlapped == sync
    assert [r[2] for r in sync] == ["length", "stop", "stop", "length"]


def test_grammars_penalties_logprobs_and_forks_sample_as_in_synchronous_steps(engines) -> None:
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, structured=CITY),
              SamplingParams(temperature=0, max_tokens=12, frequency_penalty=1.5),
              SamplingParams(temperature=0.7, seed=1, max_tokens=12, n=2)]
    sync, overlapped = _run(engines[False], params), _run(engines[True], params)
    assert overlapped == sync
    assert len(sync[0][4]) == 12  # logprobs of every token


def test_overlapped_grammar_rows_drawn_while_masks_fill_slowly_sample_as_synchronous(
        engines, monkeypatch) -> None:
    """Every step overlaps (no logprobs, no forks); each mask job reaches the grammar worker
    5 ms late, so the draw that needs its masks is made while they are still being filled."""
    submit = GrammarWorker.submit
    jobs = []

    def late_submit(worker: GrammarWorker, job: MaskJob) -> None:
        jobs.append(job.number)
        threading.Timer(0.005, submit, (worker, job)).start()

    monkeypatch.setattr(GrammarWorker, "submit", late_submit)
    params = [SamplingParams(temperature=0, max_tokens=30, structured=CITY),
              SamplingParams(temperature=0.8, seed=3, max_tokens=30, structured=CITY),
              SamplingParams(temperature=0, max_tokens=20, presence_penalty=1.0),
              SamplingParams(temperature=0, max_tokens=20)]
    sync, overlapped = _run(engines[False], params), _run(engines[True], params)
    assert overlapped == sync
    assert len(jobs) >= 20
    assert all(json.loads(text)["city"] for _, text, *_ in sync[:2])


def _constrained_tokens_until_a_step_fails(llm: LLM) -> tuple[list[int], str]:
    """Run one constrained request step by step; the tokens returned before a step raised."""
    llm.engine.add_request("r", _prompts(llm)[1], SamplingParams(temperature=0, max_tokens=20,
                                                                 structured=CITY))
    tokens: list[int] = []
    with pytest.raises(RuntimeError) as raised:
        while True:
            tokens += [t for out in llm.engine.step() for t in out.outputs[0].token_ids]
    return tokens, str(raised.value)


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_a_failed_mask_job_fails_a_step_before_a_token_drawn_under_it_is_returned(
        monkeypatch, overlap: bool) -> None:
    """The third job names a matcher the worker does not hold: the worker reports its error,
    and no token drawn under that job's masks is returned. The error is that step's alone:
    once the request is aborted (as the engine process does after a failed step), the same
    request is served again with the answer of an undisturbed run."""
    llm = LLM("smollm2", max_model_len=512, num_kv_blocks=64, async_scheduling=overlap)
    params = SamplingParams(temperature=0, max_tokens=20, structured=CITY)
    want = llm.generate([_prompts(llm)[1]], params)[0].outputs[0].token_ids
    submit = GrammarWorker.submit
    submitted = []

    def third_fails(worker: GrammarWorker, job: MaskJob) -> None:
        submitted.append(job.number)
        submit(worker, job._replace(filling=[10**9]) if len(submitted) == 3 else job)

    monkeypatch.setattr(GrammarWorker, "submit", third_fails)
    tokens, error = _constrained_tokens_until_a_step_fails(llm)
    assert error.startswith("grammar mask job failed: KeyError")
    # drawn under the first two masks (overlapped on the CPU, the second is lost: the step
    # that returns it raises when its draw waits for the third masks)
    assert 1 <= len(tokens) <= 2
    for request_id in list(llm.engine.requests):
        llm.engine.abort(request_id)
    assert llm.generate([_prompts(llm)[1]], params)[0].outputs[0].token_ids == want
    assert llm.engine.kv.pool.num_used == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_a_killed_grammar_worker_fails_the_step_waiting_for_it_and_a_new_one_serves_later(
        monkeypatch, overlap: bool) -> None:
    """The worker is killed as the third job of a request is sent: the step waiting for that
    job raises an error naming the worker's exit instead of hanging. Once the request is
    aborted (as the engine process does after a failed step), a new worker serves the same
    request again, with the answer of an undisturbed run, and every block is free."""
    llm = LLM("smollm2", max_model_len=512, num_kv_blocks=64, async_scheduling=overlap)
    params = SamplingParams(temperature=0, max_tokens=20, structured=CITY)
    want = llm.generate([_prompts(llm)[1]], params)[0].outputs[0].token_ids
    first = llm.engine.grammars.compiler._worker
    submit = GrammarWorker.submit
    submitted = []

    def kill_at_third(worker: GrammarWorker, job: MaskJob) -> None:
        submitted.append(job.number)
        if len(submitted) == 3:
            os.kill(worker._proc.pid, signal.SIGKILL)
        submit(worker, job)

    monkeypatch.setattr(GrammarWorker, "submit", kill_at_third)
    tokens, error = _constrained_tokens_until_a_step_fails(llm)
    assert error == f"the grammar worker exited with code {-signal.SIGKILL} (its log says why)"
    assert 1 <= len(tokens) <= 2
    for request_id in list(llm.engine.requests):
        llm.engine.abort(request_id)
    assert llm.generate([_prompts(llm)[1]], params)[0].outputs[0].token_ids == want
    assert llm.engine.grammars.compiler._worker is not first
    assert llm.engine.kv.pool.num_used == 0


def test_an_overlapped_step_reports_the_step_before() -> None:
    llm = LLM("smollm2", max_model_len=512, num_kv_blocks=64, async_scheduling=True)
    engine = llm.engine
    engine.add_request("r", _prompts(llm)[1], SamplingParams(temperature=0, max_tokens=3))
    assert engine.step() == []  # the prompt ran; its first token is still in flight
    assert engine.requests["r"].seqs[0].token_ids[-1] == PLACEHOLDER
    counts = [len(out.outputs[0].token_ids) for _ in range(4) for out in engine.step()]
    assert counts == [1, 1, 1]
    assert not engine.has_unfinished() and engine.kv.pool.num_used == 0


def test_abort_while_a_token_is_in_flight_reports_no_placeholder_and_frees_blocks() -> None:
    llm = LLM("smollm2", max_model_len=512, num_kv_blocks=64, async_scheduling=True)
    engine = llm.engine
    prompts = _prompts(llm)
    engine.add_request("gone", prompts[0], SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("stays", prompts[1], SamplingParams(temperature=0, max_tokens=8,
                                                           ignore_eos=True))
    tokens: dict[str, list[int]] = {"gone": [], "stays": []}
    for _ in range(3):
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
    assert engine.requests["gone"].seqs[0].token_ids[-1] == PLACEHOLDER
    last = engine.abort("gone")
    assert last is not None and last.finished
    tokens["gone"] += last.outputs[0].token_ids
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "stays"
            tokens["stays"] += out.outputs[0].token_ids
    assert len(tokens["gone"]) == 2 and len(tokens["stays"]) == 8
    assert PLACEHOLDER not in tokens["gone"] + tokens["stays"]
    assert engine.kv.pool.num_used == 0


def test_session_pins_and_reuse_are_those_of_synchronous_steps(engines) -> None:
    pins = {}
    for mode, llm in engines.items():
        engine = llm.engine
        chat = [{"role": "user", "content": "Name a fruit."}]
        first = engine.render_chat(chat, session_id=f"s-{mode}")
        out = llm.generate([first], SamplingParams(temperature=0, max_tokens=10),
                           session_id=f"s-{mode}")[0]
        pinned = engine.kv.pinned(f"s-{mode}")
        assert pinned is not None and PLACEHOLDER not in pinned.token_ids
        chat += [{"role": "assistant", "content": out.outputs[0].text},
                 {"role": "user", "content": "And a vegetable?"}]
        second = engine.render_chat(chat, session_id=f"s-{mode}")
        computed = engine.num_prefill_tokens
        out2 = llm.generate([second], SamplingParams(temperature=0, max_tokens=10),
                            session_id=f"s-{mode}")[0]
        new_tokens = engine.num_prefill_tokens - computed
        assert out2.num_cached_tokens == len(second) - new_tokens
        pins[mode] = (pinned.token_ids, out2.outputs[0].token_ids, new_tokens)
        llm.unpin_session(f"s-{mode}")
    assert pins[True] == pins[False]


def test_abort_while_a_grammar_row_waits_for_its_mask_leaves_the_others_valid() -> None:
    llm = LLM("smollm2", max_model_len=512, num_kv_blocks=64, async_scheduling=True)
    engine = llm.engine
    prompts = _prompts(llm)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    structured = StructuredOutput(json_schema=json.dumps(schema))
    engine.add_request("gone", prompts[0], SamplingParams(temperature=0, max_tokens=50,
                                                          structured=structured))
    engine.add_request("stays", prompts[1], SamplingParams(temperature=0, max_tokens=50,
                                                           structured=structured))
    text = {"gone": "", "stays": ""}
    for _ in range(3):
        for out in engine.step():
            text[out.request_id] += out.outputs[0].text
    assert engine.requests["gone"].seqs[0].token_ids[-1] == PLACEHOLDER  # its draw waits
    last = engine.abort("gone")
    assert last is not None and last.finished
    finish = None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "stays"
            text["stays"] += out.outputs[0].text
            finish = out.outputs[0].finish_reason
    assert finish == "stop" and set(json.loads(text["stays"])) == {"ok"}
    assert engine.kv.pool.num_used == 0
