"""OpenAI chat-completions request models (pydantic), with the ``top_k`` and ``session_id``
extensions. Validation errors become 400s naming the parameter."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from chatgate import tools
from chatgate.tools import NamedToolChoice, ToolCall, ToolChoice, ToolDefinition
from engine.client import StructuredOutput

SESSION_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,128}$"

# Every integer of a request is a signed 64-bit one (what the engine's IPC carries); fields with
# a narrower range say so where they are declared.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message. ``developer`` is treated as ``system``; content may be a string or a
    list of text parts (what the SDK sends for structured content). An assistant message may
    carry ``tool_calls`` instead of content; a ``tool`` message answers one of them."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for role '{self.role}'")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def as_template_message(self, native_tools: bool = False) -> dict[str, Any]:
        """The message as the chat template takes it. ``native_tools``: for a template that
        renders tool calls and ``tool`` messages itself (transformers' format: arguments as an
        object); otherwise tool calls are written out and tool results come back as user turns
        (``chatgate.tools``' prompt form)."""
        role = "system" if self.role == "developer" else self.role
        text = self.text()
        if native_tools:
            message: dict[str, Any] = {"role": role, "content": text}
            if self.tool_call_id is not None:
                message["tool_call_id"] = self.tool_call_id
            if self.tool_calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name,
                                  "arguments": tools.arguments_object(c.function.arguments)}}
                    for c in self.tool_calls]
            return message
        if self.role == "tool":
            return {"role": "user", "content": tools.response_text(text)}
        if self.tool_calls:
            text = "\n".join(t for t in (text, tools.call_text(self.tool_calls)) if t)
        return {"role": role, "content": text}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool | None = False


# OpenAI chat-completion fields with no implementation here (a 400 names them).
UNIMPLEMENTED_FIELDS = ("functions", "function_call", "prediction", "audio", "modalities",
                        "web_search_options", "reasoning_effort")


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """``text`` (the default), ``json_object`` (any JSON object) or ``json_schema``: the
    latter two through grammar-constrained decoding."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self

    def structured(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput(json_object=True)
        if self.type == "json_schema":
            assert self.json_schema is not None
            return StructuredOutput(json_schema=json.dumps(self.json_schema.schema_ or {}))
        return None


class SamplingFields(BaseModel):
    """The sampling fields chat completions, text completions and WebSocket ``params`` share;
    :meth:`sampling` gives them to ``Turn.prepare``."""

    stop: str | list[str] | None = None
    seed: Int64 | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int64 | None = Field(default=None, ge=-1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    logit_bias: dict[Int64, float] | None = None
    min_tokens: Int64 | None = Field(default=None, ge=0)
    ignore_eos: StrictBool | None = False
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is not None and any(not -100.0 <= b <= 100.0 for b in v.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return v

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for ``Turn.prepare`` (None: the engine's default)."""
        return {
            "stop": self.stop, "seed": self.seed, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "ignore_eos": self.ignore_eos,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "logit_bias": self.logit_bias,
            "min_tokens": self.min_tokens,
            "structured": self.response_format.structured() if self.response_format else None,
        }


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. Unknown fields are accepted and ignored (as vLLM does;
    ``cache_salt`` on purpose: the salt is the server's), but the OpenAI fields this server
    does not implement (``UNIMPLEMENTED_FIELDS``) are refused by name rather than silently
    dropped."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1, le=16)
    max_tokens: Int64 | None = Field(default=None, ge=1)
    max_completion_tokens: Int64 | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    user: str | None = None
    session_id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = True

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct function names")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, "
                             "which is not in tools")
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("tool_choice 'required' or a named function cannot be combined "
                             "with a JSON response_format")
        return self

    def effective_tool_choice(self) -> ToolChoice:
        """``tool_choice`` as given, else ``auto`` with tools and ``none`` without (OpenAI's
        defaults)."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def offers_tools(self) -> bool:
        return bool(self.tools) and self.effective_tool_choice() != "none"

    def call_parser(self) -> tools.CallParser | None:
        """What reads this request's outputs for tool calls, when it offers tools."""
        if not self.offers_tools():
            return None
        assert self.tools is not None
        return tools.CallParser(self.tools, self.effective_tool_choice(),
                                self.parallel_tool_calls is not False)

    def template_messages(self, native_tools: bool) -> list[dict[str, Any]]:
        """The messages for the chat template. The tools are offered (unless ``tool_choice``
        is ``none``) by the template itself when ``native_tools`` (see
        :meth:`template_tools`), else in the system prompt."""
        messages = [m.as_template_message(native_tools) for m in self.messages]
        if native_tools or not self.offers_tools():
            return messages
        assert self.tools is not None
        offer = tools.system_prompt(self.tools)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{offer}"}
        else:
            messages.insert(0, {"role": "system", "content": offer})
        return messages

    def template_tools(self, native_tools: bool) -> list[dict[str, Any]] | None:
        """The tools for a template that renders them, when they are offered."""
        if not native_tools or not self.offers_tools():
            return None
        assert self.tools is not None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def unimplemented_field(self) -> str | None:
        """The first OpenAI field set in this request that this server does not implement."""
        extra = self.model_extra or {}
        return next((name for name in UNIMPLEMENTED_FIELDS if extra.get(name) is not None), None)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    """``POST /v1/completions`` (OpenAI's legacy text completions): a prompt as text, token
    ids, or a list of either (one choice group per prompt). ``echo``, ``suffix``, ``logprobs``
    and a ``best_of`` other than ``n`` are refused by name (not implemented)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str
    prompt: str | list[Int64] | list[str] | list[list[Int64]] = Field(min_length=1)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1, le=16)
    best_of: int | None = Field(default=None, ge=1, le=16)
    max_tokens: Int64 | None = Field(default=16, ge=1)
    echo: StrictBool | None = False
    suffix: str | None = None
    logprobs: int | None = None
    user: str | None = None

    def unimplemented_field(self) -> str | None:
        if self.echo:
            return "echo"
        if self.suffix is not None:
            return "suffix"
        if self.logprobs is not None:
            return "logprobs"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class WSParams(SamplingFields):
    """``params`` of a WebSocket ``message``/``regenerate`` event."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: Int64 | None = Field(default=None, ge=1)


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(exclude_none=True)
