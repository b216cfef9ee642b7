"""The stack users start with ``docker compose up``, as real containers: the CPU image built from
the Dockerfile, then HAProxy + 3 gateway replicas + Redis from docker-compose.yml, unchanged,
under a compose project of its own (its own network and volumes, ports published on 127.0.0.1
only, all removed at the end).

Two hooks of the files are used where this machine needs them, and only then: the base images
come from ``deploy/offline-base-images.sh`` when no registry can be reached (``.ci/run`` runs
it), and when the host's pip takes wheels from a local folder or trusts a CA bundle of its own
(``find-links``, ``cert``: its environment or its pip.conf) the image build gets the same
through ``deploy/pip/``.
Skipped only where no Docker engine answers or no compose command is installed."""

from __future__ import annotations

import csv
import io
import os
import secrets
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scale_cluster import free_port  # noqa: E402

REPLICAS = 3
BUILD_TIMEOUT_S = 1800.0
UP_TIMEOUT_S = 900.0  # three replicas converting the weights and building kernels on 2 cores


def compose_command() -> list[str] | None:
    """``docker compose`` (the plugin) if installed, else ``docker-compose``, else None."""
    if shutil.which("docker") and subprocess.run(
            ["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def docker_engine_error() -> str | None:
    """Why no Docker engine can be used here, or None when one answers."""
    if shutil.which("docker") is None:
        return "the docker client is not installed"
    r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return f"no Docker engine answers: {r.stderr.strip().splitlines()[-1:]}"
    return None


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                           f"{r.stderr[-3000:]}")
    return r


def host_pip_option(name: str) -> str | None:
    """This host's pip setting ``name`` (``cert``, ``find-links``): from its environment, else
    from its configuration files."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True).stdout
    values: dict[str, str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        scope, _, option = key.rpartition(".")
        if option == name:
            values[scope] = value.strip("'\"")
    return values.get(":env:") or next(iter(values.values()), None)


def fill_pip_hook() -> bool:
    """Give the image build this host's pip sources (deploy/pip/README.md); True when the host
    has any, and the build should take torch from them."""
    hook = ROOT / "deploy" / "pip"
    conf = ["[global]"]
    cert = host_pip_option("cert")
    if cert and Path(cert).is_file():
        shutil.copy(cert, hook / "ca-bundle.crt")
        conf.append("cert = /etc/xdg/pip/ca-bundle.crt")
    links = [Path(p) for p in (host_pip_option("find-links") or "").split() if Path(p).is_dir()]
    wheels = [w for folder in links for w in folder.glob("*-cp311-*.whl")]  # the image's Python
    for wheel in wheels:
        if not (hook / wheel.name).exists():
            shutil.copy(wheel, hook / wheel.name)
    if wheels:
        conf.append("find-links = /etc/xdg/pip")
    if len(conf) == 1:
        return False
    (hook / "pip.conf").write_text("\n".join(conf) + "\n")
    return True


class Stack:
    """One ``docker compose`` project of docker-compose.yml."""

    def __init__(self, compose: list[str]) -> None:
        self.project = f"chatgate-test-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.stats_port = free_port()
        self.env = {**os.environ, "CHATGATE_PORT": str(self.port),
                    "HAPROXY_STATS_PORT": str(self.stats_port),
                    "CHATGATE_SECRET": secrets.token_hex(32)}
        self.compose = [*compose, "-p", self.project, "-f", str(ROOT / "docker-compose.yml")]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    def run(self, *args: str, timeout: float = 300.0,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        return run([*self.compose, *args], timeout, self.env, check)

    def up(self) -> float:
        """Start the stack and wait until HAProxy sees every replica up; returns the seconds."""
        t0 = time.monotonic()
        self.run("up", "-d", "--no-build", "--scale", f"gateway={REPLICAS}",
                 timeout=UP_TIMEOUT_S)
        deadline = t0 + UP_TIMEOUT_S
        while sum(s == "UP" for s in self.server_states().values()) < REPLICAS:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas not up: {self.server_states()}\n{self.logs()}")
            time.sleep(1)
        return time.monotonic() - t0

    def down(self) -> None:
        self.run("down", "-v", "--remove-orphans", "--timeout", "30", timeout=300, check=False)

    def containers(self, service: str | None = None, all_states: bool = False) -> list[str]:
        """Ids (12 hex digits: a replica's hostname, hence its X-Chatgate-Replica) of the
        project's containers, running ones unless ``all_states``."""
        labels = [f"label=com.docker.compose.project={self.project}"]
        if service:
            labels.append(f"label=com.docker.compose.service={service}")
        cmd = ["docker", "ps", "-q", *(["-a"] if all_states else [])]
        for label in labels:
            cmd += ["--filter", label]
        return run(cmd, 60).stdout.split()

    def server_states(self) -> dict[str, str]:
        """HAProxy's view of the gateway servers: name -> UP/DOWN/MAINT (from its CSV stats)."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        except httpx.HTTPError:
            return {}
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {row["svname"]: row["status"].split()[0] for row in rows
                if row["pxname"] == "gateways" and row["svname"] not in ("FRONTEND", "BACKEND")
                and not row["status"].startswith("MAINT")}

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "40", timeout=120, check=False).stdout


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    why = docker_engine_error()
    if why:
        pytest.skip(f"the deploy tests need a Docker engine: {why}")
    compose = compose_command()
    if compose is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    build = ["docker", "build", "-t", "chatgate:latest", "."]
    if fill_pip_hook():
        build[2:2] = ["--build-arg", "TORCH_INDEX_URL="]
    t0 = time.monotonic()
    run(build, BUILD_TIMEOUT_S)
    print(f"\ndeploy: image built in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    s = Stack(compose)
    try:
        print(f"deploy: {REPLICAS} replicas up behind HAProxy in {s.up():.0f} s",
              file=sys.stderr)
        yield s
    finally:
        s.down()
