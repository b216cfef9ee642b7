"""The Starlette app factory. The engine is loaded in the lifespan (with progress logs), so the
server only accepts connections once the model is ready."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from chatgate import openai_api, sessions_api
from chatgate.errors import APIError, api_error_handler
from chatgate.metrics import Metrics
from chatgate.middleware import BodySizeLimit, RequestTooLarge, too_large_handler
from chatgate.service import Gateway
from chatgate.sessions import is_store_error, make_store
from chatgate.settings import Settings
from chatgate.tenants import TenantRegistry
from chatgate.ws import ws_endpoint

log = logging.getLogger("chatgate")


def static_dir() -> Path | None:
    """The browser UI: ``chatgate/static`` (package data, also in a source checkout), else a
    top-level ``web/`` folder next to the package in a source checkout."""
    with contextlib.suppress(Exception):
        p = Path(str(resources.files("chatgate") / "static"))
        if (p / "index.html").is_file():
            return p
    p = Path(__file__).resolve().parent.parent / "web"
    if (p / "index.html").is_file():
        return p
    return None


def load_engine(settings: Settings) -> Any:
    """Build the engine (blocking: loads weights, sizes the KV cache)."""
    from engine import AsyncEngine, EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    kw = {k: v for k, v in settings.engine.engine_kwargs().items() if k in fields}
    ignored = sorted(k for k, v in settings.engine.engine_kwargs().items()
                     if k not in fields and v is not None)
    if ignored:
        log.warning("engine does not know %s; ignored", ", ".join(ignored))
    log.info("loading model %r (device=%s, dtype=%s, block_size=%d)...", kw.get("model"),
             kw.get("device") or "auto", kw.get("dtype") or "auto", kw.get("block_size", 16))
    t0 = time.perf_counter()
    engine = AsyncEngine(EngineConfig(**kw))
    log.info("model %s loaded in %.1fs: max_model_len=%d", getattr(engine, "model_name", "?"),
             time.perf_counter() - t0, engine.max_model_len)
    return engine


def _stats_dict(engine: Any) -> dict[str, Any]:
    try:
        s = engine.stats()
    except Exception:  # noqa: BLE001
        return {}
    if dataclasses.is_dataclass(s):
        d = dataclasses.asdict(s)
        for prop in ("kv_cache_usage", "kv_waste", "num_tokens_computed"):
            with contextlib.suppress(Exception):
                d[prop] = getattr(s, prop)
        return d
    if isinstance(s, dict):
        return dict(s)
    return {k: v for k, v in vars(s).items() if not k.startswith("_")}


async def healthz(request: Request) -> Response:
    gw: Gateway | None = getattr(request.app.state, "gateway", None)
    if gw is None:
        return JSONResponse({"status": "loading"}, status_code=503)
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


async def _index(request: Request) -> Response:
    return JSONResponse({"name": "chatgate", "endpoints": [
        "/v1/models", "/v1/chat/completions", "/v1/ws", "/v1/sessions", "/metrics", "/healthz"]})


def create_app(settings: Settings | None = None, engine: Any = None) -> Starlette:
    """The ASGI app. ``engine``: an already-built engine (else loaded at start-up)."""
    settings = settings or Settings()
    tenants = TenantRegistry.load(settings.tenants_file, settings.server_secret)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        from engine import SamplingParams

        store = make_store(settings.redis_url, settings.session_ttl, settings.redis_prefix)
        try:  # fail fast, before the (slow) model load
            await store.ping()
        except Exception as e:
            with contextlib.suppress(Exception):
                await store.close()
            raise RuntimeError(f"session store unreachable ({settings.redis_url}): {e}") from e
        eng = engine if engine is not None else await asyncio.to_thread(load_engine, settings)
        await eng.start()
        log.info("session store: %s%s", type(store).__name__,
                 f" at {settings.redis_url}" if settings.redis_url else " (in-process)")
        metrics = Metrics(settings.served_model_name or eng.model_name)
        metrics.attach_engine(eng.stats)
        gw = Gateway(settings, eng, tenants, store, metrics)
        await gw.warm_tenants(SamplingParams)
        gw.start_background()
        app.state.metrics = metrics
        app.state.gateway = gw
        log.info("tenants: %s%s", ", ".join(tenants.tenants),
                 " (open: no API key needed)" if tenants.open_mode else "")
        log.info("chatgate ready: model %s", gw.model_name)
        try:
            yield
        finally:
            app.state.gateway = None
            await gw.stop_background()
            with contextlib.suppress(Exception):
                await store.close()
            with contextlib.suppress(Exception):
                await eng.shutdown()

    routes: list[Any] = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        *openai_api.routes,
        *sessions_api.routes,
        WebSocketRoute("/v1/ws", ws_endpoint),
    ]
    ui = static_dir()
    if ui is not None:
        routes.append(Mount("/", app=StaticFiles(directory=str(ui), html=True), name="ui"))
    else:
        routes.append(Route("/", _index, methods=["GET"]))

    middleware = [Middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)]
    if settings.allowed_origins:
        middleware.insert(0, Middleware(
            CORSMiddleware, allow_origins=settings.allowed_origins,
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"], max_age=600))

    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={
            APIError: api_error_handler,
            RequestTooLarge: too_large_handler,
            HTTPException: _http_exception,
            RedisError: _store_error,
            Exception: _server_error,
        },
    )
    app.state.settings = settings
    app.state.gateway = None
    app.state.metrics = None
    app.state.tenants = tenants
    return app
