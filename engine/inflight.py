"""A step launched before the host read its sampled tokens (overlapped scheduling, see
``engine.llm_engine``): until it is resolved, each of its sequences ends in ``PLACEHOLDER``,
so the scheduler counts the token it will compute, and the next step takes that token as
input on the device (:meth:`InflightStep.feed`)."""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from engine.sequence import Sequence
from engine.structured import GrammarMasks

PLACEHOLDER = -1  # a sampled token the host has not read yet (token ids are never negative)


@dataclass
class InflightStep:
    """``rows`` maps the seq_id of each sequence that awaits its token to its row; ``masks``
    are the grammar masks the tokens are drawn under, if any; once the tokens are drawn
    (:meth:`drawn`), ``host[i]`` is the token of ``seqs[i]`` when ``ready`` has completed
    (None: already there)."""

    seqs: list[Sequence]
    rows: dict[int, int]
    masks: GrammarMasks | None = None
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None

    @staticmethod
    def launch(sampled: list[Sequence], masks: GrammarMasks | None) -> "InflightStep | None":
        """Put a placeholder at the end of every ``sampled`` sequence still running; None when
        there is none."""
        live = [i for i, seq in enumerate(sampled) if not seq.is_finished]
        for i in live:
            sampled[i].token_ids.append(PLACEHOLDER)
        if not live:
            return None
        return InflightStep(sampled, {sampled[i].seq_id: i for i in live}, masks)

    def drawn(self, host: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        """Record where the tokens land (``ModelRunner.keep_sampled``'s answer)."""
        self.host, self.ready = host, ready

    def feed(self, seqs: list[Sequence]) -> np.ndarray:
        """For ``ModelRunner.execute``: each sequence's row here if its input is the token in
        flight, else -1."""
        return np.fromiter((self.rows.get(seq.seq_id, -1) for seq in seqs), dtype=np.int64,
                           count=len(seqs))

    def tokens(self) -> Iterator[tuple[Sequence, int]]:
        """Wait for the tokens (a grammar job's error is raised here), then each sequence still
        waiting for its token (not aborted meanwhile) with that token, its placeholder
        removed."""
        assert self.host is not None, "the tokens are not drawn yet"
        if self.ready is not None:
            self.ready.synchronize()
        if self.masks is not None:
            self.masks.result()
        values = self.host.tolist()
        for i in self.rows.values():
            seq = self.seqs[i]
            if seq.is_finished:  # aborted while in flight (the abort removed the placeholder)
                continue
            seq.token_ids.pop()
            yield seq, values[i]
