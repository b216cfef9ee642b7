"""OpenAI-compatible HTTP API: ``GET /v1/models`` and ``POST /v1/chat/completions`` (JSON and
SSE). Chunks and bodies follow what the official ``openai`` SDK parses.

SSE goes out through Starlette's ``StreamingResponse`` as ready-framed ``data: ...\n\n``
events encoded by msgspec: per token that costs the gateway less CPU than sse-starlette's
per-event cancel scope and per-response tasks (docs/performance.md has the measurement)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from chatgate.auth import authenticate
from chatgate.body import parse_json
from chatgate.errors import APIError, from_validation_error
from chatgate.finish import openai_finish_reason, with_finish_detail
from chatgate.openai_models import ChatCompletionRequest, CompletionRequest
from chatgate.service import Gateway
from chatgate.session_ids import HEADER, agreed_session_id
from chatgate.tools import CallParser, may_start_call
from chatgate.turn import Turn
from engine.client import RequestOutput, TokenLogprob, merge_outputs, supports_tools

log = logging.getLogger("chatgate")


def gateway(request: Request) -> Gateway:
    gw = getattr(request.app.state, "gateway", None)
    if gw is None:
        raise APIError(503, "The engine is still loading; retry shortly.", code="not_ready")
    return gw


Req = TypeVar("Req", ChatCompletionRequest, CompletionRequest)


def parse_request(model: type[Req], raw: bytes, gw: Gateway) -> Req:
    """The body as ``model``: 400 for bad JSON or fields, for an OpenAI field this server
    does not implement (named), 404 for a model it does not serve."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    unimplemented = req.unimplemented_field()
    if unimplemented is not None:
        raise APIError(400, f"{unimplemented} is not supported by this server.",
                       param=unimplemented, code="unsupported_parameter")
    if not gw.accepts_model(req.model):
        raise APIError(404, f"The model `{req.model}` does not exist.", param="model",
                       code="model_not_found")
    return req


async def list_models(request: Request) -> Response:
    gw = gateway(request)
    authenticate(request, gw.tenants)
    return JSONResponse({
        "object": "list",
        "data": [{
            "id": gw.model_name,
            "object": "model",
            "created": gw.created,
            "owned_by": "chatgate",
            "root": gw.engine_model_name,
            "parent": None,
            "max_model_len": gw.max_model_len,
            "default_max_tokens": gw.settings.max_tokens,
        }],
    })


def _finish_reason(reason: str | None, called: bool = False) -> str | None:
    if reason is None:
        return None
    if called:
        return "tool_calls"
    return openai_finish_reason(reason)


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-level BPE alphabet (printable stand-ins for the 256 bytes)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _byte_decoder()


class _Logprobs:
    """Turns engine ``TokenLogprob``s into OpenAI ``logprobs.content`` entries: ``bytes`` are
    the token's raw bytes (a token may hold part of a UTF-8 character)."""

    def __init__(self, tokenizer: Any, top_n: int) -> None:
        self.tok = tokenizer
        self.top_n = top_n
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        raw: bytes | None = None
        try:
            piece = self.tok.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(ch in _BYTE_DECODER for ch in piece):
                raw = bytes(_BYTE_DECODER[ch] for ch in piece)
        except Exception:  # noqa: BLE001 - not a byte-level BPE tokenizer
            raw = None
        if raw is None:
            raw = self.tok.decode([token_id]).encode("utf-8")
        text = raw.decode("utf-8", errors="replace")
        self._cache[token_id] = (text, list(raw))
        return self._cache[token_id]

    def entries(self, lps: list[Any]) -> list[dict[str, Any]]:
        out = []
        for lp in lps:
            t, b = self._token(lp.token_id)
            top = []
            for tid, val in list(getattr(lp, "top", []) or [])[: self.top_n]:
                tt, tb = self._token(tid)
                top.append({"token": tt, "logprob": float(val), "bytes": tb})
            out.append({"token": t, "logprob": float(lp.logprob), "bytes": b,
                        "top_logprobs": top})
        return out


async def until_disconnect(request: Request, task: asyncio.Task) -> Any:
    """Await ``task``; cancel it if the client disconnects first."""
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise APIError(499, "client disconnected", code="client_disconnected")


async def chat_completions(request: Request) -> Response:
    gw = gateway(request)
    tenant = authenticate(request, gw.tenants)
    req = parse_request(ChatCompletionRequest, await request.body(), gw)
    session_id = agreed_session_id({f"{HEADER} header": request.headers.get(HEADER),
                                    "session_id field": req.session_id})
    native_tools = supports_tools(gw.engine.tokenizer)
    turn = Turn(gw, tenant, req.template_messages(native_tools), session_id=session_id,
                transport="http", tools=req.template_tools(native_tools))
    request.state.turn_stats = [turn.stats]  # for the access log line
    top_n = req.top_logprobs or 0
    sampling = req.sampling()
    parser = req.call_parser()
    if parser is not None and parser.forced:
        sampling["structured"] = parser.grammar()
    await turn.prepare(max_tokens=req.requested_max_tokens(), n=req.n,
                       logprobs=top_n if req.logprobs else None, **sampling)
    await turn.start()
    completion = _Completion(gw, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()),
                             _Logprobs(gw.engine.tokenizer, top_n) if req.logprobs else None,
                             parser)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return TurnStreamingResponse(_sse_events(turn, completion, include_usage),
                                     release=[turn])
    try:
        final = await until_disconnect(request, asyncio.ensure_future(_collect(turn)))
    finally:
        turn.release()
    await turn.released()
    result = completion.response(final, turn.stats.usage())
    if session_id:
        result["session_id"] = session_id
    return JSONResponse(result)


class TurnStreamingResponse(StreamingResponse):
    """SSE (``text/event-stream``, not cached or buffered by proxies) for turns. It closes its
    event generator however the streaming ends, so the turns' ``finally`` (abort the engine
    requests, release the turns) runs at once when a send fails (a client that disconnected,
    or one dropped for not reading), not whenever the generator is collected; and it releases
    the turns after the response even if the client left before the generator started."""

    def __init__(self, content: AsyncIterator[bytes], *, release: list[Turn]) -> None:
        async def release_all() -> None:  # async: a sync background task is a thread hop
            for turn in release:
                turn.release()

        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                         background=BackgroundTask(release_all))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # the client went away: not a fault of the server
            log.debug("%s %s: the client went away mid-stream", scope["method"], scope["path"])

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


async def _collect(turn: Turn) -> RequestOutput:
    """The turn's deltas merged into one output."""
    final: RequestOutput | None = None
    async with contextlib.aclosing(turn.stream()) as outputs:
        async for out in outputs:
            if final is None:
                final = out
            else:
                merge_outputs(final, out)
    assert final is not None and final.finished
    return final


class _Completion:
    """Encodes one chat completion: a JSON body, or SSE ``chat.completion.chunk`` events that
    share one id (each ``data: {...}\n\n`` as bytes, ready to send)."""

    def __init__(self, gw: Gateway, completion_id: str, created: int,
                 logprobs: _Logprobs | None, tools: CallParser | None = None) -> None:
        self.id = completion_id
        self.created = created
        self.model = gw.model_name
        self.logprobs = logprobs
        self.tools = tools
        self._encode = msgspec.json.Encoder().encode

    def response(self, final: RequestOutput, usage: dict[str, Any]) -> dict[str, Any]:
        lp = self.logprobs
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
            calls = []
            if self.tools is not None:
                message["content"], calls = self.tools.parse(c.text)
                if calls:
                    message["tool_calls"] = [call.openai(i) for i, call in enumerate(calls)]
            choices.append(with_finish_detail({
                "index": c.index,
                "message": message,
                "logprobs": {"content": lp.entries(c.logprobs or []), "refusal": None}
                if lp is not None else None,
                "finish_reason": _finish_reason(c.finish_reason, bool(calls)) or "stop",
            }, c.finish_reason))
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
            "system_fingerprint": None,
        }

    def chunk(self, choices: list[dict[str, Any]], include_usage: bool,
              usage: dict[str, Any] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if include_usage:
            obj["usage"] = usage
        return b"data: " + self._encode(obj) + b"\n\n"

    def choice(self, index: int, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return {
            "index": index,
            "delta": delta,
            "logprobs": {"content": self.logprobs.entries(logprobs), "refusal": None}
            if self.logprobs is not None and logprobs else None,
            "finish_reason": finish_reason,
        }


class _StreamedCalls:
    """Holds back each choice's streamed text while it may be a tool call: all of it when the
    call is forced, while it could still start a ``<tool_call>`` block under ``auto``. At the
    finish, the held text is parsed: its calls go out as one ``tool_calls`` delta."""

    def __init__(self, parser: CallParser) -> None:
        self.parser = parser
        self._held: dict[int, str] = {}
        self._released: set[int] = set()  # choices streaming plain content

    def feed(self, index: int, text: str, finish_reason: str | None
             ) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, tool call deltas to send now) for a delta of choice
        ``index``."""
        if index in self._released:
            return text, []
        held = self._held.get(index, "") + text
        if finish_reason is None:
            if self.parser.forced or may_start_call(held):
                self._held[index] = held
                return "", []
            self._released.add(index)
            return held, []
        self._held.pop(index, None)
        content, calls = self.parser.parse(held)
        return content or "", [call.openai(i) for i, call in enumerate(calls)]


async def _sse_events(turn: Turn, completion: _Completion,
                      include_usage: bool) -> AsyncIterator[bytes]:
    assert turn.params is not None
    chunk, choice = completion.chunk, completion.choice
    try:
        for i in range(turn.params.n):
            yield chunk([choice(i, {"role": "assistant", "content": "", "refusal": None})],
                        include_usage)
        calls = _StreamedCalls(completion.tools) if completion.tools is not None else None
        async with contextlib.aclosing(turn.stream()) as outputs:
            async for out in outputs:
                for c in out.outputs:
                    text, called = c.text, False
                    if calls is not None:
                        text, tool_calls = calls.feed(c.index, c.text, c.finish_reason)
                        if tool_calls:
                            called = True
                            yield chunk([choice(c.index, {"tool_calls": tool_calls})],
                                        include_usage)
                    if text or c.logprobs:
                        yield chunk([choice(c.index, {"content": text}, None, c.logprobs)],
                                    include_usage)
                    if c.finish_reason is not None:
                        last = choice(c.index, {}, _finish_reason(c.finish_reason, called))
                        yield chunk([with_finish_detail(last, c.finish_reason)], include_usage)
        if include_usage:
            yield chunk([], include_usage, turn.stats.usage())
    except APIError as e:  # reported in-band, as OpenAI does
        yield b"data: " + json.dumps(e.body()).encode() + b"\n\n"
    finally:
        turn.release()
    await turn.released()
    yield b"data: [DONE]\n\n"


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
