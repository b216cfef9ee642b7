"""The grammar worker's protocol in the mode a GPU runs it (no answer for a job that ends well:
its end is read from the shared job state), run here on the CPU: a job's end is seen, its
masks are filled, a failed job's error is still raised (and only for that job), and a worker
killed while a job is outstanding fails the wait for it instead of hanging."""

import os
import signal

import pytest

from engine import LLM
from engine.grammar_process import ALL_ENDED, MaskJob, ended_bits
from engine.grammar_worker import GrammarWorker

pytest.importorskip("xgrammar")

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


@pytest.fixture
def worker(llm: LLM) -> GrammarWorker:
    grammars = llm.engine.grammars.compiler
    info = grammars._tokenizer_info()
    worker = GrammarWorker(info.serialize_json(), (grammars.vocab_size + 31) // 32, pin=False)
    worker.answers = False  # as where the GPU waits on the signal word
    yield worker
    worker.close()


def test_jobs_end_in_the_shared_state_and_only_a_failed_one_is_answered(
        worker: GrammarWorker, llm: LLM) -> None:
    bitmask = worker.bitmask(2)
    bitmask.zero_()
    worker.submit(MaskJob(1, [(7, SCHEMA)], [], [], [], [7], [0]))
    worker.wait(1)
    assert worker._state.words[0] == ended_bits(1)
    assert bitmask[0].any() and not bitmask[1].any()  # row 0 filled: "{" is allowed
    brace = llm.engine.tokenizer.encode("{", add_special_tokens=False)
    worker.submit(MaskJob(2, [], [], [7], brace, [99], [0]))  # no matcher 99
    worker.wait(2, job_error=False)
    with pytest.raises(RuntimeError, match="grammar mask job failed: KeyError"):
        worker.wait(2)
    worker.submit(MaskJob(3, [], [], [], [], [7], [1]))  # fine again
    worker.wait(3)
    assert worker._state.words[0] == ended_bits(3) and bitmask[1].any()


def test_a_worker_killed_with_a_job_outstanding_fails_the_wait(worker: GrammarWorker) -> None:
    worker.bitmask(1)
    worker.submit(MaskJob(1, [(7, SCHEMA)], [], [], [], [7], [0]))
    worker.wait(1)
    os.kill(worker._proc.pid, signal.SIGSTOP)  # the next job stays outstanding
    worker.submit(MaskJob(2, [], [], [], [], [7], [0]))
    os.kill(worker._proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=f"exited with code {-signal.SIGKILL}"):
        worker.wait(2)
    assert worker._state.words[0] == ALL_ENDED and worker.exit_code == -signal.SIGKILL
