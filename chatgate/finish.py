"""How the engine's finish reasons read in the OpenAI-style HTTP APIs: OpenAI's own values
only (clients with a closed set refuse others), the repetition guard's end named in an extra
field."""

from __future__ import annotations

from typing import Any

REPETITION = "repetition"  # the engine's reason for an answer its repetition guard ended


def openai_finish_reason(reason: str | None) -> str | None:
    """``length`` for an answer cut short (``max_tokens``, the context window, a loop),
    ``stop`` for any other end; None while it goes on."""
    if reason is None:
        return None
    return "length" if reason in ("length", REPETITION) else "stop"


def with_finish_detail(choice: dict[str, Any], reason: str | None) -> dict[str, Any]:
    """``choice`` with ``finish_detail: "repetition"`` when the repetition guard ended it."""
    if reason == REPETITION:
        choice["finish_detail"] = REPETITION
    return choice
