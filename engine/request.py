"""One request inside the engine: its samples (sequences), their detokenizers, and what of
them has been reported, which turns each step's progress into ``RequestOutput``s."""

from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.sequence import Sequence


@dataclass
class Request:
    """``seqs[i]`` is sample ``i``; ``pending_forks`` are the samples 1..n-1 that start from
    sample 0 once its prompt is computed. With ``final_only`` a request reports once, when it
    finishes, else a delta after every step that gave it tokens (see ``engine.outputs``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]
    pending_forks: list[Sequence]
    final_only: bool
    # per sample: output tokens already reported, text released but not yet reported, and
    # whether its finish was reported (delta outputs)
    sent_tokens: list[int] = field(init=False)
    unsent_text: list[str] = field(init=False)
    finish_sent: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.sent_tokens = [0] * len(self.seqs)
        self.unsent_text = [""] * len(self.seqs)
        self.finish_sent = [False] * len(self.seqs)

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # most requests: no generator per call (every row, every step)
            return seqs[0].is_finished
        return all(seq.is_finished for seq in seqs)

    def delta_output(self, finished: bool) -> RequestOutput:
        """What each sample has new since the last output: tokens, text, logprobs, its
        finish (reported once)."""
        completions = []
        for seq in self.seqs:
            i = seq.index
            sent = self.sent_tokens[i]
            token_ids = seq.token_ids[seq.num_prompt_tokens + sent:]
            reason = seq.finish_reason
            if not token_ids and (reason is None or self.finish_sent[i]):
                continue
            logprobs = seq.logprobs
            completions.append(CompletionOutput(
                i, self.unsent_text[i], token_ids, reason,
                logprobs[sent:] if logprobs is not None else None,
                seq.cumulative_logprob if logprobs is not None else None,
                seq.stop_reason,
            ))
            self.sent_tokens[i] = sent + len(token_ids)
            self.unsent_text[i] = ""
            self.finish_sent[i] = reason is not None
        return RequestOutput(self.request_id, completions, self.seqs[0].num_cached_tokens,
                             finished, None, None, *self.speculation())

    def final_output(self) -> RequestOutput:
        """Every sample whole: all its tokens, its full text and logprobs."""
        completions = [
            CompletionOutput(
                index=seq.index,
                text=detok.text if detok is not None else "",
                token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason,
                logprobs=seq.logprobs,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                stop_reason=seq.stop_reason,
            )
            for seq, detok in zip(self.seqs, self.detokenizers, strict=True)
        ]
        return RequestOutput(
            request_id=self.request_id,
            outputs=completions,
            num_cached_tokens=self.seqs[0].num_cached_tokens,
            finished=self.finished,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            num_draft_tokens=self.speculation()[0],
            num_accepted_tokens=self.speculation()[1],
        )

    def speculation(self) -> tuple[int, int]:
        """Speculative draft tokens verified and accepted so far, over the samples."""
        seqs = self.seqs
        if len(seqs) == 1:
            return seqs[0].num_draft_tokens, seqs[0].num_accepted_tokens
        return (sum(s.num_draft_tokens for s in seqs),
                sum(s.num_accepted_tokens for s in seqs))
