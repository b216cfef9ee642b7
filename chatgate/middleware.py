"""ASGI middleware: request-body size limit (413 with an OpenAI error body)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatgate.errors import APIError


class RequestTooLarge(Exception):
    """Raised by the wrapped ``receive`` once the body passes the limit; the app's exception
    handler turns it into a 413 (see ``too_large_handler``)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self.max_bytes = max_bytes


def too_large_error(max_bytes: int) -> APIError:
    return APIError(413, f"Request body too large: the limit is {max_bytes} bytes.",
                    code="request_too_large")


async def too_large_handler(request, exc):  # type: ignore[no-untyped-def]
    return too_large_error(exc.max_bytes).response()


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> APIError:
        return too_large_error(self.max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > self.max_bytes:
                        await self._error().response()(scope, receive, send)
                        return
                except ValueError:
                    pass
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise RequestTooLarge(self.max_bytes)
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except RequestTooLarge:
            if not started:
                await self._error().response()(scope, receive, send)
