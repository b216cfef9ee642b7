"""A step's sampled rows, from its logits to their tokens: read at once on the host
(:meth:`StepSampler.sample`), or drawn and left on the device for an overlapped step
(:meth:`StepSampler.draw`, through a draw graph where one covers the rows)."""

import torch

from engine.draw_graphs import DrawGraphs
from engine.grammars import Grammars
from engine.outputs import TokenLogprob
from engine.sampler import draw, draw_key, sample, shaped
from engine.sequence import Sequence
from engine.structured import GrammarMasks


class StepSampler:
    """``draw_graphs``: the decode graphs' static logits by padded batch size, for the draw
    graphs of overlapped steps (None: every draw is eager)."""

    def __init__(self, eos_token_ids: set[int],
                 draw_graphs: dict[int, torch.Tensor] | None) -> None:
        self.eos_token_ids = eos_token_ids
        self.draw_graphs = DrawGraphs(draw_graphs) if draw_graphs else None

    def sample(self, seqs: list[Sequence], logits: torch.Tensor, masks: GrammarMasks | None,
               ahead: list[int] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
        """Each row's token (row ``i`` of ``logits`` is ``seqs[i]``'s), read, with its
        logprobs where its params ask for them; under ``masks`` (waited for) if any.
        ``ahead[i]``: row ``i`` draws as if ``seqs[i]``'s first ``ahead[i]`` drafts had been
        appended (the noise key of that output position, penalties over them too): a
        speculative sequence's rows (``engine.speculative``)."""
        params = [s.params for s in seqs]
        ahead = ahead or [0] * len(seqs)
        return sample(logits, params, [self._key(s, a) for s, a in zip(seqs, ahead, strict=True)],
                      choose_from=self._shaped(logits, seqs, masks, ahead))

    def draw(self, seqs: list[Sequence], logits: torch.Tensor, masks: GrammarMasks | None,
             graph_size: int | None) -> torch.Tensor:
        """The rows' tokens, left on the device: through a draw graph where the logits are the
        size-``graph_size`` decode graph's (None: an eager step's) and the graphs cover the
        draw (``DrawGraphs.covers``), else by the eager sampler."""
        params = [s.params for s in seqs]
        keys = [self._key(s) for s in seqs]
        graphs = self.draw_graphs
        if graph_size is not None and graphs is not None and graphs.covers(params, masks):
            return graphs.draw(graph_size, params, keys, masks)
        return draw(self._shaped(logits, seqs, masks), params, keys)

    def _shaped(self, logits: torch.Tensor, seqs: list[Sequence], masks: GrammarMasks | None,
                ahead: list[int] | None = None) -> torch.Tensor:
        """The logits the rows choose from: penalties (over ``ahead`` drafts too, see
        :meth:`sample`), then grammar masks (waited for)."""
        params = [s.params for s in seqs]
        if masks is None and not any(p.shapes_logits for p in params):
            return logits
        ahead = ahead or [0] * len(seqs)
        histories = [(s.token_ids[:s.num_prompt_tokens],
                      s.output_token_ids + s.draft_token_ids[:a])
                     if s.params.shapes_logits else ([], [])
                     for s, a in zip(seqs, ahead, strict=True)]
        return shaped(logits, params, histories, self.eos_token_ids, Grammars.constraint(masks))

    @staticmethod
    def _key(seq: Sequence, ahead: int = 0) -> int | None:
        return (draw_key(seq.seed, seq.num_tokens - seq.num_prompt_tokens + ahead)
                if seq.seed is not None else None)
