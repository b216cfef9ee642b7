"""Tenants: API keys (stored as SHA-256 hex, compared in constant time), limits, warm system
prompts, and the per-tenant cache salt derived on the server.

``tenants.toml``::

    [[tenants]]
    id = "acme"
    api_key_sha256 = ["<sha256 hex of the key>"]
    rpm = 60                  # requests per minute (0 = unlimited)
    tpm = 100000              # prompt + completion tokens per minute (0 = unlimited)
    max_concurrent_streams = 8
    warm_system_prompts = ["You are a helpful assistant."]
"""

from __future__ import annotations

import hashlib
import hmac
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

LOCAL_TENANT_ID = "local"


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    api_key_sha256: list[str] = Field(default_factory=list)
    rpm: int = Field(default=0, ge=0)
    tpm: int = Field(default=0, ge=0)
    max_concurrent_streams: int = Field(default=0, ge=0)
    warm_system_prompts: list[str] = Field(default_factory=list)

    @field_validator("api_key_sha256", mode="before")
    @classmethod
    def _one_or_many(cls, v: object) -> object:
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            out = []
            for h in v:
                h = str(h).strip().lower()
                if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
                    raise ValueError("api_key_sha256 entries must be 64 hex characters")
                out.append(h)
            return out
        return v


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenants: list[Tenant] = Field(min_length=1)


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class TenantRegistry:
    """Resolves API keys to tenants. With no tenants file: one open tenant, no auth."""

    def __init__(self, tenants: list[Tenant], *, open_mode: bool, server_secret: str) -> None:
        ids = [t.id for t in tenants]
        if len(set(ids)) != len(ids):
            raise ValueError("tenant ids must be unique")
        self.tenants = {t.id: t for t in tenants}
        self.open_mode = open_mode
        self._secret = server_secret.encode("utf-8")
        self._keys: list[tuple[bytes, Tenant]] = [
            (bytes.fromhex(h), t) for t in tenants for h in t.api_key_sha256
        ]

    @classmethod
    def load(cls, path: Path | None, server_secret: str) -> TenantRegistry:
        if path is None:
            return cls([Tenant(id=LOCAL_TENANT_ID)], open_mode=True, server_secret=server_secret)
        with open(path, "rb") as f:
            data = tomllib.load(f)
        parsed = TenantsFile.model_validate(data)
        return cls(parsed.tenants, open_mode=False, server_secret=server_secret)

    @property
    def default(self) -> Tenant:
        return next(iter(self.tenants.values()))

    def authenticate(self, api_key: str | None) -> Tenant | None:
        """The tenant owning ``api_key``; every stored hash is compared (constant time)."""
        if self.open_mode:
            return self.default
        if not api_key:
            return None
        digest = hashlib.sha256(api_key.encode("utf-8")).digest()
        found: Tenant | None = None
        for stored, tenant in self._keys:
            if hmac.compare_digest(stored, digest) and found is None:
                found = tenant
        return found

    def cache_salt(self, tenant: Tenant) -> str:
        """HMAC-SHA256(server secret, tenant id): never taken from the client."""
        return hmac.new(self._secret, tenant.id.encode("utf-8"), hashlib.sha256).hexdigest()

    @staticmethod
    def engine_session_id(tenant: Tenant, session_id: str) -> str:
        """The engine's name of a tenant's session: tenants' session ids never collide."""
        return f"{tenant.id}:{session_id}"
