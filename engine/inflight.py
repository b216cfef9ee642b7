"""A step launched before the host read its sampled tokens (overlapped scheduling, see
``engine.llm_engine``): until it is resolved, each of its sequences ends in ``PLACEHOLDER``,
so the scheduler counts the token it will compute, and the next step takes that token as
input on the device (:meth:`InflightStep.feed`)."""

from dataclasses import dataclass

import numpy as np
import torch

from engine.sequence import Sequence
from engine.structured import GrammarMasks

PLACEHOLDER = -1  # a sampled token the host has not read yet (token ids are never negative)


@dataclass
class InflightStep:
    """``rows`` maps the seq_id of each sequence that awaits its token to its row; ``masks``
    are the grammar masks the tokens were drawn under, if any; ``host[i]`` is the token of
    ``seqs[i]`` when ``ready`` has completed (None: already there)."""

    seqs: list[Sequence]
    rows: dict[int, int]
    masks: GrammarMasks | None
    host: torch.Tensor
    ready: torch.cuda.Event | None

    @staticmethod
    def launch(sampled: list[Sequence], masks: GrammarMasks | None, host: torch.Tensor,
               ready: torch.cuda.Event | None) -> "InflightStep":
        """The step whose tokens, drawn for ``sampled`` (under ``masks``), land in ``host``
        (``ModelRunner.keep_sampled``'s answer); a placeholder is put at the end of every
        ``sampled`` sequence still running (one at least)."""
        live = [i for i, seq in enumerate(sampled) if not seq.is_finished]
        assert live, "no sampled sequence is running"
        for i in live:
            sampled[i].token_ids.append(PLACEHOLDER)
        return InflightStep(sampled, {sampled[i].seq_id: i for i in live}, masks, host, ready)

    def feed(self, seqs: list[Sequence]) -> np.ndarray:
        """For ``ModelRunner.execute``: each sequence's row here if its input is the token in
        flight, else -1."""
        return np.fromiter((self.rows.get(seq.seq_id, -1) for seq in seqs), dtype=np.int64,
                           count=len(seqs))

    def tokens(self) -> list[tuple[Sequence, int]]:
        """Wait for the tokens, then each sequence still waiting for its token (not aborted
        meanwhile) with that token, its placeholder removed. (Whether the grammar masks they
        were drawn under were filled is for ``Grammars.advance`` to say.)"""
        if self.ready is not None:
            self.ready.synchronize()
        values = self.host.tolist()
        tokens = []
        for i in self.rows.values():
            seq = self.seqs[i]
            if seq.is_finished:  # aborted while in flight (the abort removed the placeholder)
                continue
            seq.token_ids.pop()
            tokens.append((seq, values[i]))
        return tokens
