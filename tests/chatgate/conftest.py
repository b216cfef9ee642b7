"""Fixtures: one shared real ``chatgate serve`` (session scope) on a free loopback port."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest
from chatgate_testlib import (
    ALLOWED_ORIGIN,
    KEYS,
    MAX_MODEL_LEN,
    MAX_REQUEST_BYTES,
    REDIS_URL,
    REPLICA_ID,
    WARM_PROMPT,
    WS_MAX_MESSAGE_BYTES,
    Server,
    redis_delete_prefix,
    sha,
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long-running gateway load tests")


@pytest.fixture(scope="session")
def redis_prefix() -> str:
    return f"chatgate-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    p.write_text(textwrap.dedent(f"""
        [[tenants]]
        id = "alice"
        api_key_sha256 = ["{sha(KEYS['alice'])}"]
        warm_system_prompts = ["{WARM_PROMPT}"]

        [[tenants]]
        id = "bob"
        api_key_sha256 = ["{sha(KEYS['bob'])}"]

        [[tenants]]
        id = "limited"
        api_key_sha256 = ["{sha(KEYS['limited'])}"]
        rpm = 3

        [[tenants]]
        id = "single"
        api_key_sha256 = ["{sha(KEYS['single'])}"]
        max_concurrent_streams = 1

        [[tenants]]
        id = "tokens"
        api_key_sha256 = ["{sha(KEYS['tokens'])}"]
        tpm = 40
    """))
    return p


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, tenants_file: Path, redis_prefix: str):
    """The shared gateway: tenants, Redis store, small limits so bad input is cheap to send."""
    log = tmp_path_factory.mktemp("logs") / "server.log"
    srv = Server([
        "--tenants", str(tenants_file),
        "--redis-url", REDIS_URL, "--redis-prefix", redis_prefix,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-request-bytes", str(MAX_REQUEST_BYTES),
        "--ws-max-message-bytes", str(WS_MAX_MESSAGE_BYTES),
        "--allowed-origins", ALLOWED_ORIGIN,
        "--server-secret", "test-secret-0123456789abcdef",
        "--replica-id", REPLICA_ID,
    ], log)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        redis_delete_prefix(redis_prefix)


@pytest.fixture(scope="module")
def client(server):
    """The official ``openai`` SDK on the shared gateway, as tenant alice."""
    import openai

    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["alice"], max_retries=0,
                      timeout=300)
    yield c
    c.close()
