"""Offline API with vLLM's shape: ``LLM(...).generate(...)`` and ``.chat(...)``."""

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

Prompt = str | list[int]
Conversation = list[dict]


class LLM:
    def __init__(self, model: str = "smollm2", *, loaded: LoadedModel | None = None,
                 time_steps: bool = False, **options: object) -> None:
        """``options``: ``EngineConfig``'s fields (vLLM's names); ``loaded``: the model already
        loaded, ``time_steps``: record the engine's ``step_timings`` (see ``LLMEngine``)."""
        self.engine = LLMEngine(EngineConfig(model=model, **options),  # type: ignore[arg-type]
                                loaded=loaded, time_steps=time_steps)
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        session_id: str | None = None,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids) together; outputs in prompt order.
        A request the engine refuses (``ValueError``) leaves none of the batch behind."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = self._params(sampling_params, len(prompts))
        if session_id is not None and len(prompts) != 1:
            raise ValueError("session_id takes exactly one prompt")
        requests = []
        for prompt, params in zip(prompts, params_list, strict=True):
            if isinstance(prompt, str):
                if self.engine.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; pass token ids")
                ids = self.engine.tokenizer.encode(prompt, add_special_tokens=False)
                requests.append((prompt, ids, params))
            else:
                requests.append((None, list(prompt), params))
        return self._run(requests, session_id, cache_salt, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        session_id: str | None = None,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate its answer.
        With ``session_id`` the conversation continues that session's pinned KV."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if session_id is not None and len(conversations) != 1:
            raise ValueError("session_id takes exactly one conversation")
        prompts = [self.engine.render_chat(list(c), session_id) for c in conversations]
        params_list = self._params(sampling_params, len(prompts))
        return self._run([(None, ids, p) for ids, p in zip(prompts, params_list, strict=True)],
                         session_id, cache_salt, use_tqdm)

    def unpin_session(self, session_id: str) -> bool:
        return self.engine.unpin_session(session_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @staticmethod
    def _params(params: SamplingParams | Sequence[SamplingParams] | None,
                n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return list(params)

    def _run(self, requests: list[tuple[str | None, list[int], SamplingParams]],
             session_id: str | None, cache_salt: str | None,
             use_tqdm: bool) -> list[RequestOutput]:
        """Queue every request, then step until all are finished. ``add_request`` validates
        each (``EngineInfo.validate``); if one raises, the requests queued before it are
        aborted, so a failed call leaves no request and no block behind."""
        order: list[str] = []
        try:
            for prompt, ids, params in requests:
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, ids, params, prompt=prompt,
                                        session_id=session_id, cache_salt=cache_salt,
                                        final_only=True)
                order.append(request_id)
        except BaseException:
            for request_id in order:
                self.engine.abort(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), disable=not use_tqdm, desc="requests") as bar:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in order]
