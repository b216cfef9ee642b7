"""A step launched before the host read its sampled tokens (overlapped scheduling, see
``engine.llm_engine``): until it is resolved, each of its sequences ends in ``PLACEHOLDER``,
so the scheduler counts the token it will compute, and the next step takes that token as
input on the device (:meth:`InflightStep.feed`)."""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.structured import GrammarMasks

PLACEHOLDER = -1  # a sampled token the host has not read yet (token ids are never negative)


@dataclass
class InflightStep:
    """``rows`` maps the seq_id of each sequence that awaits its token to its row; once the
    tokens are drawn (:meth:`drawn`), ``host[i]`` is the token of ``seqs[i]`` when ``ready`` has
    completed (None: already there)."""

    seqs: list[Sequence]
    rows: dict[int, int]
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None

    @staticmethod
    def launch(sampled: list[Sequence]) -> "InflightStep | None":
        """Put a placeholder at the end of every ``sampled`` sequence still running; None when
        there is none."""
        live = [i for i, seq in enumerate(sampled) if not seq.is_finished]
        for i in live:
            sampled[i].token_ids.append(PLACEHOLDER)
        if not live:
            return None
        return InflightStep(sampled, {sampled[i].seq_id: i for i in live})

    def drawn(self, host: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """Record where the tokens land (``ModelRunner.keep_sampled``'s answer)."""
        self.host, self.ready = host, ready

    def feed(self, seqs: list[Sequence]) -> np.ndarray:
        """For ``ModelRunner.execute``: each sequence's row here if its input is the token in
        flight, else -1."""
        return np.fromiter((self.rows.get(seq.seq_id, -1) for seq in seqs), dtype=np.int64,
                           count=len(seqs))

    def tokens(self) -> Iterator[tuple[Sequence, int]]:
        """Wait for the tokens, then each sequence still waiting for its token (not aborted
        meanwhile) with that token, its placeholder removed."""
        assert self.host is not None, "the tokens are not drawn yet"
        if self.ready is not None:
            self.ready.synchronize()
        values = self.host.tolist()
        for i in self.rows.values():
            seq = self.seqs[i]
            if seq.is_finished:  # aborted while in flight (the abort removed the placeholder)
                continue
            seq.token_ids.pop()
            yield seq, values[i]


@dataclass(frozen=True)
class PendingDraw:
    """The draw of an in-flight step whose rows wait for grammar masks (filled on the grammar
    thread while the host goes on): what ``sampler.draw`` needs, kept until the next step
    draws it, before that step's input is needed. ``logits`` are the step's raw logits (the
    device reads them before the next forward overwrites them); ``histories`` are the rows'
    token ids as of the draw (see ``sampler.shaped``)."""

    logits: torch.Tensor
    params: list[SamplingParams]
    keys: list[int | None]
    histories: list[tuple[list[int], list[int]]]
    masks: GrammarMasks
    logits_ready: torch.cuda.Event | None  # None: computed already (CPU)
    graph_size: int | None  # ``logits`` are this decode graph's output (``ModelRunner``)

    def computed(self) -> bool:
        """Whether the device has computed ``logits`` (and idles until the draw)."""
        return self.logits_ready is None or self.logits_ready.query()
