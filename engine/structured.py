"""Structured outputs: grammar-constrained decoding with xgrammar (what vLLM and SGLang use).

A request whose ``SamplingParams.structured`` is set gets one ``GrammarMatcher`` per sample.
Each step, the rows that have one get a token bitmask (``fill_next_token_bitmask``) applied to
the logits they choose from, so only tokens that keep the output a valid prefix of the grammar
can be drawn; the chosen token is then accepted by the matcher, and a grammar's stop token
(allowed only once the grammar is complete) finishes its sample (``stop``). Masks are filled by
a process of their own (``engine.grammar_worker``) while the engine's Python work goes on; on a
GPU, the draw that needs them is queued at once, the device, not the host, waits for them
(``engine.stream_wait``), and its kernel reads them where the worker wrote them.
Compiled grammars are cached by their specification. xgrammar is imported on first use, so the
engine runs without it until a request asks for structured output.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

import numpy as np
import torch

from engine.grammar_process import MaskJob, compile_json_schema, ended_bits
from engine.grammar_worker import GrammarWorker
from engine.stream_wait import HostSignal
from engine.structured_output import StructuredOutput

logger = logging.getLogger("engine")


def xgrammar() -> Any:
    """xgrammar, imported on first use (``ValueError`` naming the package if absent)."""
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured output needs the xgrammar package "
                         "(pip install xgrammar)") from None
    return xgrammar


class Matcher:
    """A grammar matcher, held by grammar worker number ``worker`` and known here by its
    ``id``; the worker forgets it once this handle is collected (``GrammarCompiler.matcher``)."""

    __slots__ = ("id", "worker", "__weakref__")

    def __init__(self, matcher_id: int, worker: int) -> None:
        self.id = matcher_id
        self.worker = worker


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer and vocabulary size (to check a request's
    at once), and has their matchers' token masks filled by the grammar worker, a process of
    its own (``engine.grammar_worker``), while a step's Python work goes on (:meth:`masks`).

    :meth:`accept` only records each matcher's token; the next :meth:`masks` job advances the
    matchers by them before it fills any mask. One mask job is outstanding at a time (the next
    waits for it), and a job rewrites the one shared bitmask: it is made only once the tokens
    drawn under the last masks are read, so no kernel reads them any more. On a GPU, kernels
    read the bitmask where the worker wrote it (mapped for the device) once a stream wait for
    the job's signal lets them (:meth:`GrammarMasks.wait_on_device`); elsewhere the host waits
    for the job's answer. A job that fails (its error raised by :meth:`GrammarMasks.result`)
    fails only the step that reads the tokens drawn under its masks. A worker that exits fails
    the step waiting for it; the next :meth:`masks` starts a new one, which serves the matchers
    made since (those the old one held cannot go on: masks for them raise)."""

    def __init__(self, tokenizer: Any, vocab_size: int, device: torch.device) -> None:
        """``device``: where the logits are (the bitmask is page-locked for a GPU)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._pin = device.type == "cuda"
        self._compiler: Any = None
        self._info: Any = None
        self._worker: GrammarWorker | None = None  # started with the first mask job
        self._num_workers = 1  # the number of the worker that holds the matchers made now
        self._num_matchers = self._num_jobs = 0
        self._created: list[tuple[Matcher, StructuredOutput]] = []
        self._dropped: list[int] = []  # appended to by the matchers' finalizers
        # the matchers (by id) and tokens recorded since the last job
        self._accepting: list[int] = []
        self._tokens: list[int] = []

    @cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end a grammar (a sampled one is allowed only where its grammar is
        complete, so accepting it terminates the matcher)."""
        return frozenset(self._tokenizer_info().stop_token_ids)

    def matcher(self, spec: StructuredOutput) -> Matcher:
        """A fresh matcher for ``spec`` (made by the worker with the next job); ``ValueError``
        if ``spec`` cannot be compiled."""
        try:
            self._compile(spec)
        except RuntimeError as e:  # xgrammar's error for a schema it cannot handle
            raise ValueError(f"json_schema cannot be compiled: {e}") from None
        self._num_matchers += 1
        matcher = Matcher(self._num_matchers, self._num_workers)
        weakref.finalize(matcher, self._dropped.append, matcher.id).atexit = False
        self._created.append((matcher, spec))
        return matcher

    def accept(self, matchers: Sequence[Matcher], tokens: Sequence[int]) -> None:
        """Record that each matcher's output went on with its token (a sampled token is always
        one its grammar allowed); the matchers advance before their next masks are filled."""
        assert len(matchers) == len(tokens)
        self._accepting += [m.id for m in matchers]
        self._tokens += tokens

    def masks(self, matchers: Sequence[Matcher | None], padded_rows: int = 0) -> GrammarMasks:
        """Start filling, in the grammar worker, the token masks of one logits row per matcher:
        row ``i`` is masked by ``matchers[i]`` (None, or a matcher whose last token ended its
        grammar: all tokens allowed). The recorded tokens are accepted first. The bitmask holds
        at least ``padded_rows`` rows (a CUDA graph's draw reads its padded batch; the rows past
        the matchers' keep whatever they held)."""
        worker = self.start()
        lost = (sum(m is not None and m.worker != self._num_workers for m in matchers)
                if self._num_workers > 1 else 0)  # (only a replaced worker leaves any)
        if lost:
            raise RuntimeError(f"the grammar worker that held the grammar state of {lost} "
                               "rows exited; they cannot go on")
        # the last job has ended (its error, if any, is the step's that reads the tokens drawn
        # under its masks: the matchers it failed on belong to requests that step fails)
        worker.wait(self._num_jobs, job_error=False)
        accepting, tokens = self._accepting, self._tokens
        self._accepting, self._tokens = [], []
        stops = self.stop_token_ids
        ended = ({i for i, token in zip(accepting, tokens, strict=True) if token in stops}
                 if not stops.isdisjoint(tokens) else ())
        rows = [i for i, m in enumerate(matchers) if m is not None and m.id not in ended]
        bitmask = worker.bitmask(len(matchers), padded_rows)
        if len(rows) < len(matchers):
            allowed = np.ones(len(matchers), dtype=bool)
            allowed[rows] = False
            bitmask.numpy()[allowed] = -1  # all tokens allowed (numpy: no torch dispatch)
        created = [(m.id, spec.schema) for m, spec in self._created]
        self._created = []
        dropped = self._dropped[:]
        del self._dropped[:len(dropped)]
        self._num_jobs += 1
        worker.submit(MaskJob(self._num_jobs, created, dropped, accepting, tokens,
                              [matchers[i].id for i in rows], rows))  # type: ignore[union-attr]
        return GrammarMasks(self._num_jobs, bitmask, rows, worker.wait, worker.signal,
                            worker.device_bitmask)

    @staticmethod
    def apply(masks: GrammarMasks, logits: torch.Tensor) -> None:
        """Mask, in place, each row of the float32 ``logits`` to the tokens its grammar allows
        next (a row without one is left as it is: all bits set), once ``masks`` are filled: on
        a GPU whose kernels read the bitmask in place, the device waits for them
        (:meth:`GrammarMasks.wait_on_device`), elsewhere the host."""
        if not masks.rows:
            return
        if logits.is_cuda and masks.device is not None:
            masks.wait_on_device()
            apply_bitmask(logits, masks.device[:len(masks.bitmask)])
        else:
            masks.result()
            apply_bitmask(logits, masks.bitmask.to(logits.device))

    def close(self) -> None:
        """Stop the grammar worker, if started; no mask job after this."""
        if self._worker is not None:
            if self._pin:
                torch.cuda.synchronize()  # no kernel may read the bitmask once it is unlocked
            self._worker.close()

    def start(self) -> GrammarWorker:
        """The worker, started now if there is none or the last one was found gone."""
        if self._worker is not None and self._worker.exit_code is not None:
            logger.warning("the grammar worker exited with code %d; starting a new one",
                           self._worker.exit_code)
            self.close()
            self._worker = None
            self._num_workers += 1
            self._num_jobs = 0
            self._accepting, self._tokens, self._dropped[:] = [], [], []
            for matcher, _ in self._created:  # not sent yet: the new worker makes them
                matcher.worker = self._num_workers
        if self._worker is None:
            info = self._tokenizer_info()
            self._worker = GrammarWorker(info.serialize_json(),
                                         xgrammar().get_bitmask_shape(1, self.vocab_size)[1],
                                         self._pin)
        return self._worker

    def _tokenizer_info(self) -> Any:
        if self._info is None:
            xgr = xgrammar()
            self._info = xgr.TokenizerInfo.from_huggingface(self._tokenizer,
                                                            vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(self._info)
        return self._info

    @cache  # noqa: B019 - one compiler per engine; grammars live as long as it
    def _compile(self, spec: StructuredOutput) -> Any:
        self._tokenizer_info()  # the compiler
        return compile_json_schema(self._compiler, spec.schema)


@dataclass(frozen=True)
class GrammarMasks:
    """The token masks of one step's logits rows ``rows`` (the others are left as they are:
    all bits set), being filled by mask job ``number`` into ``bitmask`` (host memory, one row
    per logits row): ``wait(number)`` returns once it has ended, and ``signal`` (None: the
    host waits) has ``ended_bits`` set then. ``device``: the whole shared bitmask as a CUDA tensor
    over the same memory (``bitmask`` is its first rows), None where it is not mapped for a
    device."""

    number: int
    bitmask: torch.Tensor
    rows: list[int]
    wait: Callable[[int], None]
    signal: HostSignal | None
    device: torch.Tensor | None = None

    @property
    def in_place(self) -> bool:
        """Whether device kernels read the masks where the worker writes them (``device``)."""
        return self.device is not None

    @property
    def ended_bits(self) -> int:
        """The bits ``signal`` has once the masks are filled (``grammar_process.ended_bits``:
        fixed for every other job, so a CUDA graph can hold a wait for them)."""
        return ended_bits(self.number)

    def result(self) -> None:
        """Wait for the masks; their job's error is raised here."""
        self.wait(self.number)

    def wait_on_device(self) -> None:
        """Make the current stream's later work (kernels that read ``device``) wait until the
        masks are filled; the host waits instead where there is no signal. The job's error is
        raised by :meth:`result`, which whoever reads the tokens drawn calls."""
        if self.signal is None:
            self.result()
        else:
            self.signal.stream_wait(self.ended_bits)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set, in place, every float32 ``logits`` entry whose bit in ``bitmask`` (int32 rows of
    ``GrammarMasks`` on the logits' device, one per logits row) is clear to -inf."""
    xgrammar().apply_token_bitmask_inplace(logits, bitmask)
