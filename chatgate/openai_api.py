"""OpenAI-compatible HTTP API: ``GET /v1/models`` and ``POST /v1/chat/completions`` (JSON and
SSE). Chunks and bodies follow what the official ``openai`` SDK parses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatgate.auth import authenticate
from chatgate.errors import APIError, from_validation_error
from chatgate.openai_models import ChatCompletionRequest
from chatgate.service import Gateway, TurnStats

log = logging.getLogger("chatgate")

SSE_PING_S = 15.0


def sampling_params(
    *,
    n: int = 1,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    max_tokens: int | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    logprobs: int | None = None,
    ignore_eos: bool = False,
) -> Any:
    """An ``engine.SamplingParams``; its ``ValueError`` (naming the parameter) becomes a 400."""
    from engine import SamplingParams

    kw: dict[str, Any] = {
        "n": n,
        "temperature": 1.0 if temperature is None else float(temperature),
        "top_p": 1.0 if top_p is None else float(top_p),
        "top_k": 0 if top_k is None or top_k < 0 else int(top_k),
        "max_tokens": max_tokens,
        "seed": seed,
        "stop": list(stop or []),
        "logprobs": logprobs,
        "ignore_eos": bool(ignore_eos),
    }
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        param = str(e).split(" ", 1)[0] if str(e) else None
        raise APIError(400, str(e), param=param, code="invalid_value") from None


async def read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e}",
                       code="invalid_json") from None


def _gateway(request: Request) -> Gateway:
    gw = getattr(request.app.state, "gateway", None)
    if gw is None:
        raise APIError(503, "The engine is still loading; retry shortly.", code="not_ready")
    return gw


async def list_models(request: Request) -> Response:
    gw = _gateway(request)
    authenticate(request, gw.tenants)
    return JSONResponse({
        "object": "list",
        "data": [{
            "id": gw.model_name,
            "object": "model",
            "created": gw.created,
            "owned_by": "chatgate",
            "root": gw._engine_model_name,
            "parent": None,
            "max_model_len": gw.max_model_len,
        }],
    })


def _finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    return reason if reason in ("stop", "length") else "stop"


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


def _split_history(messages: list[dict[str, str]]) -> tuple[str | None, list[dict[str, str]]]:
    """Leading system messages become the session's system prompt; the rest its history."""
    system: list[str] = []
    i = 0
    while i < len(messages) and messages[i]["role"] == "system":
        system.append(messages[i]["content"])
        i += 1
    return ("\n\n".join(system) or None), [dict(m) for m in messages[i:]]


async def _until_disconnect(request: Request, task: asyncio.Task) -> Any:
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
    gw = _gateway(request)
    tenant = authenticate(request, gw.tenants)
    body = await read_json(request)
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    if not gw.accepts_model(req.model):
        raise APIError(404, f"The model `{req.model}` does not exist.", param="model",
                       code="model_not_found")
    messages = [m.as_template_message() for m in req.messages]
    eid = gw.engine_session_id(tenant, req.session_id) if req.session_id else None
    prompt_ids = gw.render(messages, eid)
    max_tokens = gw.check_prompt(prompt_ids, req.requested_max_tokens(), clamp=False)
    top_n = req.top_logprobs or 0
    params = sampling_params(
        n=req.n or 1, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        max_tokens=max_tokens, seed=req.seed, stop=req.stop,
        logprobs=top_n if req.logprobs else None, ignore_eos=bool(req.ignore_eos),
    )
    gw.admit(tenant)
    if eid is not None:
        try:
            gw.acquire_session(eid)
        except APIError:
            gw.release(tenant, TurnStats())
            raise

    stats = TurnStats()
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    lp = _Logprobs(gw.engine.tokenizer, top_n) if req.logprobs else None

    finished = False

    async def finish(texts: dict[int, str] | None) -> None:
        """Release the tenant's stream slot and the session (once); store the turn."""
        nonlocal finished
        if finished:
            return
        finished = True
        gw.release(tenant, stats)
        if eid is not None:
            gw.release_session_lock(eid)
            if texts is not None:
                system, history = _split_history(messages)
                history.append({"role": "assistant", "content": texts.get(0, "")})
                try:
                    await gw.store.replace(tenant.id, req.session_id, system, history)
                except Exception:  # noqa: BLE001 - the answer was already delivered
                    log.exception("could not store session %s", req.session_id)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _sse_events(gw, tenant, prompt_ids, params, stats, eid, completion_id,
                             created, include_usage, lp, finish)
        # ``background`` runs after the response even if the client left before the event
        # generator ever started (its ``finally`` would then never run).
        return EventSourceResponse(events, sep="\n", ping=SSE_PING_S,
                                   background=BackgroundTask(finish, None))

    async def run() -> dict[str, Any]:
        final = None
        async for out in gw.stream(tenant, prompt_ids, params, stats, eid=eid):
            final = out
        return final

    ok = False
    try:
        try:
            final = await _until_disconnect(request, asyncio.ensure_future(run()))
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        ok = True
    finally:
        texts = {c.index: c.text for c in final.outputs} if ok and final else None
        await finish(texts)
    choices = []
    for c in sorted(final.outputs, key=lambda c: c.index):
        choices.append({
            "index": c.index,
            "message": {"role": "assistant", "content": c.text, "refusal": None},
            "logprobs": {"content": lp.entries(c.logprobs or []), "refusal": None}
            if lp is not None else None,
            "finish_reason": _finish_reason(c.finish_reason) or "stop",
        })
    result: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": gw.model_name,
        "choices": choices,
        "usage": stats.usage(),
        "system_fingerprint": None,
    }
    if req.session_id:
        result["session_id"] = req.session_id
    return JSONResponse(result)


async def _sse_events(
    gw: Gateway, tenant: Any, prompt_ids: list[int], params: Any, stats: TurnStats,
    eid: str | None, completion_id: str, created: int, include_usage: bool,
    lp: _Logprobs | None, finish: Any,
) -> AsyncIterator[str]:
    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        obj: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": gw.model_name,
            "system_fingerprint": None,
            "choices": choices,
        }
        if include_usage:
            obj["usage"] = usage
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))

    def choice(index: int, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {
            "index": index,
            "delta": delta,
            "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None,
            "finish_reason": finish_reason,
        }

    n = params.n
    texts: dict[int, str] = {}
    finished: set[int] = set()
    lp_sent: dict[int, int] = {}
    completed = False
    try:
        for i in range(n):
            yield chunk([choice(i, {"role": "assistant", "content": "", "refusal": None})])
        async for out in gw.stream(tenant, prompt_ids, params, stats, eid=eid):
            for c in out.outputs:
                if c.index in finished:
                    continue
                texts[c.index] = c.text
                lps = None
                if lp is not None and c.logprobs:
                    k = lp_sent.get(c.index, 0)
                    if len(c.logprobs) > k:
                        lps = lp.entries(c.logprobs[k:])
                        lp_sent[c.index] = len(c.logprobs)
                if c.delta_text or lps:
                    yield chunk([choice(c.index, {"content": c.delta_text}, None, lps)])
                if c.finish_reason is not None:
                    finished.add(c.index)
                    yield chunk([choice(c.index, {}, _finish_reason(c.finish_reason))])
        completed = True
        if include_usage:
            yield chunk([], stats.usage())
    except Exception as e:  # noqa: BLE001 - reported in-band, as OpenAI does
        if isinstance(e, APIError):
            err = e
        elif isinstance(e, ValueError):
            err = APIError(400, str(e), code="invalid_value")
        else:
            log.exception("stream %s failed", completion_id)
            err = APIError(500, f"The engine failed while generating: {e}", code="engine_error")
        yield json.dumps(err.body())
    finally:
        await finish(texts if completed else None)
    yield "[DONE]"


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
