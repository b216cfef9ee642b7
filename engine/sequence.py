"""One sample being generated: its tokens, its block table and where computation stands."""

import itertools
from enum import Enum, auto
from typing import Any

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """``token_ids`` = prompt + output. KV exists for ``token_ids[:num_computed_tokens]``;
    ``block_table`` covers at least those tokens. ``block_hashes[i]`` is the chained hash of
    full block ``i`` (computed as blocks fill, only with prefix caching on).
    ``draft_token_ids``: speculative tokens proposed after ``token_ids`` for the step being
    scheduled and run (``engine.speculative``), never part of ``token_ids``; empty between
    steps."""

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int | None,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seed = seed  # the request's seed + index, or None
        self.matcher: Any = None  # its grammar's matcher when the output is constrained
        self.session_id = session_id
        self.cache_salt = cache_salt
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.draft_token_ids: list[int] = []
        self.num_draft_tokens = 0  # drafts verified and accepted so far (engine.speculative)
        self.num_accepted_tokens = 0
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}#{self.index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
