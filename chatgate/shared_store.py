"""The in-process session store, shared by several front-end processes (``--api-server-count``
without Redis): the supervising process keeps the one ``MemorySessionStore`` and serves it over
a Unix socket in its ipc folder (multiprocessing's manager protocol, with a random key); each
front-end's ``SharedSessionStore`` forwards every call to it from a worker thread, so a
session created through one front-end is read, continued and deleted through any of them.

Like the in-process store it lives as long as the server; each call costs a local round trip
(a fraction of a millisecond), a few per chat turn."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from multiprocessing.managers import BaseManager
from typing import Any

from chatgate.sessions import MemorySessionStore, Message, SessionRecord, SessionStore


class _StoreManager(BaseManager):
    pass


class _SyncStore:
    """A ``MemorySessionStore`` called from the manager's threads, one call at a time (its
    coroutines never suspend, so each runs to its end in one step)."""

    def __init__(self, ttl_s: float) -> None:
        self._store = MemorySessionStore(ttl_s)
        self._lock = threading.Lock()

    def call(self, name: str, *args: Any) -> Any:
        with self._lock:
            coroutine: Coroutine[Any, Any, Any] = getattr(self._store, name)(*args)
            try:
                coroutine.send(None)
            except StopIteration as done:
                return done.value
            coroutine.close()
            raise RuntimeError(f"MemorySessionStore.{name} suspended")


def serve_store(address: str, authkey: bytes, ttl_s: float) -> None:
    """Serve one in-process store at ``address`` (a Unix socket path) from a daemon thread of
    this process, for as long as it lives."""
    store = _SyncStore(ttl_s)
    _StoreManager.register("store", callable=lambda: store)
    server = _StoreManager(address=address, authkey=authkey).get_server()
    threading.Thread(target=server.serve_forever, name="session-store", daemon=True).start()


class SharedSessionStore(SessionStore):
    """A front-end's handle on the store that ``serve_store`` serves."""

    def __init__(self, address: str, authkey: bytes, ttl_s: float) -> None:
        super().__init__(ttl_s)
        _StoreManager.register("store")
        manager = _StoreManager(address=address, authkey=authkey)
        manager.connect()
        self._proxy = manager.store()  # type: ignore[attr-defined]

    async def _call(self, name: str, *args: Any) -> Any:
        return await asyncio.to_thread(self._proxy.call, name, *args)

    async def create(self, tenant_id: str, session_id: str, system: str | None,
                     scope: str | None = None) -> SessionRecord:
        return await self._call("create", tenant_id, session_id, system, scope)

    async def get(self, tenant_id: str, session_id: str) -> SessionRecord | None:
        return await self._call("get", tenant_id, session_id)

    async def list(self, tenant_id: str, scope: str | None = None) -> list[SessionRecord]:
        return await self._call("list", tenant_id, scope)

    async def append(self, tenant_id: str, session_id: str, messages: list[Message]) -> None:
        await self._call("append", tenant_id, session_id, messages)

    async def replace(self, tenant_id: str, session_id: str, system: str | None,
                      messages: list[Message]) -> SessionRecord:
        return await self._call("replace", tenant_id, session_id, system, messages)

    async def delete(self, tenant_id: str, session_id: str) -> bool:
        return await self._call("delete", tenant_id, session_id)

    async def ping(self) -> bool:
        return await self._call("ping")
