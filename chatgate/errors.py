"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error that maps to one HTTP status and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,  # noqa: A002 - OpenAI's field name
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_validation_error(exc: ValidationError) -> APIError:
    """The most specific pydantic error (the first of those located deepest: for a union,
    the branch that came closest) as a 400 naming the offending parameter."""
    errors = exc.errors(include_url=False)
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
    # Drop pydantic's union-branch tags (e.g. "str", "list[...]") from the location.
    loc = [p for p in loc if not (p.startswith(("list[", "function-")) or p in ("str", "int"))]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    message = f"{param}: {msg}" if param else msg
    code = "invalid_value" if err.get("type") != "missing" else "missing_required_parameter"
    return APIError(400, message, param=param, code=code)


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


def http_exception_response(status: int, detail: str) -> JSONResponse:
    return APIError(status, detail, code=None).response()
