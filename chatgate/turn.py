"""``Turn``: one chat turn, owned from start to end for the SSE and the WebSocket handlers alike.

The steps, in order: :meth:`Turn.prepare` renders the chat template (continuing the session's
pinned tokens), checks the prompt against the context window and builds the sampling params;
:meth:`Turn.start` admits the turn under the tenant's limits and locks its session;
:meth:`Turn.stream` streams the engine's deltas and, for a session turn, stores the turn before
it yields the last one; :meth:`Turn.release` gives back the tenant's stream slot and the session
lock, exactly once. Every failure is an ``APIError``, so the handlers only encode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from chatgate.errors import APIError
from chatgate.service import Gateway, ShuttingDown, engine_unavailable, shutting_down
from chatgate.tenants import Tenant
from engine.client import EngineDeadError, EngineStepError, RequestOutput, SamplingParams

log = logging.getLogger("chatgate")

STORE_TIMEOUT_S = 5.0


@dataclass
class TurnStats:
    """What one finished (or cancelled) turn cost."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0  # speculative drafts verified, and accepted (0: none)
    accepted_tokens: int = 0
    ttft_s: float | None = None
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None
    first_token_at: float | None = None

    def tokens_per_s(self) -> float:
        if self.first_token_at is None or self.ended is None or self.completion_tokens < 2:
            return 0.0
        dt = self.ended - self.first_token_at
        return (self.completion_tokens - 1) / dt if dt > 0 else 0.0

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def answer_stats(self) -> dict[str, Any]:
        """``usage`` and ``timings`` as the WebSocket ``done`` event and a stored answer carry
        them."""
        return {
            "usage": {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                      "completion_tokens": self.completion_tokens},
            "timings": {"ttft_ms": round(self.ttft_s * 1000, 1)
                        if self.ttft_s is not None else None,
                        "tokens_per_s": round(self.tokens_per_s(), 2)},
        }


def sampling_params(defaults: dict[str, Any], **kwargs: Any) -> SamplingParams:
    """``SamplingParams`` from OpenAI-style values; one left None takes its value from
    ``defaults`` (the model's generation config), else ``SamplingParams``' own. A ``top_k``
    of -1 means none, as in vLLM. Its ``ValueError`` (which names the parameter) becomes a
    400."""
    kw = {**defaults, **{k: v for k, v in kwargs.items() if v is not None}}
    kw["top_k"] = max(kw.get("top_k", 0), 0)
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise invalid_value(e) from None


def invalid_value(error: ValueError) -> APIError:
    """The 400 for an engine ``ValueError``, whose message starts with the parameter's name."""
    message = str(error)
    return APIError(400, message, param=message.split(" ", 1)[0] if message else None,
                    code="invalid_value")


def split_history(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """Leading system messages become the session's system prompt; the rest its history."""
    system: list[str] = []
    i = 0
    while i < len(messages) and messages[i]["role"] == "system":
        system.append(messages[i]["content"])
        i += 1
    return ("\n\n".join(system) or None), [dict(m) for m in messages[i:]]


def store_unavailable(error: BaseException) -> APIError:
    return APIError(503, f"The session store is unavailable: {error or type(error).__name__}",
                    code="store_unavailable")


class Turn:
    """``messages``: the whole conversation to answer (system prompt first). ``session_id``:
    the client's session id, or None for a turn that keeps nothing. ``tools``: function
    definitions the chat template renders itself. ``history``: for a conversation the server
    keeps (the WebSocket's), the stored messages that ``messages`` holds after its system
    prompt, with the fields the template does not see (an earlier answer's stats); they are
    stored as they are, and the answer with its own stats. Without it (HTTP, where the client
    sends the conversation) the session keeps ``messages`` and the answer's text."""

    def __init__(self, gw: Gateway, tenant: Tenant, messages: list[dict[str, Any]], *,
                 session_id: str | None, transport: str,
                 tools: list[dict[str, Any]] | None = None,
                 history: list[dict[str, Any]] | None = None) -> None:
        self.gw = gw
        self.tenant = tenant
        self.messages = messages
        self.tools = tools
        self.history = history
        self.session_id = session_id
        self.transport = transport
        self.engine_session_id = (gw.tenants.engine_session_id(tenant, session_id)
                                  if session_id is not None else None)
        self.stats = TurnStats()
        self._answer: list[str] = []  # the text of sample 0 so far, in pieces
        self.finish_reason: str | None = None  # sample 0's, from the engine
        self.prompt_ids: list[int] = []
        self.params: SamplingParams | None = None
        self.stored: list[dict[str, Any]] | None = None  # the history this turn stored
        self._holds = False  # the tenant's stream slot and the session lock
        self._unlocking: asyncio.Future[bool] | None = None  # the engine freeing the lock

    async def prepare(self, *, max_tokens: int | None, prompt_ids: list[int] | None = None,
                      **sampling: Any) -> None:
        """Render the messages (or take ``prompt_ids`` as given: a text completion, whose
        errors name ``prompt``), check and build the sampling params (400 on bad input);
        holds nothing."""
        if prompt_ids is not None:
            self.prompt_ids = prompt_ids
            field = "prompt"
        else:
            field = "messages"
            try:
                self.prompt_ids = await self.gw.engine.render_chat(
                    self.messages, self.engine_session_id, self.tools)
            except ValueError as e:
                raise APIError(400, str(e), param=field, code="invalid_value") from None
        max_tokens = self.gw.check_prompt(self.prompt_ids, max_tokens, field)
        self.params = sampling_params(self.gw.sampling_defaults, max_tokens=max_tokens,
                                      repetition_guard=self.gw.settings.repetition_guard,
                                      **sampling)
        assert self.gw.engine.info is not None
        try:  # what the engine would refuse, refused before anything is streamed
            self.gw.engine.info.validate(self.prompt_ids, self.params)
        except ValueError as e:
            raise invalid_value(e) from None

    async def start(self) -> None:
        """Admit the turn under the tenant's limits (429) and lock its session (409); a session
        turn also needs a reachable store (503), since it will be stored. On error nothing is
        held."""
        gw = self.gw
        gw.check_engine()
        gw.admit(self.tenant)
        self._holds = True
        if self.engine_session_id is None:
            return
        try:
            await gw.lock_session(self.engine_session_id)
        except BaseException:
            gw.limiter.release(self.tenant, 0)
            self._holds = False
            raise
        try:
            await asyncio.wait_for(gw.store.ping(), STORE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any store failure is a 503
            self.release()
            raise store_unavailable(e) from None

    @property
    def answer(self) -> str:
        """The text of sample 0 so far."""
        if len(self._answer) > 1:
            self._answer = ["".join(self._answer)]
        return self._answer[0] if self._answer else ""

    def answer_stats(self) -> dict[str, Any]:
        """The answer's ``usage``, ``timings`` and (unless cut) ``finish_reason``, as stored
        with it."""
        stats = self.stats.answer_stats()
        if self.finish_reason is not None:
            stats["finish_reason"] = self.finish_reason
        return stats

    def release(self) -> None:
        """Give back the tenant's stream slot (charging the tokens used) and the session
        lock; only the first call does anything."""
        if not self._holds:
            return
        self._holds = False
        self.gw.limiter.release(self.tenant, self.stats.prompt_tokens
                                + self.stats.completion_tokens)
        if self.engine_session_id is not None:
            self._unlocking = self.gw.unlock_session(self.engine_session_id)

    async def released(self) -> None:
        """Wait until the session lock :meth:`release` gave back is free on every front-end
        (at once with one): a next turn the client sends as soon as it sees this one end may
        reach another front-end, and must not find its session busy."""
        if self._unlocking is not None:
            with contextlib.suppress(EngineDeadError):  # a gone engine holds no locks
                await self._unlocking

    async def store(self, cut: bool = False) -> None:
        """Save the conversation and this turn's answer (sample 0, so far; ``cut``: marked
        ``"cut": true``; with :meth:`answer_stats` for a ``history`` turn) as the session's
        history, in one write, and keep it in ``self.stored``; 503 if the store fails."""
        assert self.session_id is not None
        system, history = split_history(self.messages)
        answer: dict[str, Any] = {"role": "assistant", "content": self.answer}
        if self.history is not None:
            history = [dict(m) for m in self.history]
            answer.update(self.answer_stats())
        if cut:
            answer["cut"] = True
        history.append(answer)
        try:
            await asyncio.wait_for(
                self.gw.store.replace(self.tenant.id, self.session_id, system, history),
                STORE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any store failure is a 503
            raise store_unavailable(e) from None
        self.stored = history

    async def _store_cut(self) -> None:
        """A session turn its consumer left (cancel, client gone) keeps its user message
        with the answer so far, marked cut; one cut before any text keeps neither."""
        if self.session_id is None or not self.answer:
            return
        try:
            await self.store(cut=True)
        except APIError as e:
            log.warning("the cut turn of session %s was not stored: %s", self.session_id,
                        e.message)

    async def stream(self) -> AsyncIterator[RequestOutput]:
        """The engine's delta outputs (merged while the caller is behind). A session turn is
        stored before the last output is yielded, so whatever the caller sends after it is
        true; if storing fails, a 503 ``APIError`` comes instead. Leaving early (closing the
        iterator, or cancelling its task) aborts the engine request at once and stores the
        turn as cut (:meth:`_store_cut`)."""
        assert self.params is not None, "Turn.prepare() was not called"
        gw, stats = self.gw, self.stats
        metrics, transport = gw.metrics, self.transport
        stats.prompt_tokens = len(self.prompt_ids)
        finish_reasons: set[str] = set()
        first, finished, cut = True, False, False
        last_token_at = 0.0
        metrics.stream_started(transport)
        outputs = gw.engine.generate(self.prompt_ids, self.params,
                                     f"{transport}-{uuid.uuid4().hex}",
                                     session_id=self.engine_session_id,
                                     cache_salt=gw.tenants.cache_salt(self.tenant))
        try:
            async for out in outputs:
                now = time.perf_counter()
                if first:
                    first = False
                    stats.cached_tokens = out.num_cached_tokens
                    metrics.observe_prompt(stats.prompt_tokens, stats.cached_tokens)
                new = 0
                for c in out.outputs:
                    new += len(c.token_ids)
                    if c.index == 0 and c.text:
                        self._answer.append(c.text)
                    if c.finish_reason is not None:
                        finish_reasons.add(c.finish_reason)
                        if c.index == 0:
                            self.finish_reason = c.finish_reason
                if new:
                    stats.completion_tokens += new
                    if stats.first_token_at is None:
                        stats.first_token_at = now
                        stats.ttft_s = now - stats.started
                        metrics.observe_first_tokens(new, stats.ttft_s)
                    else:
                        metrics.observe_tokens(new, now - last_token_at)
                    last_token_at = now
                if out.finished:
                    stats.ended = now
                    if self.session_id is not None:
                        await self.store()
                finished = out.finished
                stats.draft_tokens = out.num_draft_tokens
                stats.accepted_tokens = out.num_accepted_tokens
                yield out
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        except EngineStepError as e:
            raise APIError(500, f"The engine failed while generating: {e}",
                           code="engine_error") from None
        except EngineDeadError as e:
            raise engine_unavailable(str(e)) from None
        except ShuttingDown:
            cut = True  # stored as a cancelled turn is
            raise shutting_down() from None
        except (GeneratorExit, asyncio.CancelledError):
            cut = not finished
            raise
        finally:
            await outputs.aclose()  # aborts the engine request if it has not finished
            if stats.ended is None:  # left before the end
                stats.ended = time.perf_counter()
            metrics.stream_ended(transport)
            if finished:
                metrics.observe_finish(finish_reasons, stats.ended - stats.started)
            else:
                metrics.observe_finish({"abort"}, None)
            if self.engine_session_id is not None:
                gw.touch_session(self.engine_session_id)
            if cut:
                await self._store_cut()
