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
    """Everything ``chatgate serve`` can be told: the one declaration of the gateway's
    defaults and help texts. The CLI derives one flag per field with a ``description``
    (``chatgate.cli``), as it derives the engine's from ``EngineConfig``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    api_server_count: int = Field(
        default=1, ge=1, le=64,
        description="gateway (front-end) processes that accept connections on the one port "
                    "and share one engine process (vLLM's flag); default "
                    "$CHATGATE_API_SERVER_COUNT, else 1")
    replica_id: str = Field(
        default_factory=socket.gethostname, pattern=r"^[A-Za-z0-9_.:-]{1,64}$",
        description="this gateway's name in the X-Chatgate-Replica header and the metrics' "
                    "replica label (default: the hostname)")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    served_model_name: str | None = Field(
        default=None, description="model id shown by /v1/models and accepted in requests")

    redis_url: str | None = Field(
        default=None, description="session store; default $REDIS_URL, else the in-process "
                                  "store")
    redis_prefix: str = Field(default="chatgate", pattern=r"^[A-Za-z0-9_.:-]{1,64}$",
                              description="Redis key prefix")
    tenants_file: Path | None = Field(
        default=None, description="tenants TOML (API key hashes, limits); default: one open "
                                  "tenant")
    server_secret: str = Field(
        default_factory=lambda: secrets.token_hex(32), min_length=16,
        description="secret for per-tenant cache salts; default $CHATGATE_SECRET or random")

    session_ttl: float = Field(
        default=7 * 24 * 3600.0, gt=0,
        description="seconds a session's history is kept after its last use")
    session_idle_unpin: float = Field(
        default=600.0, gt=0,
        description="seconds after which an idle session's KV blocks are unpinned")
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="comma-separated browser Origins allowed on every endpoint and for CORS "
                    "('*' = any); default: same origin only (others get 403)")

    max_request_bytes: int = Field(default=4 * 1024 * 1024, ge=1024,
                                   description="largest HTTP request body (else 413)")
    ws_max_message_bytes: int = Field(default=1024 * 1024, ge=1024,
                                      description="largest WebSocket message")
    body_timeout: float = Field(
        default=30.0, gt=0,
        description="seconds a client has to send its whole request body (else 408)")
    send_timeout: float = Field(
        default=30.0, gt=0,
        description="seconds a client may leave a response chunk unread before the "
                    "connection is dropped and its request aborted")
    stream_interval: int = Field(
        default=1, ge=1, le=1024,
        description="tokens a stream gathers before it sends them (the first and the last go "
                    "at once): 1 streams every token as it comes; more trades smoothness for "
                    "less gateway CPU a token (vLLM's and SGLang's flag)")
    max_tokens: int | None = Field(
        default=256, ge=1,
        description="the max_tokens of a request that leaves it unset, capped to the room "
                    "its prompt leaves in the context window; 0 or none: all that room "
                    "(vLLM's and OpenAI's rule)")
    repetition_guard: bool = Field(
        default=True,
        description="end an answer whose tail is one n-gram repeated (48+ tokens, 3+ "
                    "copies) with finish_reason length over HTTP, repetition over WebSocket")
    generation_config: Literal["auto", "vllm"] = Field(
        default="auto",
        description="sampling defaults for what a request leaves unset: auto (the model's "
                    "recommended ones, else vllm's) or vllm (temperature 1, top_p 1, no "
                    "top_k)")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        default="info", description="log verbosity")

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
