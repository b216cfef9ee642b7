"""Per-request sampling parameters, validated on construction (vLLM's names and defaults)."""

from dataclasses import dataclass, field

from engine.structured_output import StructuredOutput


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise ``ValueError`` naming the parameter."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    structured: StructuredOutput | None = None  # grammar-constrained output (JSON)
    # end a sample stuck in a loop, its tail one n-gram repeated (``engine.repetition``),
    # with finish_reason "repetition" (not one under a grammar: ``engine.json_bounds``)
    repetition_guard: bool = False
    # False: outputs carry token ids and no text (a client detokenizes them; see
    # ``engine.output_text``); stop strings need the text, so they need True
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got "
                             f"{self.repetition_penalty}")
        self.logit_bias = {int(t): float(b) for t, b in (self.logit_bias or {}).items()}
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.min_tokens < 0 or (self.max_tokens is not None
                                   and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")

    @property
    def shapes_logits(self) -> bool:
        """Whether a penalty, a bias or ``min_tokens`` changes this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
