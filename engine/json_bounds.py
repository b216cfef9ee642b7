"""Default bounds on a JSON Schema's strings, numbers and arrays, so that grammar-constrained
output cannot grow a value without end (a weak model fills ``max_tokens`` with ``1111…``, a
runaway string or the same array item again and again, and the JSON is cut unfinished). Only
what the schema leaves open is bounded: its own ``maxLength``, ``maximum``, ``minimum``,
``maxItems``, ``pattern``, ``format``, ``enum`` and ``const`` stand."""

from __future__ import annotations

import json
from typing import Any

MAX_STRING_LENGTH = 64  # characters of a string without maxLength
MAX_DIGITS = 15  # digits before the point of an integer/number without its own range
MAX_ITEMS = 8  # items of an array without maxItems
_LIMIT = 10**MAX_DIGITS - 1
# keywords whose values are data, not schemas: left as they are
_DATA = frozenset({"enum", "const", "default", "examples"})


def bounded_schema(schema: str) -> str:
    """``schema`` (serialized JSON Schema) with the default bounds added where it has none."""
    return json.dumps(_bound(json.loads(schema)))


def _bound(node: Any) -> Any:
    if isinstance(node, list):
        return [_bound(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA else _bound(v) for k, v in node.items()}
    types = _types(out)
    if "string" in types and not {"maxLength", "pattern", "format", "enum", "const"} & out.keys():
        out["maxLength"] = max(MAX_STRING_LENGTH, out.get("minLength", 0))
    if types & {"integer", "number"} and not {"enum", "const"} & out.keys():
        if not {"maximum", "exclusiveMaximum"} & out.keys():
            out["maximum"] = max(_LIMIT, out.get("minimum", out.get("exclusiveMinimum", 0)))
        if not {"minimum", "exclusiveMinimum"} & out.keys():
            out["minimum"] = min(-_LIMIT, out.get("maximum", out.get("exclusiveMaximum", 0)))
    if "array" in types and "maxItems" not in out:
        out["maxItems"] = max(MAX_ITEMS, out.get("minItems", 0), len(out.get("prefixItems", ())))
    return out


def _types(node: dict[str, Any]) -> set[str]:
    """The names in a schema's ``type`` (none where it has no such keyword)."""
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()
