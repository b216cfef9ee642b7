"""Running the gateway under uvicorn: one process that starts its engine (``serve``), or with
``--api-server-count N`` above 1, a supervising process, N front-end processes and one engine
process (``serve_many``; vLLM's API server count).

With N front-ends the supervisor binds the one listening socket, starts the engine process
with one pair of ipc sockets per front-end (``engine.launch``), and starts the front-ends
(multiprocessing's spawn: fresh interpreters, which import neither torch nor the kernels), each
with the socket and its ``EngineLink``. Every front-end accepts on the socket, so the kernel
hands each new connection to one of them. Without Redis the supervisor also keeps the one
in-process session store that every front-end reads (``chatgate.shared_store``).

They go down together: the supervisor stops the rest when any of them exits or when it is told
to stop (SIGTERM, SIGINT); the engine exits when its parent pipe closes and each front-end when
its parent's sentinel does, so a killed supervisor takes everything with it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette

from chatgate.front_end import FrontEnd
from chatgate.settings import Settings
from chatgate.shared_store import serve_store
from engine.client import configure_logging, logging_config
from engine.launch import engine_command, engine_environment, ipc_links

log = logging.getLogger("chatgate")

SHUTDOWN_TIMEOUT_S = 5.0  # uvicorn's graceful shutdown: then it cancels what still runs
STREAM_GRACE_S = 3.0  # for open streams to finish at shutdown, before the gateway ends them
STOP_TIMEOUT_S = 30.0  # for the front-ends, then for the engine, before they are killed
ENGINE_STOP_S = 5.0  # for the engine once the front-ends are gone, before its pipe closes


def serve(settings: Settings) -> int:
    """Run the gateway; the exit status (non-zero if it failed to start or its engine
    died)."""
    configure_logging(settings.log_level)
    log.info("chatgate starting on http://%s:%d", settings.host, settings.port)
    if settings.api_server_count > 1:
        return serve_many(settings)
    return _run(settings, None, None)


def _run(settings: Settings, front_end: FrontEnd | None, sock: socket.socket | None) -> int:
    # imported here, not at the top: the app imports the engine's client and transformers
    # (seconds, though no torch), which `chatgate hash-key`, `--help` and the supervisor of
    # several front-ends do not need
    from chatgate.app import create_app

    app = create_app(settings, front_end)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=logging_config(settings.log_level),  # uvicorn's lines in our format
        lifespan="on",
        # Frames a bit over the app's limit get an ``error`` event (socket open); only far
        # larger ones are cut by the protocol layer (close 1009).
        ws_max_size=max(4 * settings.ws_max_message_bytes, 1 << 20),
        timeout_graceful_shutdown=SHUTDOWN_TIMEOUT_S,
        access_log=settings.log_level == "debug",
    )
    server = _Server(config, app)
    # uvicorn shuts down in order on SIGTERM, then raises the signal again for the handler it
    # found when it started: this one, so that a clean shutdown exits with the status below
    # instead of dying by the signal
    signal.signal(signal.SIGTERM, _already_shut_down)
    try:
        server.run(sockets=None if sock is None else [sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C once it has shut down in order
        pass
    return 0 if server.started and not app.state.engine_failed else 1


class _Server(uvicorn.Server):
    """uvicorn's server, which at shutdown (it stops accepting, closes WebSockets with 1012,
    then waits for the open responses) ends the SSE streams still open after
    ``STREAM_GRACE_S`` itself, each with an in-band 503 error: uvicorn would cancel their tasks
    at ``SHUTDOWN_TIMEOUT_S``, logging an error and a traceback for each."""

    def __init__(self, config: uvicorn.Config, app: Starlette) -> None:
        super().__init__(config)
        self._app = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        gateway = getattr(self._app.state, "gateway", None)  # None if it never started
        timer = (None if gateway is None else
                 asyncio.get_running_loop().call_later(STREAM_GRACE_S, gateway.end_streams))
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def _already_shut_down(signum: int, frame: FrameType | None) -> None:
    """The SIGTERM that uvicorn raises again after its shutdown: nothing is left to do."""


def run_front_end(settings: Settings, front_end: FrontEnd, sock: socket.socket) -> None:
    """A front-end process's body (the target of its ``multiprocessing.Process``)."""
    configure_logging(settings.log_level)
    # before the app imports prometheus_client, which picks its value store at import
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = front_end.metrics_dir
    parent = multiprocessing.parent_process()
    assert parent is not None
    threading.Thread(target=_stop_with_parent, args=(parent.sentinel,), daemon=True,
                     name="parent-watch").start()
    raise SystemExit(_run(settings, front_end, sock))


def _stop_with_parent(sentinel: int) -> None:
    """Shut this process down (in order, as on SIGTERM) once its parent is gone."""
    multiprocessing.connection.wait([sentinel])
    log.warning("the supervising process is gone; this front-end stops")
    os.kill(os.getpid(), signal.SIGTERM)


class _Stop:
    """Set by SIGTERM or SIGINT in the supervisor."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


def serve_many(settings: Settings) -> int:
    """Supervise one engine process and ``settings.api_server_count`` front-ends on one
    socket until one of them exits or a signal says stop; the exit status is 0 only for a
    requested stop that every process completed cleanly."""
    count = settings.api_server_count
    sock = uvicorn.Config("chatgate.app:create_app", host=settings.host,
                          port=settings.port).bind_socket()
    ipc_dir = tempfile.mkdtemp(prefix="chatgate-engine-")
    parent_fd, parent_alive = os.pipe()  # the engine sees EOF when this process is gone
    try:
        engine = subprocess.Popen(
            engine_command(settings.engine, ipc_links(ipc_dir, count), parent_fd,
                           settings.log_level),
            pass_fds=(parent_fd,), env=engine_environment())
    finally:
        os.close(parent_fd)
    log.info("engine process started (pid %d); loading %s for %d front-end processes",
             engine.pid, settings.engine.model, count)
    links = [dataclasses.replace(link, engine_pid=engine.pid)
             for link in ipc_links(ipc_dir, count)]
    store_address, store_authkey = None, os.urandom(32)
    if settings.redis_url is None:
        store_address = f"{ipc_dir}/sessions"
        serve_store(store_address, store_authkey, settings.session_ttl)
    metrics_dir = f"{ipc_dir}/metrics"
    os.mkdir(metrics_dir)
    spawn = multiprocessing.get_context("spawn")
    front_ends = [spawn.Process(target=run_front_end, name=f"chatgate-api-{i}", args=(
        settings, FrontEnd(i, count, link, metrics_dir, store_address, store_authkey), sock))
                  for i, link in enumerate(links)]
    stop = _Stop()
    handlers = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for front_end in front_ends:
            front_end.start()
        engine_exit = os.pidfd_open(engine.pid)
        multiprocessing.connection.wait([p.sentinel for p in front_ends] + [engine_exit])
        os.close(engine_exit)
        if not stop.requested:
            log.error("a process of the gateway exited; stopping the others")
        return _stop_all(front_ends, engine, parent_alive, clean=stop.requested)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        sock.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _stop_all(front_ends: list[Any], engine: subprocess.Popen, parent_alive: int,
              clean: bool) -> int:
    """Stop the front-ends (SIGTERM: each shuts down in order and tells the engine it is
    done), then the engine (it stops once every front-end is done; if that takes over
    ``ENGINE_STOP_S``, closing its parent pipe makes it exit), killing what outlives
    ``STOP_TIMEOUT_S``; 0 if ``clean`` and every process exited with 0."""
    for front_end in front_ends:
        if front_end.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(front_end.pid, signal.SIGTERM)
    for front_end in front_ends:
        front_end.join(STOP_TIMEOUT_S)
        if front_end.is_alive():
            log.warning("front-end %s did not stop in %.0fs; killing it", front_end.name,
                        STOP_TIMEOUT_S)
            front_end.kill()
            front_end.join()
    try:
        engine.wait(ENGINE_STOP_S)
    except subprocess.TimeoutExpired:  # a front-end that died did not say it was done
        os.close(parent_alive)
        parent_alive = -1
        try:
            engine.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not stop; killing it")
            engine.kill()
            engine.wait()
    if parent_alive >= 0:
        os.close(parent_alive)
    codes = [p.exitcode for p in front_ends] + [engine.returncode]
    return 0 if clean and all(code == 0 for code in codes) else 1
