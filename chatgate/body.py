"""The one JSON parser for HTTP request bodies and WebSocket frames.

Strict JSON (no NaN, no trailing data), valid Unicode (malformed UTF-8 and lone UTF-16
surrogates such as ``"\\ud800"`` are refused, not replaced: the tokenizer cannot encode them),
at most ``MAX_JSON_DEPTH`` levels of nested objects and arrays, and no number beyond a double's
range (``1e400``). Every refusal is a 400 ``APIError`` with its own code; the size limit is
enforced before parsing (``middleware`` for HTTP, the frame limit for WebSocket).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from chatgate.errors import APIError

MAX_JSON_DEPTH = 32  # a chat request needs 4 (body, messages, message, content part)

_decode = msgspec.json.Decoder().decode


def too_deep() -> APIError:
    return APIError(400, f"The JSON is nested more than {MAX_JSON_DEPTH} levels deep.",
                    code="json_too_deep")


def invalid_unicode(detail: str) -> APIError:
    return APIError(400, f"The request is not valid Unicode: {detail}.", code="invalid_unicode")


def parse_json(data: bytes | str) -> Any:
    """The JSON value of ``data``; a 400 ``APIError`` (``invalid_json``, ``invalid_unicode``,
    ``json_too_deep``) if it is not acceptable."""
    try:
        value = _decode(data)
    except RecursionError:
        raise too_deep() from None
    except msgspec.ValidationError:  # valid JSON holding a number no double can hold
        raise APIError(400, "A number in the JSON is beyond a double's range.",
                       code="invalid_value") from None
    except msgspec.DecodeError as e:
        raise _diagnose(data, e) from None
    if _nested_deeper_than(value, MAX_JSON_DEPTH):
        raise too_deep()
    return value


def _diagnose(data: bytes | str, error: msgspec.DecodeError) -> APIError:
    """Name what msgspec refused: it reports a lone surrogate as truncated input, so the
    stdlib parser (which accepts lone surrogates, and here nothing else msgspec refuses) tells
    that case apart."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            return invalid_unicode("malformed UTF-8")
    try:
        json.loads(data, parse_constant=_refuse_constant)
    except RecursionError:
        return too_deep()
    except ValueError:
        return APIError(400, f"We could not parse the JSON: {error}", code="invalid_json")
    return invalid_unicode("a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair)")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _nested_deeper_than(value: Any, limit: int) -> bool:
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False
