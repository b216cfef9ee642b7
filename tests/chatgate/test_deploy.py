"""The deployment files' settings as the gateway reads them: tenants.example.toml loads, and
docker-compose.yml's default secret is a public placeholder, which ``chatgate serve`` refuses
when tenants are configured. The stack itself runs in tests/deploy."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from chatgate_testlib import REPO

from chatgate.settings import PLACEHOLDER_SECRETS
from chatgate.tenants import TenantRegistry, hash_api_key


def test_example_tenants_file_loads():
    reg = TenantRegistry.load(REPO / "tenants.example.toml", "x" * 32)
    assert set(reg.tenants) == {"alice", "bob"}
    assert reg.authenticate("sk-example-alice").id == "alice"
    assert reg.authenticate("sk-example-bob").id == "bob"
    assert reg.authenticate("sk-example-carol") is None
    assert reg.authenticate(None) is None
    assert reg.tenants["alice"].warm_system_prompts
    assert hash_api_key("sk-example-alice") == reg.tenants["alice"].api_key_sha256[0]
    # salts: per tenant, per secret, never empty
    other = TenantRegistry.load(REPO / "tenants.example.toml", "y" * 32)
    a, b = reg.tenants["alice"], reg.tenants["bob"]
    assert reg.cache_salt(a) != reg.cache_salt(b)
    assert reg.cache_salt(a) != other.cache_salt(a)
    assert reg.engine_session_id(a, "s") != reg.engine_session_id(b, "s")


def test_the_compose_default_secret_is_a_known_placeholder():
    yaml = pytest.importorskip("yaml")
    env = yaml.safe_load((REPO / "docker-compose.yml").read_text())["x-gateway"]["environment"]
    default = re.fullmatch(r"\$\{CHATGATE_SECRET:-(.+)\}", env["CHATGATE_SECRET"])
    assert default is not None and default.group(1) in PLACEHOLDER_SECRETS


def test_a_placeholder_secret_with_tenants_is_refused_before_anything_starts():
    secret = next(iter(PLACEHOLDER_SECRETS))
    r = subprocess.run([sys.executable, "-m", "chatgate", "serve", "--tenants",
                        str(REPO / "tenants.example.toml")], capture_output=True, text=True,
                       cwd=REPO, env={**os.environ, "CHATGATE_SECRET": secret}, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("chatgate serve: invalid server_secret: ")
    assert "a public placeholder cannot protect tenants; set CHATGATE_SECRET" in r.stderr
