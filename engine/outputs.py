"""What the engine hands back: vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes."""

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Log-probability of the sampled token and the ``k`` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One sample of a request. In streaming outputs ``text``/``token_ids`` are cumulative and
    ``delta_text``/``delta_token_ids`` hold what is new since the previous output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
