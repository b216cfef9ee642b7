"""Structured outputs: grammar-constrained decoding with xgrammar (what vLLM and SGLang use).

A request whose ``SamplingParams.structured`` is set gets one ``GrammarMatcher`` per sample.
Each step, the rows that have one get a token bitmask (``fill_next_token_bitmask``) applied to
the logits they choose from, so only tokens that keep the output a valid prefix of the grammar
can be drawn; the chosen token is then accepted by the matcher, and a grammar's stop token
(allowed only once the grammar is complete) finishes its sample (``stop``). Masks are filled on
a thread of their own while the engine's Python work goes on; on a GPU, the draw that needs them
is queued at once and the device, not the host, waits for them (``engine.stream_wait``).
Compiled grammars are cached by their specification. xgrammar is imported on first use, so the
engine runs without it until a request asks for structured output.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

import torch

from engine.stream_wait import HostCounter

MAX_WHITESPACE = 16  # whitespace characters allowed between two JSON tokens
# While masks are being filled, the interpreter hands the GIL to a waiting thread after this
# long (Python's default, 5 ms, is longer than a step: the grammar thread would start only when
# the engine's thread waits for it, and nothing would overlap)
GIL_SWITCH_INTERVAL_S = 2e-5


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must be: any JSON object (``json_object``), or JSON matching
    ``json_schema`` (a JSON Schema, serialized)."""

    json_schema: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if (self.json_schema is None) == (not self.json_object):
            raise ValueError("structured output needs exactly one of json_schema, json_object")
        if self.json_schema is not None:
            try:
                json.loads(self.json_schema)
            except ValueError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured output needs the xgrammar package "
                         "(pip install xgrammar)") from None
    return xgrammar


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer and vocabulary size, and fills their
    token masks on a thread of their own (:meth:`masks`), so that a step's Python work runs
    while they are filled (xgrammar releases the GIL).

    Matchers are touched by that thread alone: :meth:`accept` only records each matcher's
    token, and the next :meth:`masks` advances the matchers by them before it fills any mask.
    One mask job is outstanding at a time (the next waits for it). Jobs are numbered; on a GPU,
    each raises a host counter to its number when it ends, which a stream waits on before it
    copies the masks in (:meth:`to_device`)."""

    def __init__(self, tokenizer: Any, vocab_size: int, device: torch.device) -> None:
        """``device``: where the logits are (the bitmask is pinned for a GPU)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._pin = device.type == "cuda"
        self._compiler: Any = None
        self._info: Any = None
        self._accepted: list[tuple[Any, int]] = []
        self._job: Future[None] | None = None
        self._num_jobs = 0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        # None: the host waits for a job before its masks are copied (CPU, or no driver support)
        self._counter = HostCounter.create() if self._pin else None
        # the bitmask rows, reused from step to step (pinned where a GPU reads them: a fresh
        # pageable one per step cost more than filling it); `_copied` marks the end of the
        # last copy out of them, which a refill waits for
        self._bitmask: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    @cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end a grammar (a sampled one is allowed only where its grammar is
        complete, so accepting it terminates the matcher)."""
        return frozenset(self._tokenizer_info().stop_token_ids)

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher for ``spec``, opaque (xgrammar's core ``GrammarMatcher``, the one
        its batch calls take); ``ValueError`` if ``spec`` cannot be compiled."""
        xgr = _xgrammar()
        try:
            return xgr.GrammarMatcher(self._compile(spec))._handle
        except RuntimeError as e:  # xgrammar's error for a schema it cannot handle
            raise ValueError(f"json_schema cannot be compiled: {e}") from None

    def accept(self, matchers: Sequence[Any], tokens: Sequence[int]) -> None:
        """Record that each matcher's output went on with its token (a sampled token is always
        one its grammar allowed); the matchers advance before their next masks are filled."""
        self._accepted += zip(matchers, tokens, strict=True)

    def masks(self, matchers: Sequence[Any | None]) -> GrammarMasks:
        """Start filling, on the grammar thread, the token masks of one logits row per matcher:
        row ``i`` is masked by ``matchers[i]`` (None, or a matcher whose last token ended its
        grammar: all tokens allowed). The recorded tokens are accepted first."""
        xgr = _xgrammar()
        shape = xgr.get_bitmask_shape(len(matchers), self.vocab_size)
        self._wait()
        if (self._bitmask is None or self._bitmask.shape[0] < shape[0]
                or self._bitmask.shape[1] != shape[1]):
            self._bitmask = torch.empty(max(shape[0], 64), shape[1], dtype=xgr.bitmask_dtype,
                                        pin_memory=self._pin)
            self._copied = None
        if self._copied is not None:
            # the last copy out of the bitmask has read it (done by now: a job starts after the
            # tokens of the step that last applied masks are read)
            self._copied.synchronize()
        accepted, self._accepted = self._accepted, []
        ended = {id(m) for m, token in accepted if token in self.stop_token_ids}
        rows = [i for i, m in enumerate(matchers) if m is not None and id(m) not in ended]
        bitmask = self._bitmask[:shape[0]]
        if len(rows) < len(matchers):
            masked = set(rows)
            bitmask[[i for i in range(len(matchers)) if i not in masked]] = -1  # all allowed
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # the job gives it back when it ends
        self._num_jobs += 1
        self._job = self._thread.submit(
            self._fill, [m for m, _ in accepted], [t for _, t in accepted],
            [matchers[i] for i in rows], rows, bitmask, switch_interval,
            self._counter, self._num_jobs)
        return GrammarMasks(self._job, self._num_jobs, bitmask, rows)

    def apply(self, masks: GrammarMasks, logits: torch.Tensor) -> None:
        """Mask, in place, each row of the float32 ``logits`` to the tokens its grammar allows
        next (a row without one is left as it is: all bits set), once ``masks`` are filled
        (waited for as :meth:`to_device` does)."""
        bitmask = (torch.empty_like(masks.bitmask, device=logits.device)
                   if logits.is_cuda and masks.rows else None)
        self.to_device(masks, bitmask)
        if masks.rows:
            apply_bitmask(logits, masks.bitmask if bitmask is None else bitmask)

    def to_device(self, masks: GrammarMasks, out: torch.Tensor | None) -> None:
        """Copy ``masks``' bitmask rows to ``out`` (on the logits' GPU) once their job has
        ended: the current stream waits for it where it can, the host otherwise (and where
        ``out`` is None: no copy, the masks are read on the host). A job's error is raised by
        :meth:`GrammarMasks.result`, which whoever reads the tokens drawn calls."""
        if out is None:
            masks.result()
            return
        if self._counter is None:
            masks.result()
        else:
            self._counter.stream_wait(masks.number)
        out.copy_(masks.bitmask, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()

    def _wait(self) -> None:
        """Wait for the outstanding mask job, if any (its error is raised here)."""
        job, self._job = self._job, None
        if job is not None:
            job.result()

    @staticmethod
    def _fill(accepting: list[Any], tokens: list[int], filling: list[Any], rows: list[int],
              bitmask: torch.Tensor, switch_interval: float, counter: HostCounter | None,
              number: int) -> None:
        """On the grammar thread: advance the matchers ``accepting`` by their ``tokens``,
        then fill the bitmask rows ``rows`` of the matchers ``filling`` (across xgrammar's
        threads), then raise ``counter`` to the job's ``number`` (whatever happened:
        a stream may be waiting) and give the interpreter back its GIL switch interval. Two
        calls into xgrammar whatever the batch, never one per matcher."""
        try:
            if accepting:
                _accept_tokens(accepting, tokens)
            if rows:
                _fill_bitmask(filling, bitmask, rows)
        finally:
            if counter is not None:
                counter.raise_to(number)
            sys.setswitchinterval(switch_interval)

    def _tokenizer_info(self) -> Any:
        if self._info is None:
            xgr = _xgrammar()
            self._info = xgr.TokenizerInfo.from_huggingface(self._tokenizer,
                                                            vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(self._info)
        return self._info

    @cache  # noqa: B019 - one compiler per engine; grammars live as long as it
    def _compile(self, spec: StructuredOutput) -> Any:
        self._tokenizer_info()  # the compiler
        schema = '{"type": "object"}' if spec.json_object else spec.json_schema
        # bounded whitespace between tokens: a weak model under a grammar that allows any
        # amount of it can fill max_tokens with blank lines and never close the object
        return self._compiler.compile_json_schema(schema, max_whitespace_cnt=MAX_WHITESPACE)


@dataclass(frozen=True)
class GrammarMasks:
    """The token masks of one step's logits rows ``rows`` (the others are left as they are),
    being filled on the grammar thread by ``job``, the compiler's ``number``-th."""

    job: Future[None]
    number: int
    bitmask: torch.Tensor
    rows: list[int]

    def result(self) -> None:
        """Wait for the masks; their job's error is raised here."""
        self.job.result()


# xgrammar's batch calls, made on the grammar thread straight into its core (on the core
# matchers that ``GrammarCompiler.matcher`` gives). Its public wrappers turn the accept's
# result into a Python list element by element, and every bytecode the grammar thread runs
# competes for the GIL with the engine's thread: at 64 rows that cost more than the accepts
# themselves.
def _accept_tokens(matchers: list[Any], tokens: list[int]) -> None:
    """Advance each matcher by its token (one its grammar allowed: the result is not read)."""
    _xgrammar().base._core.BatchGrammarMatcher.batch_accept_token(matchers, tokens, False)


def _fill_bitmask(matchers: list[Any], bitmask: torch.Tensor, rows: list[int]) -> None:
    """Fill ``bitmask`` row ``rows[i]`` with the allowed tokens of ``matchers[i]``."""
    _batch_matcher()._handle.batch_fill_next_token_bitmask(matchers, bitmask, rows, False)


@cache
def _batch_matcher() -> Any:
    """xgrammar's multi-threaded filler of many matchers' bitmasks (one per process)."""
    return _xgrammar().BatchGrammarMatcher()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set, in place, every float32 ``logits`` entry whose bit in ``bitmask`` (int32 rows of
    ``GrammarMasks`` on the logits' device, one per logits row) is clear to -inf."""
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask)
