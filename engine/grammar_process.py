"""The grammar worker process (``engine.grammar_worker`` starts it, and holds the engine's end):
its matchers, its loop (:func:`main`), and the xgrammar calls it makes. It is run by its path,
so it imports only xgrammar, torch, numpy and the standard library, not the engine's package
(whose imports would double the worker's start).
"""

from __future__ import annotations

import mmap
import os
import pickle
import sys
import time
from functools import cache
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any, NamedTuple

import numpy as np
import torch

from engine.json_bounds import bounded_schema

MAX_WHITESPACE = 16  # whitespace characters allowed between two JSON tokens
ALL_ENDED = 0b11  # the signal word of a worker that exited: every wait for a job passes


def ended_bits(number: int) -> int:
    """The signal word once job ``number`` has ended: the bit of its parity. One job is
    outstanding at a time, so while job ``number`` runs the word is its predecessor's, the
    other bit."""
    return 1 << (number & 1)


class MaskJob(NamedTuple):
    """One job: map the bitmask sent after it if ``new_bitmask_rows`` (its row count), create
    matchers ``created`` (id, JSON schema), advance matcher ``accepting[i]`` by ``tokens[i]``,
    fill bitmask row ``rows[i]`` from matcher ``filling[i]``, forget matchers ``dropped``; then
    record the job's end in the shared :class:`JobState`, and answer (job number, error or
    None) if the job failed or ``answer`` is set. :meth:`GrammarWorker.submit` sets the last
    two fields."""

    number: int
    created: list[tuple[int, str]]
    dropped: list[int]
    accepting: list[int]
    tokens: list[int]
    filling: list[int]
    rows: list[int]
    answer: bool = True
    new_bitmask_rows: int = 0


class JobState:
    """The page of job state the worker shares with the engine (a memfd mapping, page-locked
    and its first word waited on by CUDA streams where there is a GPU): ``words[0]`` is the
    signal word, ``ended_bits`` of the last job ended (``ALL_ENDED`` once the worker has
    exited), ``words[1]`` the number of the last job that failed (0: none yet), ``times`` the
    ``time.perf_counter()`` at which the last job ended was received and ended (the system's
    monotonic clock, which both processes read alike). The worker writes the words last."""

    def __init__(self, page: mmap.mmap) -> None:
        self.words = np.frombuffer(page, dtype=np.uint32, count=2)
        self.times = np.frombuffer(page, dtype=np.float64, count=2, offset=8)


def compile_json_schema(compiler: Any, schema: str) -> Any:
    """The grammar of JSON Schema ``schema`` (serialized), compiled by xgrammar's
    ``compiler``."""
    # bounded whitespace between tokens: a weak model under a grammar that allows any amount
    # of it can fill max_tokens with blank lines and never close the object
    # and bounded strings and numbers, for the same reason (``engine.json_bounds``)
    return compiler.compile_json_schema(bounded_schema(schema),
                                        max_whitespace_cnt=MAX_WHITESPACE)


# xgrammar's batch calls, made straight into its core (on core matchers,
# ``GrammarMatcher._handle``): its public wrappers turn the accept's result into a Python list
# element by element, which at 64 rows costs more than the accepts themselves.
def accept_tokens(matchers: list[Any], tokens: list[int]) -> None:
    """Advance each matcher by its token (one its grammar allowed: the result is not read)."""
    import xgrammar

    xgrammar.base._core.BatchGrammarMatcher.batch_accept_token(matchers, tokens, False)


def fill_bitmask(matchers: list[Any], bitmask: torch.Tensor, rows: list[int]) -> None:
    """Fill ``bitmask`` row ``rows[i]`` with the allowed tokens of ``matchers[i]``."""
    _batch_matcher()._handle.batch_fill_next_token_bitmask(matchers, bitmask, rows, False)


@cache
def _batch_matcher() -> Any:
    """xgrammar's multi-threaded filler of many matchers' bitmasks (one per process)."""
    import xgrammar

    return xgrammar.BatchGrammarMatcher()


def main() -> None:
    """The worker process, with last arguments ``SOCKET STATE INFO WORDS`` (inherited file
    descriptors: the socket to the engine, the :class:`JobState` page's mapping, the serialized
    tokenizer info; int32 words per bitmask row). Serves jobs until the engine's end of the
    socket closes."""
    import xgrammar as xgr

    socket_fd, state_fd, info_fd, words = map(int, sys.argv[-4:])
    conn = Connection(socket_fd)
    with os.fdopen(info_fd, "rb") as info:
        info.seek(0)  # the engine's write left the shared offset at the end
        tokenizer_info = info.read().decode()
    state = JobState(mmap.mmap(state_fd, mmap.PAGESIZE))
    os.close(state_fd)
    bitmask = torch.empty(0, words, dtype=torch.int32)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info))
    grammars: dict[str, object] = {}
    matchers: dict[int, object] = {}
    while True:
        try:
            job = MaskJob(*conn.recv())
            received = time.perf_counter()
            if job.new_bitmask_rows:
                fd = recv_handle(conn)
                size = job.new_bitmask_rows * words * 4
                bitmask = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.int32).view(-1, words)
                os.close(fd)
        except (EOFError, OSError):  # the engine's end closed
            return
        error = None
        try:
            for matcher_id, schema in job.created:
                if schema not in grammars:
                    grammars[schema] = compile_json_schema(compiler, schema)
                matchers[matcher_id] = xgr.GrammarMatcher(grammars[schema])._handle
            if job.accepting:
                accept_tokens([matchers[i] for i in job.accepting], job.tokens)
            if job.rows:
                fill_bitmask([matchers[i] for i in job.filling], bitmask, job.rows)
            for matcher_id in job.dropped:
                matchers.pop(matcher_id, None)  # (made by a worker before this one: never here)
        except Exception as e:  # the engine raises it where the masks are used
            error = f"{type(e).__name__}: {e}"
        if error is not None or job.answer:  # (sent before the job is seen to end)
            conn.send_bytes(pickle.dumps((job.number, error)))
        state.times[:] = received, time.perf_counter()
        if error is not None:
            state.words[1] = job.number & 0xFFFFFFFF
        state.words[0] = ended_bits(job.number)


if __name__ == "__main__":
    main()
