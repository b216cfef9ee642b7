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

# Server secrets that are public (docker-compose.yml's default): per-tenant cache salts derived
# from one are known to anyone who reads the repository.
PLACEHOLDER_SECRETS = frozenset({"change-me-to-a-long-random-secret"})


class EngineSettings(BaseModel):
    """The engine knobs, named like vLLM's flags. ``None`` lets the engine pick."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = "smollm2"
    tokenizer: str | None = None
    device: str | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16"] | None = None
    block_size: Literal[8, 16, 32] = 16
    num_kv_blocks: int | None = Field(default=None, ge=1)
    kv_cache_bytes: int | None = Field(default=None, ge=1)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    max_num_seqs: int = Field(default=128, ge=1)
    max_model_len: int | None = Field(default=None, ge=2)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    admission_batch: int | None = Field(default=None, ge=1)
    quantization: Literal["int8"] | None = None
    seed: int = 0

    def engine_kwargs(self) -> dict:
        """Keyword arguments for ``engine.EngineConfig``."""
        kw = self.model_dump()
        if kw.get("dtype") == "auto":
            kw["dtype"] = None
        return kw


class Settings(BaseModel):
    """Everything ``chatgate serve`` can be told."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    replica_id: str = Field(default_factory=socket.gethostname,
                            pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    engine: EngineSettings = Field(default_factory=EngineSettings)
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
