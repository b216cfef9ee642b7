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

MAX_WHITESPACE = 16  # whitespace characters allowed between two JSON tokens


class MaskJob(NamedTuple):
    """One job: map the bitmask sent after it if ``new_bitmask_rows`` (its row count, set by
    :meth:`GrammarWorker.submit`), create matchers ``created`` (id, JSON schema), advance matcher
    ``accepting[i]`` by ``tokens[i]``, fill bitmask row ``rows[i]`` from matcher
    ``filling[i]``, forget matchers ``dropped``; then raise the counter to ``number``."""

    number: int
    created: list[tuple[int, str]]
    dropped: list[int]
    accepting: list[int]
    tokens: list[int]
    filling: list[int]
    rows: list[int]
    new_bitmask_rows: int = 0


def compile_json_schema(compiler: Any, schema: str) -> Any:
    """The grammar of JSON Schema ``schema`` (serialized), compiled by xgrammar's
    ``compiler``."""
    # bounded whitespace between tokens: a weak model under a grammar that allows any amount
    # of it can fill max_tokens with blank lines and never close the object
    return compiler.compile_json_schema(schema, max_whitespace_cnt=MAX_WHITESPACE)


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
    """The worker process, with last arguments ``SOCKET COUNTER INFO WORDS`` (inherited file
    descriptors: the socket to the engine, the counter's mapping, the serialized tokenizer
    info; int32 words per bitmask row). Serves jobs until the engine's end of the socket
    closes; each answer is (job number, error or None, ``time.perf_counter()`` when the job
    was received and when its counter was raised: the system's monotonic clock, which the
    engine's process reads alike)."""
    import xgrammar as xgr

    socket_fd, counter_fd, info_fd, words = map(int, sys.argv[-4:])
    conn = Connection(socket_fd)
    with os.fdopen(info_fd, "rb") as info:
        info.seek(0)  # the engine's write left the shared offset at the end
        tokenizer_info = info.read().decode()
    counter = np.frombuffer(mmap.mmap(counter_fd, mmap.PAGESIZE), dtype=np.uint32, count=1)
    os.close(counter_fd)
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
        finally:
            counter[0] = job.number & 0xFFFFFFFF
        conn.send_bytes(pickle.dumps((job.number, error, received, time.perf_counter())))


if __name__ == "__main__":
    main()
