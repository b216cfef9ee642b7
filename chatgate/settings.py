"""Validated gateway settings (pydantic). Built by the CLI, consumed by the app factory."""

from __future__ import annotations

import secrets
import socket
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.client import EngineConfig

# Server secrets that are public (docker-compose.yml's default): per-tenant cache salts derived
# from one are known to anyone who reads the repository.
PLACEHOLDER_SECRETS = frozenset({"change-me-to-a-long-random-secret"})



class Settings(BaseModel):
    """Everything ``chatgate serve`` can be told."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    replica_id: str = Field(default_factory=socket.gethostname,
                            pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    served_model_name: str | None = None

    redis_url: str | None = None
    redis_prefix: str = Field(default="chatgate", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    tenants_file: Path | None = None
    server_secret: str = Field(default_factory=lambda: secrets.token_hex(32), min_length=16)

    session_ttl: float = Field(default=7 * 24 * 3600.0, gt=0)
    session_idle_unpin: float = Field(default=600.0, gt=0)
    allowed_origins: list[str] = Field(default_factory=list)

    max_request_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    ws_max_message_bytes: int = Field(default=1024 * 1024, ge=1024)
    body_timeout: float = Field(default=30.0, gt=0)
    send_timeout: float = Field(default=30.0, gt=0)
    max_stop_sequences: int = Field(default=4, ge=0)
    max_tokens: int | None = Field(
        default=256, ge=1,
        description="the max_tokens of a request that leaves it unset, capped to the room "
                    "its prompt leaves in the context window; 0 or none: all that room "
                    "(vLLM's and OpenAI's rule)")
    repetition_guard: bool = Field(
        default=True,
        description="end an answer whose tail is one n-gram repeated (48+ tokens, 3+ "
                    "copies) with finish_reason length over HTTP, repetition over WebSocket")
    generation_config: Literal["auto", "vllm"] = "auto"
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _split_origins(cls, v: object) -> object:
        if isinstance(v, str):
            return [o.strip().rstrip("/") for o in v.split(",") if o.strip()]
        if isinstance(v, list):
            return [str(o).strip().rstrip("/") for o in v if str(o).strip()]
        return v

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        return v

    @model_validator(mode="after")
    def _check_tenants_file(self) -> Settings:
        if self.tenants_file is not None and not self.tenants_file.is_file():
            raise ValueError(f"tenants file not found: {self.tenants_file}")
        return self

    @property
    def placeholder_secret(self) -> bool:
        return self.server_secret in PLACEHOLDER_SECRETS

    @field_validator("server_secret")
    @classmethod
    def _refuse_placeholder_secret(cls, v: str, info: ValidationInfo) -> str:
        if v in PLACEHOLDER_SECRETS and info.data.get("tenants_file") is not None:
            raise ValueError("a public placeholder cannot protect tenants; set CHATGATE_SECRET "
                             "(or --server-secret) to a long random value, e.g. "
                             "`openssl rand -hex 32`")
        return v
