"""``ReplicaHeader``: the ASGI middleware that names this gateway replica on every response.

Each HTTP response and each WebSocket handshake answer carries ``X-Chatgate-Replica:
<replica id>``, so a client (or a test) behind a load balancer sees which replica served it;
with several front-end processes (``--api-server-count``), ``X-Chatgate-Api-Server: <index>``
names the process too."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-chatgate-replica"
API_SERVER_HEADER = "x-chatgate-api-server"


class ReplicaHeader:
    def __init__(self, app: ASGIApp, *, replica_id: str, api_server: int | None = None) -> None:
        self.app = app
        self.headers = [(HEADER.encode("latin-1"), replica_id.encode("latin-1"))]
        if api_server is not None:
            self.headers.append((API_SERVER_HEADER.encode("latin-1"), b"%d" % api_server))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return

        async def send_named(msg: Message) -> None:
            if msg["type"] in ("http.response.start", "websocket.accept"):
                msg["headers"] = [*msg.get("headers", []), *self.headers]
            await send(msg)

        await self.app(scope, receive, send_named)
