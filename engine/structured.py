"""Structured outputs: grammar-constrained decoding with xgrammar (what vLLM and SGLang use).

A request whose ``SamplingParams.structured`` is set gets one ``GrammarMatcher`` per sample.
Each step, the rows that have one get a token bitmask (``fill_next_token_bitmask``) applied to
the logits they choose from, so only tokens that keep the output a valid prefix of the grammar
can be drawn; the chosen token is then accepted by the matcher, and a matcher that has reached
the end of its grammar finishes its sample (``stop``). Compiled grammars are cached by their
specification. xgrammar is imported on first use, so the engine runs without it until a request
asks for structured output.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

MAX_WHITESPACE = 16  # whitespace characters allowed between two JSON tokens


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
    """Compiles and caches grammars for one tokenizer and vocabulary size, and applies their
    masks to the logits (:meth:`constrain`)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        # the bitmask rows, reused from step to step (pinned where a GPU reads them): a fresh
        # pageable one per step cost more than filling it
        self._bitmask: torch.Tensor | None = None

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh ``GrammarMatcher`` for ``spec``; ``ValueError`` if it cannot be compiled."""
        xgr = _xgrammar()
        try:
            return xgr.GrammarMatcher(self._compile(spec))
        except RuntimeError as e:  # xgrammar's error for a schema it cannot handle
            raise ValueError(f"json_schema cannot be compiled: {e}") from None

    def constrain(self, logits: torch.Tensor, matchers: Sequence[Any | None]) -> None:
        """Mask, in place, every row of the float32 ``logits`` that has a matcher to the tokens
        its grammar allows next. The rows' bitmasks are filled in one call, across threads (a
        batch of 256 constrained rows took longer to fill one by one than the GPU's step)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        xgr = _xgrammar()
        shape = xgr.get_bitmask_shape(len(matchers), logits.shape[1])
        if (self._bitmask is None or self._bitmask.shape[0] < shape[0]
                or self._bitmask.shape[1] != shape[1]):
            self._bitmask = torch.empty(max(shape[0], 64), shape[1], dtype=xgr.bitmask_dtype,
                                        pin_memory=logits.is_cuda)
        bitmask = self._bitmask[:shape[0]]
        _batch_matcher().batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask,
                                                       indices=rows)
        # the copy may run ahead: the buffer is refilled only after this step's tokens are read;
        # with every row constrained, no row list goes to the device (a copy per step)
        everyone = len(rows) == logits.shape[0]
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        indices=None if everyone else rows)

    @staticmethod
    def accept(matchers: Sequence[Any], tokens: Sequence[int]) -> None:
        """Advance each matcher by its token, in one call (a sampled token is always one its
        grammar allowed)."""
        _xgrammar().BatchGrammarMatcher.batch_accept_token(list(matchers), list(tokens))

    @cache  # noqa: B019 - one compiler per engine; grammars live as long as it
    def _compile(self, spec: StructuredOutput) -> Any:
        xgr = _xgrammar()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
        schema = '{"type": "object"}' if spec.json_object else spec.json_schema
        # bounded whitespace between tokens: a weak model under a grammar that allows any
        # amount of it can fill max_tokens with blank lines and never close the object
        return self._compiler.compile_json_schema(schema, max_whitespace_cnt=MAX_WHITESPACE)


@cache
def _batch_matcher() -> Any:
    """xgrammar's multi-threaded filler of many matchers' bitmasks (one per process)."""
    return _xgrammar().BatchGrammarMatcher()
