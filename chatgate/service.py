"""The gateway core shared by the HTTP/SSE and WebSocket front ends.

``Gateway`` owns the engine, the tenants, the session store, the rate limiter and the metrics.
``Gateway.stream`` runs one engine request for one tenant: it applies the tenant's cache salt
and session scoping, records metrics, and aborts the engine request if the consumer goes away
(the async generator is closed or its task cancelled)."""

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
from chatgate.metrics import Metrics
from chatgate.ratelimit import RateLimited, RateLimiter
from chatgate.sessions import SessionStore
from chatgate.settings import Settings
from chatgate.tenants import Tenant, TenantRegistry
from engine import AsyncEngine, RequestOutput, SamplingParams

log = logging.getLogger("chatgate")


@dataclass
class TurnStats:
    """What one finished (or cancelled) engine request cost."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None
    first_token_at: float | None = None

    @property
    def computed_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

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


def context_error(prompt_len: int, max_model_len: int, max_tokens: int | None = None) -> APIError:
    if max_tokens is None:
        msg = (f"This model's maximum context length is {max_model_len} tokens. However, your "
               f"messages resulted in {prompt_len} tokens. Please reduce the length of the "
               f"messages (max_model_len={max_model_len}).")
    else:
        msg = (f"This model's maximum context length is {max_model_len} tokens. However, you "
               f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
               f"{max_tokens} in the completion). Please reduce the length of the messages or "
               f"completion (max_model_len={max_model_len}).")
    return APIError(400, msg, param="messages", code="context_length_exceeded")


class Gateway:
    def __init__(
        self,
        settings: Settings,
        engine: AsyncEngine,
        tenants: TenantRegistry,
        store: SessionStore,
        metrics: Metrics,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.tenants = tenants
        self.store = store
        self.metrics = metrics
        self.limiter = RateLimiter()
        self.model_name: str = settings.served_model_name or engine.model_name
        self._engine_model_name: str = engine.model_name
        # engine session id -> monotonic time of last use (sessions pinned by this process)
        self._pinned: dict[str, float] = {}
        self._busy: set[str] = set()
        self._unpin_task: asyncio.Task | None = None
        self.created = int(time.time())

    # ----------------------------------------------------------------- identity & limits
    def accepts_model(self, model: str) -> bool:
        return model in {self.model_name, self._engine_model_name}

    def engine_session_id(self, tenant: Tenant, session_id: str) -> str:
        return self.tenants.engine_session_id(tenant, session_id)

    def admit(self, tenant: Tenant) -> None:
        """Take one request/stream slot of the tenant or raise a 429 ``APIError``."""
        try:
            self.limiter.acquire(tenant)
        except RateLimited as e:
            self.metrics.rate_limited.labels(self.model_name).inc()
            raise APIError(429, e.message, code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after)}) from None

    def release(self, tenant: Tenant, stats: TurnStats) -> None:
        self.limiter.release(tenant, stats.prompt_tokens + stats.completion_tokens)

    def acquire_session(self, eid: str) -> None:
        if eid in self._busy:
            raise APIError(409, "This session is already generating a response; wait for it "
                           "to finish or cancel it.", code="session_busy", param="session_id")
        self._busy.add(eid)

    def release_session_lock(self, eid: str) -> None:
        self._busy.discard(eid)

    # ----------------------------------------------------------------- prompts
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def render(self, messages: list[dict[str, str]], eid: str | None) -> list[int]:
        return self.engine.render_chat(messages, session_id=eid)

    def check_prompt(self, prompt_ids: list[int], max_tokens: int | None, *, clamp: bool) -> int:
        """Validate the prompt length; return the max_tokens to use."""
        n, limit = len(prompt_ids), self.max_model_len
        if n >= limit:
            raise context_error(n, limit)
        room = limit - n
        if max_tokens is None:
            return room
        if max_tokens > room:
            if clamp:
                return room
            raise context_error(n, limit, max_tokens)
        return max_tokens

    # ----------------------------------------------------------------- generation
    async def stream(
        self,
        tenant: Tenant,
        prompt_ids: list[int],
        params: SamplingParams,
        stats: TurnStats,
        *,
        eid: str | None = None,
        transport: str = "http",
    ) -> AsyncIterator[RequestOutput]:
        """Yield the engine's ``RequestOutput``s; closing/cancelling this iterator aborts the
        engine request. ``stats`` is filled in as the request runs."""
        request_id = f"{transport}-{uuid.uuid4().hex}"
        salt = self.tenants.cache_salt(tenant)
        m = self.model_name
        stats.prompt_tokens = len(prompt_ids)
        gen = self.engine.generate(prompt_ids, params, request_id=request_id,
                                   session_id=eid, cache_salt=salt)
        finished = False
        last_token_at: float | None = None
        ntok: dict[int, int] = {}
        self.metrics.active_streams.labels(m, transport).inc()
        try:
            first = True
            async for out in gen:
                now = time.perf_counter()
                if first:
                    first = False
                    stats.cached_tokens = out.num_cached_tokens
                    self.metrics.observe_prompt(stats.prompt_tokens, stats.cached_tokens)
                new = 0
                for c in out.outputs:
                    k = len(c.token_ids)
                    new += k - ntok.get(c.index, 0)
                    ntok[c.index] = k
                if new > 0:
                    if stats.first_token_at is None:
                        stats.first_token_at = now
                        stats.ttft_s = now - stats.started
                        self.metrics.ttft.labels(m).observe(stats.ttft_s)
                    elif last_token_at is not None:
                        itl = (now - last_token_at) / new
                        for _ in range(min(new, 64)):
                            self.metrics.itl.labels(m).observe(itl)
                    last_token_at = now
                    self.metrics.generation_tokens.labels(m).inc(new)
                stats.completion_tokens = sum(ntok.values())
                if out.finished:
                    finished = True
                yield out
                if finished:
                    break
        finally:
            stats.ended = time.perf_counter()
            self.metrics.active_streams.labels(m, transport).dec()
            if not finished:
                # The consumer went away (disconnect/cancel) or the engine failed: abort now so
                # the request's blocks go back at once.
                with contextlib.suppress(BaseException):
                    await asyncio.shield(self._abort(gen, request_id))
                self.metrics.request_success.labels(m, "abort").inc()
            else:
                with contextlib.suppress(Exception):
                    await gen.aclose()
                reasons = {c.finish_reason or "stop" for c in out.outputs}
                for r in reasons:
                    self.metrics.request_success.labels(m, r).inc()
                self.metrics.e2e.labels(m).observe(stats.ended - stats.started)
            if eid is not None:
                self._pinned[eid] = time.monotonic()

    async def _abort(self, gen: AsyncIterator[RequestOutput], request_id: str) -> None:
        with contextlib.suppress(Exception):
            await self.engine.abort(request_id)
        with contextlib.suppress(Exception):
            await gen.aclose()

    # ----------------------------------------------------------------- sessions
    async def release_pin(self, eid: str) -> bool:
        self._pinned.pop(eid, None)
        try:
            return bool(await self.engine.release_session(eid))
        except Exception:  # noqa: BLE001 - a missing pin is not an error
            log.debug("release_session(%s) failed", eid, exc_info=True)
            return False

    def start_background(self) -> None:
        self._unpin_task = asyncio.create_task(self._unpin_idle_loop(), name="unpin-idle")

    async def stop_background(self) -> None:
        if self._unpin_task is not None:
            self._unpin_task.cancel()
            with contextlib.suppress(BaseException):
                await self._unpin_task

    async def unpin_idle(self, now: float | None = None) -> int:
        """Release the engine pins of sessions idle for ``session_idle_unpin`` seconds."""
        now = time.monotonic() if now is None else now
        idle = self.settings.session_idle_unpin
        n = 0
        for eid, last in list(self._pinned.items()):
            if eid not in self._busy and now - last >= idle:
                await self.release_pin(eid)
                n += 1
                log.info("unpinned idle session %s", eid)
        return n

    async def _unpin_idle_loop(self) -> None:
        period = max(0.2, min(30.0, self.settings.session_idle_unpin / 4))
        while True:
            await asyncio.sleep(period)
            try:
                await self.unpin_idle()
            except Exception:  # noqa: BLE001
                log.exception("idle unpin failed")

    async def warm_tenants(self) -> None:
        """Prefill and pin each tenant's configured system prompts (salted per tenant)."""
        tok = self.engine.tokenizer
        for tenant in self.tenants.tenants.values():
            for i, prompt in enumerate(tenant.warm_system_prompts):
                ids = tok.apply_chat_template([{"role": "system", "content": prompt}],
                                              tokenize=True, add_generation_prompt=False)
                if hasattr(ids, "keys"):
                    ids = ids["input_ids"]
                ids = list(ids)[: self.max_model_len - 1]
                eid = f"{tenant.id}:__warm__{i}"
                params = SamplingParams(max_tokens=1, temperature=0.0)
                rid = f"warm-{uuid.uuid4().hex}"
                salt = self.tenants.cache_salt(tenant)
                async for _ in self.engine.generate(ids, params, request_id=rid, session_id=eid,
                                                    cache_salt=salt):
                    pass
                log.info("warmed system prompt %d of tenant %s (%d tokens, pinned)", i,
                         tenant.id, len(ids))
