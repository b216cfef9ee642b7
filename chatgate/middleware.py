"""``RequestGuard``: the ASGI middleware in front of every route.

- **Origin** (HTTP and WebSocket): a request carrying an ``Origin`` header is refused (403,
  ``origin_not_allowed``) unless it is same-origin (its host equals ``Host``: the UI this
  gateway serves) or on the ``--allowed-origins`` list (``*``: any). Without the header (a
  non-browser client) it passes. So a page on another site cannot drive a local gateway.
- **Content type**: a request that carries a body (a ``Content-Length`` above 0 or a
  ``Transfer-Encoding``) needs ``Content-Type: application/json`` (415,
  ``unsupported_media_type``): a cross-site form or a "simple" ``text/plain`` fetch cannot send
  it without a CORS preflight. A body-less request (a ``DELETE`` as curl and the SDKs send it)
  needs none: it carries nothing a cross-site page could forge, and a cross-site ``DELETE`` is
  preflighted anyway.
- **Body**: at most ``max_bytes`` (413, ``request_too_large``), all of it within
  ``body_timeout`` seconds (408, ``request_timeout``: a client trickling its body).
- **Slow readers**: a response chunk that the client has not taken within ``send_timeout``
  seconds (checked every quarter of it, so at most 1.25 × that) drops the connection; the
  abandoned stream's engine request is aborted.
- **Access log**: one line per HTTP request once its response has ended: method, path,
  status, seconds, and the tokens of the turns it ran (``scope["state"]["turn_stats"]``).
  (A WebSocket logs one line per turn instead: ``chatgate.ws``.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatgate.errors import APIError
from chatgate.turn import TurnStats

log = logging.getLogger("chatgate")

# uvicorn logs this error for a response its app left unfinished (then closes the connection);
# the guard leaves a dropped slow reader's unfinished on purpose: the close is the drop
UNFINISHED = "ASGI callable returned without completing response."
_dropped: ContextVar[bool] = ContextVar("dropped", default=False)


class _DroppedOnPurpose(logging.Filter):
    """Keeps uvicorn's ``UNFINISHED`` error out of the log for a response the guard dropped
    (told by the request task's context, in which uvicorn logs it): the guard's own warning
    says what happened."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == UNFINISHED and _dropped.get())


_DROPPED_FILTER = _DroppedOnPurpose()


class _BodyRefused(Exception):
    """Raised by the guarded ``receive``; becomes ``error`` if no response has started."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class _SendWatch:
    """Cancels the task serving a response once one of its streamed chunks has waited
    ``timeout`` seconds for the client to take it. One timer per response, checking every
    ``timeout / 4``: a timeout around each chunk's send (``asyncio.timeout``: 5 us) would cost
    as much as the rest of a chunk's Python."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._fired = False
        self._waiting_since: float | None = None  # when the send in progress began
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None

    async def send(self, send: Send, msg: Message) -> None:
        if self._timer is None:
            self._timer = self._loop.call_later(self.timeout / 4, self._check)
        self._waiting_since = self._loop.time()
        try:
            await send(msg)
        finally:
            self._waiting_since = None

    def _check(self) -> None:
        since = self._waiting_since
        if since is not None and self._loop.time() - since >= self.timeout:
            assert self._task is not None
            self._fired = True
            self._task.cancel()
        else:
            self._timer = self._loop.call_later(self.timeout / 4, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def took_cancellation(self) -> bool:
        """Whether the task's ``CancelledError`` is this watch's alone (then withdrawn, as
        ``asyncio.timeout`` does), not also someone else's."""
        assert self._task is not None
        return self._fired and self._task.uncancel() == 0


def origin_allowed(headers: Headers, allowed: list[str]) -> bool:
    """No Origin: allowed. Otherwise the Origin must be on ``allowed`` (``*``: any) or name the
    host the request was sent to."""
    origin = headers.get("origin")
    if origin is None:
        return True
    origin = origin.rstrip("/")
    if "*" in allowed or origin in allowed:
        return True
    host = headers.get("host", "")
    return bool(host) and urlsplit(origin).netloc.lower() == host.lower()


def is_json_content_type(value: str | None) -> bool:
    """``application/json``, with parameters (``; charset=utf-8``) allowed."""
    return value is not None and value.split(";", 1)[0].strip().lower() == "application/json"


def has_body(headers: Headers) -> bool:
    """Whether the request carries a body: a ``Content-Length`` other than 0, or a
    ``Transfer-Encoding`` (chunked)."""
    if "transfer-encoding" in headers:
        return True
    length = headers.get("content-length", "0").strip()
    return not (length.isdigit() and int(length) == 0)


def too_large_error(max_bytes: int) -> APIError:
    return APIError(413, f"Request body too large: the limit is {max_bytes} bytes.",
                    code="request_too_large")


class RequestGuard:
    def __init__(self, app: ASGIApp, *, allowed_origins: list[str], max_bytes: int,
                 body_timeout: float, send_timeout: float) -> None:
        self.app = app
        self.allowed_origins = allowed_origins
        self.max_bytes = max_bytes
        self.body_timeout = body_timeout
        self.send_timeout = send_timeout
        logging.getLogger("uvicorn.error").addFilter(_DROPPED_FILTER)  # once: the same object

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not origin_allowed(headers, self.allowed_origins):
            log.warning("refused %s %s from origin %s", scope["type"], scope["path"],
                        headers.get("origin"))
            if scope["type"] == "websocket":  # before accept: the handshake gets HTTP 403
                await send({"type": "websocket.close", "code": 1008})
                return
            error = APIError(403, f"Origin {headers.get('origin')!r} is not allowed; start the "
                             "gateway with --allowed-origins to allow it.",
                             code="origin_not_allowed")
            await error.response()(scope, receive, send)
            access_log(scope, error.status, 0.0)
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        error = self._check_http(scope["method"], headers)
        if error is not None:
            await error.response()(scope, receive, send)
            access_log(scope, error.status, 0.0)
            return
        await self._guarded_http(scope, receive, send)

    def _check_http(self, method: str, headers: Headers) -> APIError | None:
        if has_body(headers) and not is_json_content_type(headers.get("content-type")):
            return APIError(415, f"A {method} request with a body must have Content-Type: "
                            f"application/json (got {headers.get('content-type')!r}).",
                            code="unsupported_media_type")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return too_large_error(self.max_bytes)
        return None

    async def _guarded_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        seen = 0
        began = time.monotonic()
        deadline = began + self.body_timeout
        started = False
        status = 0

        body_done = False
        watch = _SendWatch(self.send_timeout)

        async def guarded_receive() -> Message:
            nonlocal seen, body_done
            if body_done:  # later calls wait for the disconnect, for as long as the response
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise _BodyRefused(APIError(
                    408, f"The request body did not arrive within {self.body_timeout:g} s.",
                    code="request_timeout")) from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyRefused(too_large_error(self.max_bytes))
                body_done = not msg.get("more_body", False)
            else:
                body_done = True
            return msg

        async def guarded_send(msg: Message) -> None:
            nonlocal started, status
            if msg["type"] == "http.response.start":
                started = True
                status = msg["status"]
            if msg["type"] == "http.response.body" and msg.get("more_body", False):
                await watch.send(send, msg)
            else:
                await send(msg)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except _BodyRefused as e:
            if not started:
                status = e.error.status
                await e.error.response()(scope, receive, send)
        except asyncio.CancelledError:
            if not watch.took_cancellation():
                raise
            # Returning with the response unfinished makes the server close the connection.
            _dropped.set(True)
            log.warning("dropped %s %s: the client read nothing for %g s", scope["method"],
                        scope["path"], self.send_timeout)
        finally:
            watch.stop()
            access_log(scope, status, time.monotonic() - began)


def tokens_text(stats: list[TurnStats]) -> str:
    """`` prompt=P cached=C completion=N`` summed over the turns (empty for none), then
    `` spec_accepted=A/D (R%)`` where speculative drafts were verified."""
    if not stats:
        return ""
    text = (f" prompt={sum(s.prompt_tokens for s in stats)}"
            f" cached={sum(s.cached_tokens for s in stats)}"
            f" completion={sum(s.completion_tokens for s in stats)}")
    drafted = sum(s.draft_tokens for s in stats)
    if drafted:
        accepted = sum(s.accepted_tokens for s in stats)
        text += f" spec_accepted={accepted}/{drafted} ({100 * accepted / drafted:.0f}%)"
    return text


def access_log(scope: Scope, status: int, seconds: float) -> None:
    stats = scope.get("state", {}).get("turn_stats") or []
    log.info("%s %s %d %.3fs%s", scope["method"], scope["path"], status, seconds,
             tokens_text(stats))
