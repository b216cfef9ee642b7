"""What a started engine tells its clients: the model and the limits requests are checked against.
The engine and its out-of-process client validate requests with the same code."""

import msgspec

from engine.generation_config import GenerationDefaults
from engine.sampling_params import SamplingParams


class EngineInfo(msgspec.Struct, frozen=True):
    model_name: str
    max_model_len: int
    vocab_size: int
    has_tokenizer: bool
    block_size: int
    num_blocks: int
    generation_defaults: GenerationDefaults  # the model's recommended sampling values
    eos_token_ids: frozenset[int]  # tokens that end a sample (unless ignore_eos), adding no text

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the parameter and the limit; changes nothing."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, max_model_len is {self.max_model_len} "
                             "(prompt plus at least one generated token)")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size})")
        if params.stop and not self.has_tokenizer:
            raise ValueError("stop strings need a tokenizer; this model has none")
