"""Where a request names its chat session.

A session id may come in the ``X-Session-Id`` header (HTTP requests and WebSocket handshakes:
what a load balancer hashes on to keep a session on the replica that pins it), the ``session``
query parameter (WebSocket URLs: browsers cannot set handshake headers), a session URL path,
or the body (``session_id`` of a chat completion or of a WebSocket event). A request may name
it in several places; they must then agree."""

from __future__ import annotations

import re

from chatgate.errors import APIError
from chatgate.openai_models import SESSION_ID_PATTERN

HEADER = "X-Session-Id"
QUERY_PARAM = "session"

_SID_RE = re.compile(SESSION_ID_PATTERN)


def agreed_session_id(named: dict[str, str | None]) -> str | None:
    """The session id that the places in ``named`` (where → value, None where absent) name,
    or None if none does. 400 ``invalid_session_id`` for a malformed one, 400
    ``session_id_mismatch`` if two places name different sessions."""
    found: dict[str, str] = {}
    for where, value in named.items():
        if value is None:
            continue
        if not _SID_RE.match(value):
            raise APIError(400, f"The {where} is not a session id: 1-128 characters of "
                           "A-Z a-z 0-9 _ . - expected.", param="session_id",
                           code="invalid_session_id")
        found[where] = value
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{where} {value!r}" for where, value in found.items())
        raise APIError(400, f"The request names different sessions: {listed}.",
                       param="session_id", code="session_id_mismatch")
    return next(iter(found.values()), None)
