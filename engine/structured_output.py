"""What a request's structured output must be: the specification a client sends, checked when
made; ``engine.structured`` compiles it into a grammar. Plain data: no torch, no xgrammar."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must be: any JSON object (``json_object``), or JSON matching
    ``json_schema`` (a JSON Schema, serialized)."""

    json_schema: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if (self.json_schema is None) == (not self.json_object):
            raise ValueError("structured output needs exactly one of json_schema, json_object")
        if self.json_schema is not None:
            try:
                json.loads(self.json_schema)
            except ValueError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None

    @property
    def schema(self) -> str:
        """The JSON Schema to compile (any object for ``json_object``)."""
        return self.json_schema if self.json_schema is not None else '{"type": "object"}'
