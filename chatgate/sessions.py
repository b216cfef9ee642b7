"""Session store: metadata + message history of chat sessions, scoped by tenant.

Two implementations of one interface:

* ``MemorySessionStore`` — in-process, the embedded default (lost on restart);
* ``RedisSessionStore`` — redis.asyncio; per session a hash (metadata) and a list (messages,
  JSON), plus a sorted set per tenant indexing its sessions by last update. Every key is
  ``{prefix}:{tenant}:...``; each use refreshes the TTL; multi-key writes run in MULTI/EXEC.

A message is ``{role, content}`` plus what the store keeps beside it (an answer's ``usage``,
``timings``, ``finish_reason``, ``cut``). A session may carry a ``scope``, a client's label (the
web UI's per-browser id) that listing can filter on.
"""

from __future__ import annotations

import abc
import copy
import json
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

TITLE_CHARS = 60
_SET_TITLE_LUA = (
    "if (redis.call('HGET', KEYS[1], 'title') or '') == '' then "
    "redis.call('HSET', KEYS[1], 'title', ARGV[1]) end return 1"
)

Message = dict[str, Any]


@dataclass
class SessionRecord:
    id: str
    title: str = ""
    system: str | None = None
    created: float = 0.0
    updated: float = 0.0
    num_messages: int = 0
    messages: list[Message] = field(default_factory=list)
    scope: str | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "created": int(self.created),
            "updated": int(self.updated),
            "num_messages": self.num_messages,
        }

    def detail(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "created": int(self.created),
            "updated": int(self.updated),
            "system": self.system,
            "messages": copy.deepcopy(self.messages),
        }

    def chat_messages(self) -> list[Message]:
        """System prompt (if any) + history, ready for the chat template."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m["role"], "content": m["content"]} for m in self.messages]


def _title_of(messages: list[Message]) -> str:
    for m in messages:
        if m.get("role") == "user" and m.get("content"):
            return " ".join(m["content"].split())[:TITLE_CHARS]
    return ""


class SessionStore(abc.ABC):
    """Async session storage, every call scoped by tenant id."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s

    @abc.abstractmethod
    async def create(self, tenant_id: str, session_id: str, system: str | None,
                     scope: str | None = None) -> SessionRecord:
        """Create (or reset) a session, labelled with ``scope`` if given."""

    @abc.abstractmethod
    async def get(self, tenant_id: str, session_id: str) -> SessionRecord | None:
        """The session with its messages, refreshing its TTL; ``None`` if absent/expired."""

    @abc.abstractmethod
    async def list(self, tenant_id: str, scope: str | None = None) -> list[SessionRecord]:
        """The tenant's sessions (without messages; only those of ``scope`` if given), most
        recently updated first."""

    @abc.abstractmethod
    async def append(self, tenant_id: str, session_id: str, messages: list[Message]) -> None:
        """Append messages to an existing session."""

    @abc.abstractmethod
    async def replace(
        self, tenant_id: str, session_id: str, system: str | None, messages: list[Message]
    ) -> SessionRecord:
        """Set a session's system prompt and whole history (creating it if needed)."""

    @abc.abstractmethod
    async def delete(self, tenant_id: str, session_id: str) -> bool:
        """Delete a session; ``False`` if it did not exist."""

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None


class MemorySessionStore(SessionStore):
    """In-process store with the same TTL semantics (expiry checked lazily)."""

    def __init__(self, ttl_s: float) -> None:
        super().__init__(ttl_s)
        self._data: dict[tuple[str, str], tuple[SessionRecord, float]] = {}

    def _live(self, key: tuple[str, str]) -> SessionRecord | None:
        item = self._data.get(key)
        if item is None:
            return None
        rec, expires = item
        if expires <= time.monotonic():
            del self._data[key]
            return None
        return rec

    def _touch(self, key: tuple[str, str], rec: SessionRecord) -> None:
        self._data[key] = (rec, time.monotonic() + self.ttl_s)

    @staticmethod
    def _copy(rec: SessionRecord, with_messages: bool = True) -> SessionRecord:
        return SessionRecord(
            rec.id, rec.title, rec.system, rec.created, rec.updated, rec.num_messages,
            copy.deepcopy(rec.messages) if with_messages else [], rec.scope,
        )

    async def create(self, tenant_id: str, session_id: str, system: str | None,
                     scope: str | None = None) -> SessionRecord:
        now = time.time()
        rec = SessionRecord(id=session_id, system=system or None, created=now, updated=now,
                            scope=scope)
        self._touch((tenant_id, session_id), rec)
        return self._copy(rec)

    async def get(self, tenant_id: str, session_id: str) -> SessionRecord | None:
        key = (tenant_id, session_id)
        rec = self._live(key)
        if rec is None:
            return None
        self._touch(key, rec)
        return self._copy(rec)

    async def list(self, tenant_id: str, scope: str | None = None) -> list[SessionRecord]:
        out = []
        for t, sid in list(self._data):
            if t == tenant_id:
                rec = self._live((t, sid))
                if rec is not None and (scope is None or rec.scope == scope):
                    out.append(self._copy(rec, with_messages=False))
        out.sort(key=lambda r: r.updated, reverse=True)
        return out

    async def append(self, tenant_id: str, session_id: str, messages: list[Message]) -> None:
        key = (tenant_id, session_id)
        rec = self._live(key)
        if rec is None:
            raise KeyError(session_id)
        rec.messages.extend(copy.deepcopy(messages))
        rec.num_messages = len(rec.messages)
        rec.updated = time.time()
        if not rec.title:
            rec.title = _title_of(rec.messages)
        self._touch(key, rec)

    async def replace(
        self, tenant_id: str, session_id: str, system: str | None, messages: list[Message]
    ) -> SessionRecord:
        key = (tenant_id, session_id)
        now = time.time()
        rec = self._live(key) or SessionRecord(id=session_id, created=now)
        rec.system = system or None
        rec.messages = copy.deepcopy(messages)
        rec.num_messages = len(rec.messages)
        rec.updated = now
        rec.title = _title_of(rec.messages)
        self._touch(key, rec)
        return self._copy(rec)

    async def delete(self, tenant_id: str, session_id: str) -> bool:
        key = (tenant_id, session_id)
        existed = self._live(key) is not None
        self._data.pop(key, None)
        return existed


class RedisSessionStore(SessionStore):
    """Keys: ``{prefix}:{tenant}:session:{id}`` (hash), ``...:{id}:messages`` (list of JSON),
    ``{prefix}:{tenant}:sessions`` (sorted set: id → updated)."""

    def __init__(self, url: str, ttl_s: float, prefix: str = "chatgate") -> None:
        super().__init__(ttl_s)
        self.prefix = prefix
        self.url = url
        self.redis = aioredis.from_url(url, decode_responses=True)

    @property
    def _ttl(self) -> int:
        return max(1, int(round(self.ttl_s)))

    def meta_key(self, tenant_id: str, session_id: str) -> str:
        return f"{self.prefix}:{tenant_id}:session:{session_id}"

    def messages_key(self, tenant_id: str, session_id: str) -> str:
        return f"{self.prefix}:{tenant_id}:session:{session_id}:messages"

    def index_key(self, tenant_id: str) -> str:
        return f"{self.prefix}:{tenant_id}:sessions"

    def _keys(self, tenant_id: str, session_id: str) -> tuple[str, str, str]:
        return (self.meta_key(tenant_id, session_id), self.messages_key(tenant_id, session_id),
                self.index_key(tenant_id))

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def close(self) -> None:
        await self.redis.aclose()

    @staticmethod
    def _record(session_id: str, meta: dict[str, str], raw: list[str] | None) -> SessionRecord:
        return SessionRecord(
            id=session_id,
            title=meta.get("title", ""),
            system=meta.get("system") or None,
            created=float(meta.get("created", 0) or 0),
            updated=float(meta.get("updated", 0) or 0),
            num_messages=int(meta.get("num_messages", 0) or 0),
            messages=[json.loads(m) for m in raw] if raw is not None else [],
            scope=meta.get("scope") or None,
        )

    async def create(self, tenant_id: str, session_id: str, system: str | None,
                     scope: str | None = None) -> SessionRecord:
        now = time.time()
        mk, lk, ik = self._keys(tenant_id, session_id)
        meta = {"id": session_id, "title": "", "system": system or "", "created": repr(now),
                "updated": repr(now), "num_messages": 0, "scope": scope or ""}
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(mk, lk)
            p.hset(mk, mapping=meta)
            p.expire(mk, self._ttl)
            p.zadd(ik, {session_id: now})
            p.expire(ik, self._ttl)
            await p.execute()
        return SessionRecord(id=session_id, system=system or None, created=now, updated=now,
                             scope=scope)

    async def get(self, tenant_id: str, session_id: str) -> SessionRecord | None:
        mk, lk, ik = self._keys(tenant_id, session_id)
        async with self.redis.pipeline(transaction=True) as p:
            p.hgetall(mk)
            p.lrange(lk, 0, -1)
            p.expire(mk, self._ttl)
            p.expire(lk, self._ttl)
            p.expire(ik, self._ttl)
            meta, raw, *_ = await p.execute()
        if not meta:
            return None
        return self._record(session_id, meta, raw)

    async def list(self, tenant_id: str, scope: str | None = None) -> list[SessionRecord]:
        ik = self.index_key(tenant_id)
        ids = await self.redis.zrevrange(ik, 0, -1)
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as p:
            for sid in ids:
                p.hgetall(self.meta_key(tenant_id, sid))
            metas = await p.execute()
        out, gone = [], []
        for sid, meta in zip(ids, metas, strict=True):
            if not meta:
                gone.append(sid)
            elif scope is None or meta.get("scope") == scope:
                out.append(self._record(sid, meta, None))
        if gone:  # expired sessions leave their id in the index: prune lazily
            await self.redis.zrem(ik, *gone)
        return out

    async def append(self, tenant_id: str, session_id: str, messages: list[Message]) -> None:
        if not messages:
            return
        now = time.time()
        mk, lk, ik = self._keys(tenant_id, session_id)
        if not await self.redis.exists(mk):
            raise KeyError(session_id)
        title = _title_of(messages)
        async with self.redis.pipeline(transaction=True) as p:
            p.rpush(lk, *[json.dumps(m, ensure_ascii=False) for m in messages])
            p.hincrby(mk, "num_messages", len(messages))
            p.hset(mk, "updated", repr(now))
            if title:  # the title is set once, while it is still empty
                p.eval(_SET_TITLE_LUA, 1, mk, title)
            p.expire(mk, self._ttl)
            p.expire(lk, self._ttl)
            p.zadd(ik, {session_id: now})
            p.expire(ik, self._ttl)
            await p.execute()

    async def replace(
        self, tenant_id: str, session_id: str, system: str | None, messages: list[Message]
    ) -> SessionRecord:
        now = time.time()
        mk, lk, ik = self._keys(tenant_id, session_id)
        created, scope = await self.redis.hmget(mk, ["created", "scope"])
        created_f = float(created) if created else now
        title = _title_of(messages)
        meta = {"id": session_id, "title": title, "system": system or "",
                "created": repr(created_f), "updated": repr(now), "num_messages": len(messages)}
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(lk)
            if messages:
                p.rpush(lk, *[json.dumps(m, ensure_ascii=False) for m in messages])
                p.expire(lk, self._ttl)
            p.hset(mk, mapping=meta)
            p.expire(mk, self._ttl)
            p.zadd(ik, {session_id: now})
            p.expire(ik, self._ttl)
            await p.execute()
        return SessionRecord(session_id, title, system or None, created_f, now, len(messages),
                             copy.deepcopy(messages), scope or None)

    async def delete(self, tenant_id: str, session_id: str) -> bool:
        mk, lk, ik = self._keys(tenant_id, session_id)
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(mk)
            p.delete(lk)
            p.zrem(ik, session_id)
            deleted, *_ = await p.execute()
        return bool(deleted)


def is_store_error(exc: BaseException) -> bool:
    """Whether ``exc`` means the session store is unreachable or failing."""
    return isinstance(exc, RedisError | OSError)


def make_store(redis_url: str | None, ttl_s: float, prefix: str) -> SessionStore:
    if redis_url:
        return RedisSessionStore(redis_url, ttl_s, prefix)
    return MemorySessionStore(ttl_s)
