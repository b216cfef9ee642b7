"""The Starlette app factory. The engine is loaded in the lifespan (with progress logs), so the
server only accepts connections once the model is ready."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match, Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

from chatgate import completions_api, openai_api, sessions_api
from chatgate.errors import APIError, api_error_handler
from chatgate.front_end import FrontEnd
from chatgate.metrics import Metrics
from chatgate.middleware import RequestGuard
from chatgate.replica import ReplicaHeader
from chatgate.service import Gateway
from chatgate.sessions import SessionStore, is_store_error, make_store
from chatgate.settings import Settings
from chatgate.shared_store import SharedSessionStore
from chatgate.tenants import TenantRegistry
from chatgate.ws import ws_endpoint
from engine.client import AsyncEngine

log = logging.getLogger("chatgate")

ENGINE_DEATH_EXIT_S = 1.0  # after the engine process dies: streams are failed, then we exit


def static_dir() -> Path:
    """The browser UI's folder (it holds ``index.html``): the package data ``chatgate/static``
    of an installed wheel, else the source checkout's ``web/static`` that an editable install
    runs from (pyproject.toml builds the one from the other)."""
    installed = Path(str(resources.files("chatgate") / "static"))
    checkout = Path(__file__).resolve().parent.parent / "web" / "static"
    for folder in (installed, checkout):
        if (folder / "index.html").is_file():
            return folder
    raise FileNotFoundError(f"the browser UI is in neither {installed} nor {checkout}")


async def start_engine(settings: Settings, front_end: FrontEnd | None = None) -> AsyncEngine:
    """Start the engine process (or, as one of several front-ends, attach to the one the
    supervisor started) and wait until its model is loaded (its progress is logged)."""
    config = settings.engine
    log.info("%s the engine: model %r (device=%s, dtype=%s, block_size=%d)...",
             "starting" if front_end is None else "attaching to", config.model,
             config.device or "auto", config.dtype or "auto", config.block_size)
    t0 = time.perf_counter()
    engine = AsyncEngine(config, log_level=settings.log_level,
                         link=None if front_end is None else front_end.link,
                         stream_interval=settings.stream_interval)
    await engine.start()
    log.info("model %s loaded in %.1fs: max_model_len=%d", engine.model_name,
             time.perf_counter() - t0, engine.max_model_len)
    return engine


def _stats_dict(engine: AsyncEngine) -> dict[str, Any]:
    stats = engine.stats()
    return {**msgspec.structs.asdict(stats), "kv_cache_usage": stats.kv_cache_usage,
            "kv_waste": stats.kv_waste, "num_tokens_computed": stats.num_tokens_computed}


async def healthz(request: Request) -> Response:
    gw: Gateway | None = getattr(request.app.state, "gateway", None)
    if gw is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    if gw.engine.dead is not None:
        return JSONResponse({"status": "engine_dead", "error": gw.engine.dead},
                            status_code=503)
    try:
        store_ok = await asyncio.wait_for(gw.store.ping(), timeout=2.0)
    except Exception:  # noqa: BLE001
        store_ok = False
    body = {
        "status": "ok" if store_ok else "degraded",
        "model": gw.model_name,
        "max_model_len": gw.max_model_len,
        "session_store": type(gw.store).__name__,
        "session_store_ok": store_ok,
        "engine": _stats_dict(gw.engine),
    }
    return JSONResponse(body, status_code=200 if store_ok else 503)


async def metrics_endpoint(request: Request) -> Response:
    metrics: Metrics | None = getattr(request.app.state, "metrics", None)
    if metrics is None:
        return Response("", media_type=CONTENT_TYPE_LATEST)
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()


async def _store_error(request: Request, exc: Exception) -> Response:
    log.warning("session store error on %s: %s", request.url.path, exc)
    return APIError(503, f"The session store is unavailable: {exc}",
                    code="store_unavailable").response()


async def _server_error(request: Request, exc: Exception) -> Response:
    if is_store_error(exc):
        return await _store_error(request, exc)
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return APIError(500, f"Internal server error: {type(exc).__name__}",
                    code="internal_error").response()


def create_app(settings: Settings | None = None, front_end: FrontEnd | None = None) -> Starlette:
    """The ASGI app; its lifespan starts the engine process and stops it (as ``front_end``,
    one of several: attaches to the shared engine and detaches). If the engine process dies,
    open streams end with an error, /healthz answers 503, and the server shuts down
    (``app.state.engine_failed`` tells the CLI to exit non-zero)."""
    settings = settings or Settings()
    if settings.placeholder_secret:
        log.warning("INSECURE: the server secret is the public placeholder %r; set "
                    "CHATGATE_SECRET (or --server-secret) to a long random value, e.g. "
                    "`openssl rand -hex 32` (with --tenants the gateway refuses to start)",
                    settings.server_secret)
    tenants = TenantRegistry.load(settings.tenants_file, settings.server_secret)
    app = Starlette(
        routes=_routes(),
        middleware=_middleware(settings, front_end),
        lifespan=functools.partial(_lifespan, settings=settings, tenants=tenants,
                                   front_end=front_end),
        exception_handlers={
            APIError: api_error_handler,
            HTTPException: _http_exception,
            RedisError: _store_error,
            Exception: _server_error,
        },
    )
    app.state.settings = settings
    app.state.engine_failed = False
    app.state.gateway = None
    app.state.metrics = None
    app.state.tenants = tenants
    return app


class _UIMount(Mount):
    """The browser UI at ``/``, for every path that no API route serves. A path an API route
    serves with other methods is left to the router, which answers 405 with ``Allow``
    (Starlette's router takes a method mismatch only when no route matches fully)."""

    def __init__(self, api_routes: list[BaseRoute]) -> None:
        super().__init__("/", app=StaticFiles(directory=static_dir(), html=True), name="ui")
        self.api_routes = api_routes

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if any(route.matches(scope)[0] is not Match.NONE for route in self.api_routes):
            return Match.NONE, {}
        return super().matches(scope)


def _routes() -> list[BaseRoute]:
    """The API routes, then the browser UI."""
    api: list[BaseRoute] = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        *openai_api.routes,
        *completions_api.routes,
        *sessions_api.routes,
        WebSocketRoute("/v1/ws", ws_endpoint),
    ]
    return [*api, _UIMount(api)]


def _middleware(settings: Settings, front_end: FrontEnd | None) -> list[Middleware]:
    """Outermost first: the replica header on every response (with the front-end's index
    when there are several), CORS when origins are allowed, then the request guard (origins,
    body size and time, slow readers)."""
    middleware = [Middleware(ReplicaHeader, replica_id=settings.replica_id,
                             api_server=None if front_end is None else front_end.index)]
    if settings.allowed_origins:
        middleware.append(Middleware(
            CORSMiddleware, allow_origins=settings.allowed_origins,
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Session-Id"],
            expose_headers=["X-Chatgate-Replica"], max_age=600))
    middleware.append(Middleware(RequestGuard, allowed_origins=settings.allowed_origins,
                                 max_bytes=settings.max_request_bytes,
                                 body_timeout=settings.body_timeout,
                                 send_timeout=settings.send_timeout))
    return middleware


async def _open_store(settings: Settings, front_end: FrontEnd | None) -> SessionStore:
    """The session store, reachable (checked before the slow model load), else RuntimeError:
    Redis, the in-process store, or as one of several front-ends without Redis, the
    supervisor's."""
    if front_end is not None and front_end.store_address is not None:
        store: SessionStore = SharedSessionStore(front_end.store_address,
                                                 front_end.store_authkey, settings.session_ttl)
    else:
        store = make_store(settings.redis_url, settings.session_ttl, settings.redis_prefix)
    try:
        await store.ping()
    except Exception as e:
        with contextlib.suppress(Exception):
            await store.close()
        raise RuntimeError(f"session store unreachable ({settings.redis_url}): {e}") from e
    return store


def _on_engine_death(app: Starlette, reason: str) -> None:
    app.state.engine_failed = True
    log.error("shutting down in %.0fs: %s", ENGINE_DEATH_EXIT_S, reason)
    asyncio.get_running_loop().call_later(ENGINE_DEATH_EXIT_S, os.kill, os.getpid(),
                                          signal.SIGTERM)


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette, settings: Settings, tenants: TenantRegistry,
                    front_end: FrontEnd | None) -> AsyncIterator[None]:
    """Session store, engine process and gateway up before the first request; down after.
    Of several front-ends, the first warms the tenants' system prompts."""
    store = await _open_store(settings, front_end)
    try:
        eng = await start_engine(settings, front_end)
    except BaseException:
        with contextlib.suppress(Exception):
            await store.close()
        raise
    eng.on_death.append(functools.partial(_on_engine_death, app))
    log.info("session store: %s%s", type(store).__name__,
             f" at {settings.redis_url}" if settings.redis_url else
             " (in-process)" if front_end is None else " (the supervisor's, in-process)")
    metrics = Metrics(settings.served_model_name or eng.model_name, settings.replica_id,
                      None if front_end is None else front_end.metrics_dir)
    metrics.attach_engine(eng.stats)
    gw = Gateway(settings, eng, tenants, store, metrics)
    defaults = ", ".join(f"{k}={v}" for k, v in gw.sampling_defaults.items())
    log.info("a request's unset sampling fields take %s (--generation-config %s)",
             f"the model's {defaults}" if defaults else "vLLM's defaults",
             settings.generation_config)
    try:
        if front_end is None or front_end.index == 0:
            await gw.warm_tenants()
        gw.start_background()
        app.state.metrics = metrics
        app.state.gateway = gw
        log.info("tenants: %s%s", ", ".join(tenants.tenants),
                 " (open: no API key needed)" if tenants.open_mode else "")
        log.info("chatgate ready: model %s", gw.model_name)
        # What is alive now lives as long as the server (tokenizer, modules, app): keep it out
        # of the collector's full passes, which would stall the event loop for 100+ ms (vLLM's
        # API server does the same).
        gc.collect()
        gc.freeze()
        yield
    finally:
        gc.unfreeze()  # for the collection at exit (see engine.core.main)
        app.state.gateway = None
        await gw.stop_background()
        with contextlib.suppress(Exception):
            await store.close()
        await eng.shutdown()
