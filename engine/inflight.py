"""A step launched before the host read its sampled tokens (overlapped scheduling, see
``engine.llm_engine``): until it is resolved, each of its sequences ends in ``PLACEHOLDER``,
so the scheduler counts the token it will compute, and the next step takes that token as
input on the device (:meth:`InflightStep.feed`)."""

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.structured import GrammarMasks

PLACEHOLDER = -1  # a sampled token the host has not read yet (token ids are never negative)


@dataclass(frozen=True)
class DrawInputs:
    """What ``LLMEngine._draw`` needs to draw a step's rows (again, for a redraw): ``logits``
    are the step's raw logits (the device reads them before the next forward overwrites them);
    ``histories`` are the rows' token ids as of the draw (see ``sampler.shaped``); ``keys`` are
    filled where a row may be drawn twice (the redraw races the same noise)."""

    logits: torch.Tensor
    params: list[SamplingParams]
    keys: list[int | None]
    histories: list[tuple[list[int], list[int]]]
    graph_size: int | None  # ``logits`` are this decode graph's output (``ModelRunner``)

    def rows(self, rows: list[int]) -> "DrawInputs":
        """The inputs of ``rows`` alone (drawn eagerly: their logits are a copy)."""
        index = torch.tensor(rows, device=self.logits.device)
        return DrawInputs(self.logits.index_select(0, index), [self.params[r] for r in rows],
                          [self.keys[r] for r in rows], [self.histories[r] for r in rows], None)


@dataclass
class InflightStep:
    """``rows`` maps the seq_id of each sequence that awaits its token to its row; once the
    tokens are drawn (:meth:`drawn`), ``host[i]`` is the token of ``seqs[i]`` when ``ready`` has
    completed (None: already there). ``checked``: the rows drawn without their grammar mask,
    whose tokens the grammar checks before the next step takes them (from ``inputs``, a
    rejected one is drawn again)."""

    seqs: list[Sequence]
    rows: dict[int, int]
    inputs: DrawInputs
    checked: list[int] = field(default_factory=list)
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None

    @staticmethod
    def launch(sampled: list[Sequence], inputs: DrawInputs,
               checked: list[int]) -> "InflightStep | None":
        """Put a placeholder at the end of every ``sampled`` sequence still running; None when
        there is none."""
        live = [i for i, seq in enumerate(sampled) if not seq.is_finished]
        for i in live:
            sampled[i].token_ids.append(PLACEHOLDER)
        if not live:
            return None
        return InflightStep(sampled, {sampled[i].seq_id: i for i in live}, inputs, checked)

    def drawn(self, host: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """Record where the tokens land (``ModelRunner.keep_sampled``'s answer)."""
        self.host, self.ready = host, ready

    def feed(self, seqs: list[Sequence]) -> np.ndarray:
        """For ``ModelRunner.execute``: each sequence's row here if its input is the token in
        flight, else -1."""
        return np.fromiter((self.rows.get(seq.seq_id, -1) for seq in seqs), dtype=np.int64,
                           count=len(seqs))

    def values(self) -> list[int]:
        """Wait for the tokens; each row's, as drawn."""
        assert self.host is not None, "the tokens are not drawn yet"
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

    def resolve(self, values: list[int]) -> list[tuple[int, Sequence, int]]:
        """(row, sequence, token) of each sequence still waiting for its token (not aborted
        meanwhile), given each row's token ``values``; their placeholders are removed."""
        resolved = []
        for i in self.rows.values():
            seq = self.seqs[i]
            if seq.is_finished:  # aborted while in flight (the abort removed the placeholder)
                continue
            seq.token_ids.pop()
            resolved.append((i, seq, values[i]))
        return resolved


@dataclass(frozen=True)
class PendingDraw:
    """The draw of an in-flight step whose rows wait for grammar masks (filled on the grammar
    thread while the host goes on), kept until the next step draws it, before that step's
    input is needed."""

    inputs: DrawInputs
    masks: GrammarMasks
    logits_ready: torch.cuda.Event | None  # None: computed already (CPU)

    def computed(self) -> bool:
        """Whether the device has computed ``logits`` (and idles until the draw)."""
        return self.logits_ready is None or self.logits_ready.query()
