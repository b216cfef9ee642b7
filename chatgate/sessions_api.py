"""Sessions REST: list, read history, delete (which also releases the engine pin)."""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatgate.auth import authenticate
from chatgate.errors import APIError
from chatgate.openai_api import gateway
from chatgate.openai_models import SESSION_ID_PATTERN
from chatgate.session_ids import HEADER, agreed_session_id

_SID_RE = re.compile(SESSION_ID_PATTERN)


def _session_id(request: Request) -> str:
    """The session of the URL path; an ``X-Session-Id`` header must name the same one."""
    sid = request.path_params["session_id"]
    if not _SID_RE.match(sid):
        raise APIError(404, f"No session '{sid[:128]}'.", code="session_not_found")
    agreed_session_id({"URL path": sid, f"{HEADER} header": request.headers.get(HEADER)})
    return sid


def _scope(request: Request) -> str | None:
    """The ``scope`` query parameter: list only the sessions created with that label."""
    scope = request.query_params.get("scope")
    if scope is not None and not _SID_RE.match(scope):
        raise APIError(400, f"'scope' must match {SESSION_ID_PATTERN}.", param="scope",
                       code="invalid_value")
    return scope


async def list_sessions(request: Request) -> Response:
    gw = gateway(request)
    tenant = authenticate(request, gw.tenants)
    records = await gw.store.list(tenant.id, _scope(request))
    return JSONResponse({"object": "list", "data": [r.summary() for r in records]})


async def get_session(request: Request) -> Response:
    gw = gateway(request)
    tenant = authenticate(request, gw.tenants)
    sid = _session_id(request)
    rec = await gw.store.get(tenant.id, sid)
    if rec is None:
        raise APIError(404, f"No session '{sid}'.", code="session_not_found")
    return JSONResponse(rec.detail())


async def delete_session(request: Request) -> Response:
    gw = gateway(request)
    tenant = authenticate(request, gw.tenants)
    sid = _session_id(request)
    existed = await gw.store.delete(tenant.id, sid)
    released = await gw.unpin_session(gw.tenants.engine_session_id(tenant, sid))
    if not existed and not released:
        raise APIError(404, f"No session '{sid}'.", code="session_not_found")
    return JSONResponse({"id": sid, "deleted": True})


async def session(request: Request) -> Response:
    """``/v1/sessions/{id}``: one route for both methods, so a wrong one is a 405 naming both."""
    if request.method == "DELETE":
        return await delete_session(request)
    return await get_session(request)


routes = [
    Route("/v1/sessions", list_sessions, methods=["GET"]),
    Route("/v1/sessions/{session_id}", session, methods=["GET", "DELETE"]),
]
