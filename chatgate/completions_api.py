"""``POST /v1/completions``: OpenAI's text completions (the endpoint vLLM's and SGLang's
serving benchmarks drive). Each prompt (text, tokenized without special tokens as
``LLM.generate`` does, or token ids) is one ``Turn`` without a session; choice ``index`` is
``prompt_index * n + sample_index``. JSON or SSE, in OpenAI's ``text_completion`` format."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatgate.auth import authenticate
from chatgate.errors import APIError
from chatgate.finish import openai_finish_reason, with_finish_detail
from chatgate.openai_api import (
    TurnStreamingResponse,
    gateway,
    parse_request,
    until_disconnect,
)
from chatgate.openai_models import CompletionRequest
from chatgate.turn import Turn
from engine.client import RequestOutput, merge_outputs

_encode = msgspec.json.Encoder().encode


async def completions(request: Request) -> Response:
    gw = gateway(request)
    tenant = authenticate(request, gw.tenants)
    req = parse_request(CompletionRequest, await request.body(), gw)
    turns = []
    for prompt in req.prompts():
        if isinstance(prompt, str):
            if gw.engine.tokenizer is None:
                raise APIError(400, "Text prompts need a tokenizer; send token ids.",
                               param="prompt", code="invalid_value")
            ids = gw.engine.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        if not ids:
            raise APIError(400, "A prompt must not be empty.", param="prompt",
                           code="invalid_value")
        turn = Turn(gw, tenant, [], session_id=None, transport="http")
        await turn.prepare(prompt_ids=ids, max_tokens=req.max_tokens, n=req.n,
                           **req.sampling())
        turns.append(turn)
    request.state.turn_stats = [turn.stats for turn in turns]  # for the access log line
    started: list[Turn] = []
    try:
        for turn in turns:
            await turn.start()
            started.append(turn)
    except APIError:
        for turn in started:
            turn.release()
        raise
    body = _Body(gw.model_name, req.n or 1)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return TurnStreamingResponse(_events(turns, body, include_usage), release=turns)
    try:
        finals = await until_disconnect(request, asyncio.ensure_future(_collect(turns)))
    finally:
        for turn in turns:
            turn.release()
    choices = [body.choice(p, c.index, c.text, c.finish_reason or "stop")
               for p, final in enumerate(finals)
               for c in sorted(final.outputs, key=lambda c: c.index)]
    return JSONResponse({**body.head(), "choices": choices, "usage": _usage(turns)})


class _Body:
    """The fields every body and chunk of one completion shares."""

    def __init__(self, model: str, n: int) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.n = n

    def head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": None}

    def choice(self, prompt: int, index: int, text: str,
               finish_reason: str | None) -> dict[str, Any]:
        """A choice that ended for the engine's ``finish_reason`` (None: still going)."""
        return with_finish_detail({"index": prompt * self.n + index, "text": text,
                                   "logprobs": None,
                                   "finish_reason": openai_finish_reason(finish_reason)},
                                  finish_reason)

    def chunk(self, choices: list[dict[str, Any]], include_usage: bool,
              usage: dict[str, Any] | None = None) -> bytes:
        obj = {**self.head(), "choices": choices}
        if include_usage:
            obj["usage"] = usage
        return b"data: " + _encode(obj) + b"\n\n"


def _usage(turns: list[Turn]) -> dict[str, Any]:
    prompt = sum(t.stats.prompt_tokens for t in turns)
    completion = sum(t.stats.completion_tokens for t in turns)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(t.stats.cached_tokens
                                                           for t in turns)}}


async def _collect(turns: list[Turn]) -> list[RequestOutput]:
    """Every prompt's deltas merged into one output per prompt, in prompt order."""
    finals: list[RequestOutput | None] = [None] * len(turns)
    async for p, out in _merged(turns):
        if finals[p] is None:
            finals[p] = out
        else:
            merge_outputs(finals[p], out)
    return [f for f in finals if f is not None]


async def _merged(turns: list[Turn]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(prompt index, delta)`` from all turns as they come; the first failure is raised
    and the other turns are stopped (aborted)."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(p: int, turn: Turn) -> None:
        try:
            async with contextlib.aclosing(turn.stream()) as outputs:
                async for out in outputs:
                    await queue.put((p, out))
            await queue.put((p, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((p, e))

    tasks = [asyncio.create_task(pump(p, turn)) for p, turn in enumerate(turns)]
    try:
        remaining = len(tasks)
        while remaining:
            p, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield p, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _events(turns: list[Turn], body: _Body, include_usage: bool) -> AsyncIterator[bytes]:
    try:
        async with contextlib.aclosing(_merged(turns)) as outputs:
            async for p, out in outputs:
                for c in out.outputs:
                    if c.text:
                        yield body.chunk([body.choice(p, c.index, c.text, None)], include_usage)
                    if c.finish_reason is not None:
                        yield body.chunk([body.choice(p, c.index, "", c.finish_reason)],
                                         include_usage)
        if include_usage:
            yield body.chunk([], include_usage, _usage(turns))
    except APIError as e:  # reported in-band, as OpenAI does
        yield b"data: " + json.dumps(e.body()).encode() + b"\n\n"
    finally:
        for turn in turns:
            turn.release()
    yield b"data: [DONE]\n\n"


routes = [Route("/v1/completions", completions, methods=["POST"])]
