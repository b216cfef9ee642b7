"""Tool calling for chat completions: the tools put into the prompt, the grammar a forced call
is decoded under, and the calls parsed back out of the output.

The prompt form is Hermes' (what Qwen2.5's chat template writes): the tools as JSON inside
``<tools></tools>`` in the system prompt, each call the model makes as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, each tool result sent back as a
user turn inside ``<tool_response></tool_response>``. It works with any chat template, SmolLM2's
included (which has no tool support of its own); a template that renders ``tools`` itself gets
them, and the calls and tool messages, in transformers' format instead. Either way the calls
are parsed from the Hermes form.

``tool_choice``: ``none`` leaves the tools out of the prompt; ``auto`` lets the model choose and
parses any ``<tool_call>`` blocks it writes; ``required`` and a named function constrain the
decoding (xgrammar) to a JSON array of calls of the given tools, or to the named function's
arguments, so the call is always well formed and its arguments always match the schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.client import StructuredOutput

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call as an assistant message of the request carries it."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text

    def openai(self, index: int) -> dict[str, Any]:
        """The call as an OpenAI ``tool_calls`` entry (a stream delta carries the same)."""
        return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def system_prompt(tools: list[ToolDefinition]) -> str:
    """The system-prompt text that offers ``tools`` to the model."""
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False)
                       for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")


def call_text(calls: list[ToolCall]) -> str:
    """An assistant message's calls, as the model would have written them."""
    return "\n".join(
        f'{CALL_OPEN}\n{{"name": {json.dumps(c.function.name)}, "arguments": '
        f"{c.function.arguments or '{}'}}}\n{CALL_CLOSE}" for c in calls)


def arguments_object(arguments: str) -> Any:
    """A call's JSON arguments as an object, for a template that writes them itself (the
    text as it is if it is not JSON)."""
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments


def response_text(content: str) -> str:
    """A tool result, as the user turn that brings it back."""
    return f"<tool_response>\n{content}\n</tool_response>"


def grammar(tools: list[ToolDefinition], choice: ToolChoice, parallel: bool
            ) -> StructuredOutput | None:
    """What a forced call is decoded under: the named function's arguments, or (``required``)
    an array of calls of the tools, one call only unless ``parallel``; None otherwise."""
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return StructuredOutput(json_schema=json.dumps(tool.function.parameters))
    if choice != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"enum": [t.function.name]},
                             "arguments": t.function.parameters},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput(json_schema=json.dumps(schema))


def parse_forced(text: str, choice: ToolChoice) -> list[ParsedCall]:
    """The calls of an output decoded under :func:`grammar` (empty if it was cut short)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if isinstance(choice, NamedToolChoice):
        return [ParsedCall(choice.function.name, json.dumps(value, ensure_ascii=False))]
    return [ParsedCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
            for c in value]


def parse_auto(text: str, names: set[str]) -> tuple[str | None, list[ParsedCall]]:
    """``<tool_call>`` blocks of known tools with a JSON object inside, parsed out of free
    text: (the rest of the text, or None if nothing else is left; the calls). A block that
    does not parse stays in the text."""
    calls: list[ParsedCall] = []
    rest: list[str] = []
    last = 0
    for match in _CALL_BLOCK.finditer(text):
        try:
            call = json.loads(match.group(1))
            ok = (isinstance(call, dict) and call.get("name") in names
                  and isinstance(call.get("arguments", {}), dict))
        except ValueError:
            ok = False
        if not ok:
            continue
        rest.append(text[last:match.start()])
        last = match.end()
        calls.append(ParsedCall(call["name"],
                                json.dumps(call.get("arguments", {}), ensure_ascii=False)))
    rest.append(text[last:])
    remaining = "".join(rest).strip()
    return (remaining or None) if calls else text, calls


def may_start_call(text: str) -> bool:
    """Whether streamed text could still turn out to be a ``<tool_call>`` block (so an
    ``auto`` stream holds it back)."""
    head = text.lstrip()
    return CALL_OPEN.startswith(head) or head.startswith(CALL_OPEN)


@dataclass
class CallParser:
    """Reads one request's outputs for tool calls, as its ``tool_choice`` says to."""

    tools: list[ToolDefinition]
    choice: ToolChoice
    parallel: bool

    @property
    def forced(self) -> bool:
        """Whether the output is decoded under :meth:`grammar` (a call, not free text)."""
        return self.choice == "required" or isinstance(self.choice, NamedToolChoice)

    def grammar(self) -> StructuredOutput | None:
        """What a forced call is decoded under (see :func:`grammar`); None when not forced."""
        return grammar(self.tools, self.choice, self.parallel)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(the content left, the calls) of one finished output."""
        if self.forced:
            calls = parse_forced(text, self.choice)
            return (None if calls else text), calls
        return parse_auto(text, {t.function.name for t in self.tools})
