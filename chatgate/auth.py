"""Bearer authentication for HTTP requests (WebSocket auth lives in ``ws.py``)."""

from __future__ import annotations

from starlette.requests import HTTPConnection

from chatgate.errors import APIError
from chatgate.tenants import Tenant, TenantRegistry


def bearer_token(conn: HTTPConnection) -> str | None:
    value = conn.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def authenticate(conn: HTTPConnection, tenants: TenantRegistry) -> Tenant:
    tenant = tenants.authenticate(bearer_token(conn))
    if tenant is None:
        raise APIError(
            401,
            "Incorrect API key provided. Pass a valid key as 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            type="invalid_request_error",
        )
    return tenant
