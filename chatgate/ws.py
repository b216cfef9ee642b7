"""WebSocket ``/v1/ws``: multi-turn chat sessions over a small JSON event protocol
(docs/protocol.md). Errors are sent as ``error`` events and leave the socket open; only a
failed authentication closes it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from typing import Any

import msgspec
from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from chatgate.body import parse_json
from chatgate.errors import APIError, from_validation_error
from chatgate.finish import REPETITION
from chatgate.middleware import tokens_text
from chatgate.openai_models import SESSION_ID_PATTERN, WSParams
from chatgate.service import Gateway
from chatgate.session_ids import HEADER, QUERY_PARAM, agreed_session_id
from chatgate.sessions import SessionRecord, is_store_error
from chatgate.tenants import Tenant
from chatgate.turn import Turn, TurnStats

log = logging.getLogger("chatgate")

SUBPROTOCOL = "chatgate"
TURN_EVENTS = frozenset({"message", "regenerate"})
BEARER_PREFIX = "bearer."
_SCOPE_RE = re.compile(SESSION_ID_PATTERN)
_encode = msgspec.json.Encoder().encode


class WSConnection:
    """``bound_session``: the session the handshake named (``session`` query parameter or
    ``X-Session-Id`` header); the connection then only creates or resumes that one.
    ``binding_error``: why the handshake's session naming was refused (sent at once, and
    again for every create or resume)."""

    def __init__(self, ws: WebSocket, gw: Gateway, tenant: Tenant | None,
                 bound_session: str | None, binding_error: APIError | None) -> None:
        self.ws = ws
        self.gw = gw
        self.tenant = tenant
        self.bound_session = bound_session
        self.binding_error = binding_error
        self.session: SessionRecord | None = None
        self.task: asyncio.Task | None = None
        self._send_lock = asyncio.Lock()
        self.max_bytes = gw.settings.ws_max_message_bytes

    # ------------------------------------------------------------------ sending
    async def send(self, event: dict[str, Any]) -> None:
        async with self._send_lock:
            if self.ws.application_state == WebSocketState.CONNECTED:
                await self.ws.send_text(_encode(event).decode())

    async def error(self, code: str, message: str, **extra: Any) -> None:
        await self.send({"type": "error", "code": code, "message": message, **extra})

    def _session_event(self) -> dict[str, Any]:
        s = self.session
        assert s is not None
        return {"type": "session", "id": s.id, "system": s.system,
                "messages": [dict(m) for m in s.messages]}

    @property
    def generating(self) -> bool:
        return self.task is not None and not self.task.done()

    # ------------------------------------------------------------------ main loop
    async def run(self) -> None:
        try:
            if self.binding_error is not None:
                await self.error(self.binding_error.code or "error", self.binding_error.message)
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                data: str | bytes = msg.get("text") or msg.get("bytes") or b""
                size = len(data.encode("utf-8") if isinstance(data, str) else data)
                if size > self.max_bytes:
                    await self.error("message_too_large", self._too_large(size))
                    continue
                try:
                    event = parse_json(data)
                except APIError as e:
                    await self.error(e.code or "invalid_json", e.message)
                    continue
                if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                    await self.error("invalid_event", "Each frame must be a JSON object with a "
                                     "string 'type'.")
                    continue
                if not await self.handle(event):
                    break
        except WebSocketDisconnect:  # the client went away: not a fault of the server
            log.debug("websocket client went away")
        finally:
            await self.cancel_generation()

    def _too_large(self, n: int) -> str:
        return f"Frame of {n} bytes exceeds the limit of {self.max_bytes} bytes."

    async def handle(self, event: dict[str, Any]) -> bool:
        """Handle one client event; ``False`` closes the connection."""
        etype = event["type"]
        if self.tenant is None:
            if etype != "auth":
                await self.error("unauthorized", "Authenticate first: send {\"type\": \"auth\", "
                                 "\"api_key\": ...} or offer the subprotocol bearer.<key>.")
                await self.ws.close(code=1008)
                return False
            key = event.get("api_key")
            self.tenant = self.gw.tenants.authenticate(key if isinstance(key, str) else None)
            if self.tenant is None:
                await self.error("unauthorized", "Incorrect API key provided.")
                await self.ws.close(code=1008)
                return False
            return True
        handler = {
            "auth": self.on_auth,
            "session.create": self.on_create,
            "session.resume": self.on_resume,
            "message": self.on_message,
            "regenerate": self.on_regenerate,
            "cancel": self.on_cancel,
            "session.close": self.on_close,
        }.get(etype)
        if handler is None:
            await self.error("unknown_event", f"Unknown event type '{etype[:64]}'.")
            return True
        began = time.perf_counter()
        try:
            await handler(event)
        except APIError as e:
            if etype in TURN_EVENTS:  # a turn refused before it generated
                self.log_turn(etype, e.code or "error", time.perf_counter() - began, None)
            extra = {}
            if "Retry-After" in e.headers:
                extra["retry_after"] = int(e.headers["Retry-After"])
            await self.error(e.code or "error", e.message, **extra)
        except WebSocketDisconnect:  # the client is gone: the connection ends, quietly
            raise
        except Exception as e:  # noqa: BLE001 - keep the socket open
            if is_store_error(e):
                log.warning("session store error on websocket %s: %s", etype, e)
                await self.error("store_unavailable", f"The session store is unavailable: {e}")
            else:
                log.exception("websocket event %s failed", etype)
                await self.error("internal_error", f"{type(e).__name__}: {e}")
        return True

    # ------------------------------------------------------------------ events
    async def on_auth(self, event: dict[str, Any]) -> None:
        return None  # already authenticated (or open mode)

    async def on_create(self, event: dict[str, Any]) -> None:
        if self.generating:
            raise APIError(409, "An answer is being generated; cancel it first.", code="busy")
        system = event.get("system")
        if system is not None and not isinstance(system, str):
            raise APIError(400, "'system' must be a string.", code="invalid_params")
        scope = event.get("scope")
        if scope is not None and not (isinstance(scope, str) and _SCOPE_RE.match(scope)):
            raise APIError(400, f"'scope' must be a string matching {SESSION_ID_PATTERN}.",
                           code="invalid_params")
        assert self.tenant is not None
        sid = self._named_session(event) or uuid.uuid4().hex
        self.session = await self.gw.store.create(self.tenant.id, sid, system or None, scope)
        await self.send(self._session_event())

    async def on_resume(self, event: dict[str, Any]) -> None:
        if self.generating:
            raise APIError(409, "An answer is being generated; cancel it first.", code="busy")
        sid = self._named_session(event)
        if sid is None:
            raise APIError(400, "'session_id' must be a session id string.",
                           code="invalid_params")
        assert self.tenant is not None
        rec = await self.gw.store.get(self.tenant.id, sid)
        if rec is None:
            raise APIError(404, f"No session '{sid}'.", code="session_not_found")
        self.session = rec
        await self.send(self._session_event())

    def _named_session(self, event: dict[str, Any]) -> str | None:
        """The session that the event's ``session_id`` and the handshake name (they must
        agree), or None if neither does."""
        if self.binding_error is not None:
            raise self.binding_error
        value = event.get("session_id")
        if value is not None and not isinstance(value, str):
            raise APIError(400, "'session_id' must be a session id string.",
                           code="invalid_params")
        return agreed_session_id({f"connection's session ({QUERY_PARAM} or {HEADER})":
                                  self.bound_session, "session_id field": value})

    def _params(self, event: dict[str, Any]) -> WSParams:
        raw = event.get("params") or {}
        if not isinstance(raw, dict):
            raise APIError(400, "'params' must be an object.", code="invalid_params")
        try:
            return WSParams.model_validate(raw)
        except ValidationError as e:
            err = from_validation_error(e)
            raise APIError(400, err.message, code="invalid_params", param=err.param) from None

    async def on_message(self, event: dict[str, Any]) -> None:
        if self.session is None:
            raise APIError(400, "Create or resume a session first.", code="no_session")
        if self.generating:
            raise APIError(409, "An answer is being generated; cancel it first.", code="busy")
        content = event.get("content")
        if not isinstance(content, str) or not content:
            raise APIError(400, "'content' must be a non-empty string.", code="invalid_params")
        user = {"role": "user", "content": content}
        turn = await self._start_turn(self.session.chat_messages() + [user],
                                      self.session.messages + [user], event)
        self.task = asyncio.create_task(self._generate(turn, "message"))

    async def on_regenerate(self, event: dict[str, Any]) -> None:
        if self.session is None:
            raise APIError(400, "Create or resume a session first.", code="no_session")
        if self.generating:
            raise APIError(409, "An answer is being generated; cancel it first.", code="busy")
        msgs = list(self.session.messages)
        if msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if not msgs or msgs[-1]["role"] != "user":
            raise APIError(400, "Nothing to regenerate: the session has no user message.",
                           code="invalid_params")
        head = [{"role": "system", "content": self.session.system}] if self.session.system else []
        plain = [{"role": m["role"], "content": m["content"]} for m in msgs]
        turn = await self._start_turn(head + plain, msgs, event)
        self.task = asyncio.create_task(self._generate(turn, "regenerate"))

    def log_turn(self, event_type: str, outcome: str, seconds: float,
                 stats: TurnStats | None) -> None:
        """One line per turn, like the HTTP access log's: ``WS <path> <event> <outcome>
        <seconds>s prompt=P cached=C completion=N``; the outcome is the finish reason
        (``stop``, ``length``, ``cancelled``) or the error code."""
        log.info("WS %s %s %s %.3fs%s", self.ws.url.path, event_type, outcome, seconds,
                 tokens_text([stats] if stats is not None else []))

    async def _start_turn(self, messages: list[dict[str, str]], history: list[dict[str, Any]],
                          event: dict[str, Any]) -> Turn:
        """``messages`` for the template; ``history``: the same after the system prompt, as
        stored (with earlier answers' stats)."""
        assert self.tenant is not None and self.session is not None
        p = self._params(event)
        turn = Turn(self.gw, self.tenant, messages, session_id=self.session.id, transport="ws",
                    history=history)
        await turn.prepare(max_tokens=p.max_tokens, **p.sampling())
        await turn.start()
        return turn

    async def _generate(self, turn: Turn, event_type: str) -> None:
        """Stream the answer as ``delta`` events, then ``done`` once the turn is stored. The
        turn stores the user message and its answer together (``Turn.stream``): a cancelled
        answer or one cut by the client leaving keeps its partial text, marked cut (then
        ``done`` "cancelled")."""
        assert self.session is not None
        session = self.session
        finish = "cancelled"
        error: APIError | None = None
        try:
            with contextlib.suppress(asyncio.CancelledError):
                async with contextlib.aclosing(turn.stream()) as outputs:
                    async for out in outputs:
                        c = out.outputs[0]
                        if c.text:
                            await self.send({"type": "delta", "text": c.text})
                        if c.finish_reason in ("stop", "length", REPETITION):
                            finish = c.finish_reason
        except WebSocketDisconnect:
            log.debug("websocket client went away during a turn")
        except APIError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - reported as an event; the socket stays open
            log.exception("websocket generation failed")
            error = APIError(500, f"{type(e).__name__}: {e}", code="internal_error")
        finally:
            turn.release()
            if turn.stored is not None:
                session.messages = turn.stored
                session.num_messages = len(turn.stored)
            stats = turn.stats
            outcome = finish if error is None else error.code or "error"
            self.log_turn(event_type, outcome, (stats.ended or time.perf_counter())
                          - stats.started, stats)
        await turn.released()
        if error is not None:
            await self.error(error.code or "error", error.message)
            return
        with contextlib.suppress(Exception):  # the client may be gone
            await self.send({"type": "done", "finish_reason": finish, **stats.answer_stats()})

    async def cancel_generation(self) -> None:
        task = self.task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def on_cancel(self, event: dict[str, Any]) -> None:
        await self.cancel_generation()

    async def on_close(self, event: dict[str, Any]) -> None:
        if self.session is None:
            raise APIError(400, "No session is open.", code="no_session")
        await self.cancel_generation()
        assert self.tenant is not None
        sid = self.session.id
        await self.gw.store.delete(self.tenant.id, sid)
        await self.gw.unpin_session(self.gw.tenants.engine_session_id(self.tenant, sid))
        self.session = None
        await self.send({"type": "session.closed", "id": sid})


async def ws_endpoint(websocket: WebSocket) -> None:
    gw: Gateway | None = getattr(websocket.app.state, "gateway", None)
    if gw is None:
        await websocket.close(code=1013)
        return
    offered = list(websocket.scope.get("subprotocols") or [])
    tenant: Tenant | None = None
    if gw.tenants.open_mode:
        tenant = gw.tenants.default
    else:
        keys = [p[len(BEARER_PREFIX):] for p in offered if p.lower().startswith(BEARER_PREFIX)]
        if keys:
            tenant = gw.tenants.authenticate(keys[0])
            if tenant is None:
                await websocket.close(code=1008)  # wrong key: refuse the handshake (403)
                return
    bound: str | None = None
    binding_error: APIError | None = None
    try:
        bound = agreed_session_id({
            f"'{QUERY_PARAM}' query parameter": websocket.query_params.get(QUERY_PARAM),
            f"{HEADER} header": websocket.headers.get(HEADER)})
    except APIError as e:
        binding_error = e
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    await WSConnection(websocket, gw, tenant, bound, binding_error).run()
