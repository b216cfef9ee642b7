"""The grammar worker: a process of its own that holds the structured-output matchers and fills
their token masks, so that neither xgrammar's work nor the Python around it competes with the
engine's thread for the GIL.

The engine (:class:`GrammarWorker`) and the worker (``engine/grammar_process.py``, run by its
path so that it imports only xgrammar, torch and numpy) share two memory mappings
(memfds): the job state (``grammar_process.JobState``: a signal word, the last failed job),
and the bitmask rows (replaced by a larger one when a step has more rows: the job that first
uses a bitmask sends it along). On a GPU both are page-locked and mapped for the device, whose
kernels read the bitmask in place. A job is one message (``MaskJob``): the matchers it
creates, the tokens matchers advance by, the rows to fill, and the matchers dropped since the
last job. The worker advances, fills, then sets the signal word to the job's ``ended_bits``
(whatever happened: a CUDA stream may be waiting on it, see ``engine.stream_wait``). It
answers a job that failed, with its error; every job only where there is no GPU signal and
the host waits for the answers. One job is outstanding at a time: the engine waits for a job
(:meth:`GrammarWorker.wait`) before it sends the next, so a wait for a job's bit can only pass
once that job has ended. When the worker exits, a watcher thread sets every bit, so that no
stream waits for it forever, and every later wait raises.
"""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from pathlib import Path

import torch

from engine.grammar_process import ALL_ENDED, JobState, MaskJob, ended_bits
from engine.stream_wait import (
    HostSignal,
    device_view,
    register_host_memory,
    unregister_host_memory,
)

# the worker runs grammar_process.py by its path, so that it imports none of the engine's package
_PROCESS = Path(__file__).with_name("grammar_process.py")
_RUN = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
MIN_BITMASK_ROWS = 64
_POLL_S = 20e-6  # a host wait for a job's signal sleeps this long between looks (a rare wait)


class GrammarWorker:
    """The engine's end of the worker (see the module docstring). ``signal`` is the signal
    word a CUDA stream can wait on, None where the host must wait for a job's answer instead
    (``pin`` false, as on a CPU, or no driver support: then ``answers``, every job answered);
    ``pin`` also page-locks the bitmask and maps it for the device (``device_bitmask``: all its
    rows, None where that failed)."""

    def __init__(self, tokenizer_info: str, words: int, pin: bool) -> None:
        """``tokenizer_info``: xgrammar's ``TokenizerInfo``, serialized; ``words``: int32 per
        bitmask row."""
        self.words = words
        state_fd = os.memfd_create("chatgate-grammar-state")
        info_fd = os.memfd_create("chatgate-tokenizer-info")
        ours, theirs = socket.socketpair()
        try:
            os.ftruncate(state_fd, mmap.PAGESIZE)
            self._state_mapping = mmap.mmap(state_fd, mmap.PAGESIZE)
            with os.fdopen(os.dup(info_fd), "wb") as info:
                info.write(tokenizer_info.encode())
            fds = (theirs.fileno(), state_fd, info_fd)
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _RUN, str(_PROCESS), *map(str, fds), str(words)],
                pass_fds=fds)
        finally:
            theirs.close()
            os.close(state_fd)
            os.close(info_fd)
        self._conn = Connection(ours.detach())
        self._pin = pin
        self._pinned: list[torch.Tensor] = []  # page-locked memory, unlocked by close
        self._close = weakref.finalize(self, _close, self._conn, self._proc, self._pinned)
        self._close.atexit = False  # (at exit the worker sees the socket close)
        self._state = JobState(self._state_mapping)
        page = torch.frombuffer(self._state_mapping, dtype=torch.int32)
        self.signal = None
        if pin and register_host_memory(page):
            self._pinned.append(page)
            self.signal = HostSignal.create(page[:1], ended_bits(0))  # no job yet
        # every job is answered where the host waits for the answers (no signal)
        self.answers = self.signal is None
        self._bitmask = torch.empty(0, words, dtype=torch.int32)
        self.device_bitmask: torch.Tensor | None = None
        self._bitmask_fd: int | None = None  # a new bitmask's, until a job sends it
        self._submitted = self._ended = 0
        self._errors: dict[int, str] = {}
        # set once a send or a wait has found the worker gone (no system call a step to ask)
        self.exit_code: int | None = None
        threading.Thread(target=_signal_when_exited, args=(self._proc, self._state),
                         name="grammar-worker-watch", daemon=True).start()

    def bitmask(self, rows: int, reserve: int = 0) -> torch.Tensor:
        """The first ``rows`` rows of the shared bitmask, which holds at least
        ``max(rows, reserve)`` (a larger one replaces it if it has fewer, and
        ``device_bitmask`` with it: call before the job that fills them is made, and only once
        no queued kernel or copy reads the old one)."""
        if max(rows, reserve) > self._bitmask.shape[0]:
            size = max(rows, reserve, 2 * self._bitmask.shape[0], MIN_BITMASK_ROWS) * self.words * 4
            fd = os.memfd_create("chatgate-grammar-bitmask")
            os.ftruncate(fd, size)
            memory = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.int32)
            if self._bitmask_fd is not None:  # made since the last job: never sent
                os.close(self._bitmask_fd)
            if self._pinned and self._pinned[-1] is self._bitmask:
                unregister_host_memory(self._pinned.pop())
            self._bitmask, self._bitmask_fd = memory.view(-1, self.words), fd
            self.device_bitmask = None
            if self._pin and register_host_memory(self._bitmask):
                self._pinned.append(self._bitmask)
                self.device_bitmask = device_view(self._bitmask)
        return self._bitmask[:rows]

    def submit(self, job: MaskJob) -> None:
        """Send ``job`` (numbered one past the last; asking for an answer where there is no
        signal, and with a new bitmask's row count if :meth:`bitmask` made one); the last job
        must have been waited for."""
        assert job.number == self._submitted + 1 and self._ended == self._submitted
        new_rows = self._bitmask.shape[0] if self._bitmask_fd is not None else 0
        try:
            # plain pickle: multiprocessing's pickler copies the reducer table every message
            self._conn.send_bytes(pickle.dumps((*job[:-2], self.answers, new_rows)))
            if self._bitmask_fd is not None:
                send_handle(self._conn, self._bitmask_fd, self._proc.pid)
        except OSError:
            raise self._exited() from None
        if self._bitmask_fd is not None:
            os.close(self._bitmask_fd)
            self._bitmask_fd = None
        self._submitted = job.number

    def wait(self, number: int, job_error: bool = True) -> None:
        """Wait until job ``number`` (the last submitted, or one before) has ended: for its
        answer where there is no signal, else for its signal (at once, where a stream's wait for
        it has run), reading an answer only if the job failed. Raise its error if it failed
        (unless not ``job_error``), or if the worker exited."""
        if self._ended < number:
            if self.answers:
                self._receive(number)
            else:
                bits = ended_bits(number)
                while not self._state.words[0] & bits:
                    time.sleep(_POLL_S)
                if self._state.words[0] == ALL_ENDED:
                    raise self._exited()
                if self._state.words[1] == number & 0xFFFFFFFF:
                    self._receive(number)
            self._ended = number
        if job_error and number in self._errors:
            raise RuntimeError(f"grammar mask job failed: {self._errors[number]}")

    @property
    def last_job_times(self) -> tuple[float, float]:
        """The last job ended's ``time.perf_counter()`` when the worker received it and when
        it ended (the system's monotonic clock, which this process reads alike)."""
        received, ended = self._state.times
        return float(received), float(ended)

    def _receive(self, number: int) -> None:
        """Read answers up to job ``number``'s, recording their errors."""
        answered = 0
        while answered < number:
            try:
                answered, error = self._conn.recv()
            except (EOFError, OSError):
                raise self._exited() from None
            if error is not None:
                self._errors[answered] = error

    def close(self) -> None:
        """Stop the worker (killed: it holds nothing to save, and one still importing would only
        see its socket close once its imports are done, seconds later) and unlock the shared
        memory (no copy out of it may still be queued); also done when this is collected."""
        self._close()

    def _exited(self) -> RuntimeError:
        """The error for a worker found gone (its socket closed); sets ``exit_code``."""
        self.exit_code = self._proc.wait()
        return RuntimeError(f"the grammar worker exited with code {self.exit_code} (its log "
                            "says why)")


def _close(conn: Connection, proc: subprocess.Popen[bytes], pinned: list[torch.Tensor]) -> None:
    conn.close()
    proc.kill()
    proc.wait()
    while pinned:
        unregister_host_memory(pinned.pop())


def _signal_when_exited(proc: subprocess.Popen[bytes], state: JobState) -> None:
    """Once the worker has exited, set every bit of the signal word in ``state``, so that no
    stream waits forever."""
    proc.wait()
    state.words[0] = ALL_ENDED
