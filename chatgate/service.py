"""The gateway core shared by the HTTP/SSE and WebSocket front ends.

``Gateway`` holds the engine client, the tenants, the session store, the rate limiter and the
metrics, and the per-process session state: which sessions are generating (one turn at a time
per session) and when each pinned session was last used (idle ones are unpinned). A chat turn
itself is a ``chatgate.turn.Turn``.

With several front-end processes on one engine (``--api-server-count``), a session's turns may
reach any of them: its turn lock is then also taken in the engine, which all of them share,
and a session counts as used whenever the engine pins it again (every front-end sees every pin
change), so no front-end unpins a session another one is using. Tenant limits are counted per
process: with N front-ends a tenant may have up to N times its limits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from chatgate.errors import APIError
from chatgate.metrics import Metrics
from chatgate.ratelimit import RateLimited, RateLimiter
from chatgate.sessions import SessionStore
from chatgate.settings import Settings
from chatgate.tenants import Tenant, TenantRegistry
from engine.client import AsyncEngine, EngineDeadError, SamplingParams

log = logging.getLogger("chatgate")


def context_error(prompt_len: int, max_model_len: int, max_tokens: int | None = None, *,
                  field: str = "messages") -> APIError:
    """The 400 for a prompt (``field``: ``messages`` or ``prompt``) that, alone or with the
    ``max_tokens`` asked for, does not fit the context window."""
    if max_tokens is None:
        msg = (f"This model's maximum context length is {max_model_len} tokens. However, your "
               f"{field} resulted in {prompt_len} tokens. Please reduce the length of the "
               f"{field} (max_model_len={max_model_len}).")
    else:
        msg = (f"This model's maximum context length is {max_model_len} tokens. However, you "
               f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {field}, "
               f"{max_tokens} in the completion). Please reduce the length of the {field} or "
               f"completion (max_model_len={max_model_len}).")
    return APIError(400, msg, param=field, code="context_length_exceeded")


def session_busy() -> APIError:
    return APIError(409, "This session is already generating a response; wait for it to "
                    "finish or cancel it.", code="session_busy", param="session_id")


def engine_unavailable(reason: str) -> APIError:
    return APIError(503, f"The engine is not running: {reason}", code="engine_unavailable")


class ShuttingDown(Exception):
    """Ends the streams still open when the gateway's shutdown grace period is over."""


def shutting_down() -> APIError:
    return APIError(503, "The gateway is shutting down; send the request again.",
                    code="server_shutting_down")


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
        self.engine_model_name: str = engine.model_name
        assert engine.info is not None, "the engine must be started"
        # what a request leaves unset gets (--generation-config): the model's sampling values
        self.sampling_defaults: dict[str, float | int] = (
            engine.info.generation_defaults.values() if settings.generation_config == "auto"
            else {})
        # engine session id -> monotonic time of last use (sessions pinned by this process)
        self._last_used: dict[str, float] = {}
        self._generating: set[str] = set()
        self._unpin_task: asyncio.Task | None = None
        self.created = int(time.time())
        self.shutting_down = False

    # ----------------------------------------------------------------- identity & limits
    def accepts_model(self, model: str) -> bool:
        return model in {self.model_name, self.engine_model_name}

    def check_engine(self) -> None:
        """503 once the engine process is gone or the open streams were ended for shutdown."""
        if self.engine.dead is not None:
            raise engine_unavailable(self.engine.dead)
        if self.shutting_down:
            raise shutting_down()

    def end_streams(self) -> None:
        """End every open stream with a 503 ``server_shutting_down`` error (in-band: an SSE
        error chunk; uvicorn has closed the WebSockets already) and refuse new turns; the
        streams' engine requests are aborted. Called once the streams' shutdown grace period
        is over."""
        self.shutting_down = True
        ended = self.engine.fail_requests(ShuttingDown())
        if ended:
            log.warning("shutting down: ended %d open stream(s) that outlasted the grace "
                        "period", ended)

    def admit(self, tenant: Tenant) -> None:
        """Take one request/stream slot of the tenant or raise a 429 ``APIError``."""
        try:
            self.limiter.acquire(tenant)
        except RateLimited as e:
            self.metrics.observe_rate_limited()
            raise APIError(429, e.message, code="rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after)}) from None

    async def lock_session(self, engine_session_id: str) -> None:
        """Mark the session as generating, or 409 if it already is (here or, with several
        front-ends, in another one)."""
        if engine_session_id in self._generating:
            raise session_busy()
        self._generating.add(engine_session_id)
        if self.engine.shared:
            try:
                locked = await self.engine.lock_session(engine_session_id)
            except EngineDeadError as e:
                self._generating.discard(engine_session_id)
                raise engine_unavailable(str(e)) from None
            except BaseException:
                self._generating.discard(engine_session_id)
                raise
            if not locked:
                self._generating.discard(engine_session_id)
                raise session_busy()

    def unlock_session(self, engine_session_id: str) -> asyncio.Future[bool] | None:
        """Release the session's lock; with several front-ends, the future is done once the
        engine has freed it for the others."""
        if engine_session_id in self._generating:
            self._generating.discard(engine_session_id)
            if self.engine.shared:
                return self.engine.unlock_session(engine_session_id)
        return None

    def touch_session(self, engine_session_id: str) -> None:
        """Record a use of a session the engine pins (for the idle unpin)."""
        self._last_used[engine_session_id] = time.monotonic()

    # ----------------------------------------------------------------- prompts
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_prompt(self, prompt_ids: list[int], max_tokens: int | None,
                     field: str = "messages") -> int:
        """The ``max_tokens`` a turn runs with: as asked, or when not asked the server's
        default (``--max-tokens``) capped to the room the prompt leaves in the context window
        (all that room without a default). A prompt that leaves no room, or a ``max_tokens``
        beyond the room, is a 400 ``context_length_exceeded`` naming ``field`` (one rule
        for HTTP and WebSocket, as OpenAI's API and vLLM refuse)."""
        n, limit = len(prompt_ids), self.max_model_len
        if n >= limit:
            raise context_error(n, limit, field=field)
        room = limit - n
        if max_tokens is None:
            default = self.settings.max_tokens
            return room if default is None else min(default, room)
        if max_tokens > room:
            raise context_error(n, limit, max_tokens, field=field)
        return max_tokens

    # ----------------------------------------------------------------- sessions
    async def unpin_session(self, engine_session_id: str) -> bool:
        """Unpin the engine's blocks of a session; False if it had none pinned."""
        self._last_used.pop(engine_session_id, None)
        try:
            return await self.engine.unpin_session(engine_session_id)
        except Exception:  # noqa: BLE001 - a missing pin or a gone engine is no error here
            log.debug("unpin_session(%s) failed", engine_session_id, exc_info=True)
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
        pinned_at = self.engine.pinned_at
        n = 0
        for eid, last in list(self._last_used.items()):
            last = max(last, pinned_at.get(eid, last))  # pinned again after a turn elsewhere
            if eid not in self._generating and now - last >= idle:
                await self.unpin_session(eid)
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
