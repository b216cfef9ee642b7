"""How the engine process is started and found: its command line and environment, and the
addresses each client binds (``EngineLink``). Torch-free: the gateway's processes import it.

One client (``AsyncEngine`` alone) starts the engine process itself. With several clients
(``chatgate serve --api-server-count N``) the supervising process starts it with N links, one
per front-end process, and each front-end's ``AsyncEngine`` attaches to its link."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from engine.config import EngineConfig
from engine.logs import child_environment

# The engine process's OpenMP threads spin a short while at a barrier, then sleep (libgomp:
# GOMP_SPINCOUNT; other runtimes: OMP_WAIT_POLICY). Spinning on, a thread holds the core the
# thread it waits for needs on a CPU the gateway shares (a 32-row step 3.6x as long under load);
# sleeping at once, each of a step's ~90 parallel regions waits for a wake-up (one stream's
# tokens twice as far apart). Figures: docs/benchmarks.md, section 4.
OPENMP_WAIT = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}


def openmp_wait(environ: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP wait settings the engine process gets: ``OPENMP_WAIT``, unless ``environ``
    (the caller's environment) sets either variable, which then rules alone."""
    return {} if OPENMP_WAIT.keys() & environ.keys() else dict(OPENMP_WAIT)


def engine_environment() -> dict[str, str]:
    """The engine process's environment, whoever starts it: this process's
    (``child_environment``) with ``openmp_wait``'s settings."""
    return openmp_wait(os.environ) | child_environment()


@dataclass(frozen=True)
class EngineLink:
    """One client's pair of ZeroMQ addresses (the client binds both, the engine connects), the
    folder the engine saves its tokenizer in before it reports ready (shared by its clients),
    and the engine process's pid, where another process started it (None: the client starts
    it)."""

    inbox: str  # client -> engine
    outbox: str  # engine -> client
    tokenizer_dir: str
    engine_pid: int | None = None


def ipc_links(directory: str, count: int) -> list[EngineLink]:
    """``count`` links as ipc:// sockets in ``directory`` (private: mode 0700), with the
    tokenizer folder in it."""
    return [EngineLink(f"ipc://{directory}/in-{i}", f"ipc://{directory}/out-{i}",
                       f"{directory}/tokenizer") for i in range(count)]


def engine_command(config: EngineConfig, links: list[EngineLink], parent_fd: int,
                   log_level: str) -> list[str]:
    """``python -m engine.core`` serving ``links`` (which share one tokenizer folder); it exits
    when ``parent_fd`` (the read end of a pipe whose write end only its parent holds) reaches
    EOF."""
    argv = [sys.executable, "-m", "engine.core", "--config",
            msgspec.json.encode(config).decode(), "--parent-fd", str(parent_fd),
            "--tokenizer-dir", links[0].tokenizer_dir, "--log-level", log_level]
    for link in links:
        argv += ["--inbox", link.inbox, "--outbox", link.outbox]
    return argv


def process_exit(pid: int) -> asyncio.Future[int | None]:
    """A future of the running loop that is done (with None: the exit code is the parent's
    to read) when process ``pid``, not necessarily a child, exits (Linux pidfd)."""
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[int | None] = loop.create_future()
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        gone.set_result(None)
        return gone

    def on_exit() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(pidfd, on_exit)
    return gone
