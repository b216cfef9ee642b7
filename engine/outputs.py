"""What the engine hands back: vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes, as msgspec
structs so that the engine process can send them to the gateway without conversion.

A request's outputs come in one of two kinds (vLLM's ``RequestOutputKind``):

- **delta** (streaming): each output holds only what is new since the previous one: the new
  token ids, the newly released text, the new logprobs. Concatenating a request's deltas gives
  its whole output. Only samples with something new (tokens, or their finish) are included.
- **final only** (offline ``LLM``): one output when the request finishes, with every sample's
  whole text, token ids and logprobs, and the prompt.

The structs never take part in reference cycles, so the garbage collector does not track them
(``gc=False``): thousands are made per second while serving.
"""

import msgspec


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    """Log-probability of the sampled token and the ``k`` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class CompletionOutput(msgspec.Struct, array_like=True, gc=False):
    """One sample of a request (all of it, or what is new: see the module docstring).
    ``cumulative_logprob`` is always the running total over the whole sample."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct, array_like=True, gc=False):
    """``finished``: every sample has finished. ``prompt``/``prompt_token_ids`` are set on
    final-only outputs (delta outputs leave them None: the caller sent the prompt).
    ``num_draft_tokens``/``num_accepted_tokens``: speculative drafts verified and accepted
    for the request so far, over its samples (0 without speculative decoding)."""

    request_id: str
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def merge_outputs(into: RequestOutput, new: RequestOutput) -> None:
    """Append delta ``new`` to delta ``into`` (same request, ``new`` later)."""
    samples = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = samples.get(c.index)
        if old is None:
            into.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids += c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    into.num_cached_tokens = new.num_cached_tokens
    into.num_draft_tokens, into.num_accepted_tokens = new.num_draft_tokens, new.num_accepted_tokens
    into.finished = new.finished
