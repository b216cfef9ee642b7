"""The engine's one handle on structured decoding (``Grammars``): everything about grammars a
step does goes through it; matchers, the grammar worker and its shared memory stay behind it
(``engine.structured``, ``engine.grammar_worker``).

Per step, in this order: :meth:`Grammars.prepare` starts filling the masks of the rows about to
be drawn (a ``GrammarMasks`` handle, or None where no row has a grammar); the draw applies them
(:meth:`Grammars.constraint`, or a draw graph reads them in place, ``engine.draw_graphs``);
:meth:`Grammars.advance` takes the tokens drawn under them once read, raising their mask job's
error first. A matcher is released when its sequence is collected (the worker forgets it with
the next job).
"""

import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

from engine.sequence import Sequence
from engine.structured import GrammarCompiler, GrammarMasks
from engine.structured_output import StructuredOutput

logger = logging.getLogger("engine")


class Grammars:
    """Structured decoding for one engine's tokenizer, vocabulary and device. The grammar
    runtime (xgrammar, the worker process) is made on first use: an engine that serves no
    structured request never imports xgrammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, device: torch.device) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._device = device
        self._compiler: GrammarCompiler | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar runtime, made now if it is not yet (``ValueError`` without a
        tokenizer)."""
        if self._tokenizer is None:
            raise ValueError("structured output needs a tokenizer; this model has none")
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._device)
        return self._compiler

    def start(self) -> None:
        """Start the grammar worker now, not with the first structured request, whose steps
        would wait for its start (seconds). Nothing without a tokenizer or xgrammar; a failure
        is logged (structured requests meet it again)."""
        if self._tokenizer is None or importlib.util.find_spec("xgrammar") is None:
            return
        try:
            self.compiler.start()
        except Exception:  # noqa: BLE001 - the engine serves unconstrained requests regardless
            logger.exception("the grammar worker could not start")

    def attach(self, seq: Sequence, spec: StructuredOutput) -> None:
        """Give ``seq`` a fresh matcher for ``spec`` (``ValueError`` if it cannot compile)."""
        seq.matcher = self.compiler.matcher(spec)

    def ends(self, seq: Sequence, token_id: int) -> bool:
        """Whether ``token_id``, just appended to ``seq``, completes its grammar."""
        return seq.matcher is not None and token_id in self.compiler.stop_token_ids

    def prepare(self, sampled: list[Sequence], padded_rows: int) -> GrammarMasks | None:
        """Start filling the masks of one logits row per ``sampled`` sequence (a finished one,
        or one without a grammar, allows every token); None where no row has a grammar. The
        bitmask holds at least ``padded_rows`` rows (a draw graph's padded batch)."""
        matchers = [None if seq.is_finished else seq.matcher for seq in sampled]
        if all(m is None for m in matchers):
            return None
        return self.compiler.masks(matchers, padded_rows)

    @staticmethod
    def constraint(masks: GrammarMasks | None) -> Callable[[torch.Tensor], None] | None:
        """What masks float32 logits in place to ``masks`` once they are filled (for
        ``sampler.shaped``); None for no masks."""
        if masks is None:
            return None
        return lambda logits: GrammarCompiler.apply(masks, logits)

    def advance(self, masks: GrammarMasks | None, tokens: list[tuple[Sequence, int]]) -> None:
        """Record each constrained sequence's drawn token for its matcher (it advances before
        its next masks are filled); first raise the error of the mask job ``masks`` came from,
        if it failed (the tokens drawn under them are not to be used)."""
        if masks is not None:
            masks.result()
        constrained = [(seq.matcher, token) for seq, token in tokens if seq.matcher is not None]
        if constrained:
            self.compiler.accept([m for m, _ in constrained], [t for _, t in constrained])

    def close(self) -> None:
        """Stop the grammar worker, if started."""
        if self._compiler is not None:
            self._compiler.close()
