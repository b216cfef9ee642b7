"""The messages between the engine process (``engine.core``) and its client
(``engine.async_engine``), as msgspec structs sent as msgpack over two ZeroMQ sockets.

Each client has its own pair of pipes (``chatgate serve --api-server-count N`` runs N clients
against one engine; each binds its two sockets, the engine connects to all of them).

Client → engine (one PUSH/PULL pipe): ``AddRequest``, ``AbortRequests``, ``UnpinSession``,
``LockSession``, ``UnlockSession``, ``Shutdown`` (with several clients: this client is done; the
engine stops once every client has sent it).

Engine → client (another): first ``EngineReady`` or ``EngineStartupFailed``; then one
``StepOutputs`` per engine step that produced anything for it: the delta outputs and refusals of
the requests this client sent, answers to its calls, and what every client must know (session
pin changes, a stats snapshot while busy at most every ``STATS_INTERVAL_S`` and whenever the
engine goes idle).
"""

import msgspec

from engine.info import EngineInfo
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    session_id: str | None = None
    cache_salt: str | None = None


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class UnpinSession(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    session_id: str


class LockSession(msgspec.Struct, tag=True, array_like=True):
    """Take the session's turn lock (answered False while another client holds it)."""

    call_id: int
    session_id: str


class UnlockSession(msgspec.Struct, tag=True, array_like=True):
    """Release the session's turn lock (answered: was it held by this client?)."""

    call_id: int
    session_id: str


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ClientMessage = (AddRequest | AbortRequests | UnpinSession | LockSession | UnlockSession
                 | Shutdown)


class EngineReady(msgspec.Struct, tag=True, array_like=True):
    info: EngineInfo
    stats: EngineStats


class EngineStartupFailed(msgspec.Struct, tag=True, array_like=True):
    error: str  # "<ExceptionType>: <message>", what the engine raised while starting


class RequestFailed(msgspec.Struct, array_like=True):
    """A request the engine refused (invalid) or dropped (its step failed)."""

    request_id: str
    error: str
    invalid: bool  # the request itself was at fault (HTTP 400), not the engine


class CallAnswer(msgspec.Struct, array_like=True):
    """The answer to a client's ``UnpinSession`` (unpinned?), ``LockSession`` (locked?) or
    ``UnlockSession`` (was it held?)."""

    call_id: int
    result: bool


class StepOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    outputs: list[RequestOutput] = []
    failed: list[RequestFailed] = []
    pin_changes: dict[str, list[int] | None] = {}  # session id → pinned token ids, or None
    answers: list[CallAnswer] = []
    stats: EngineStats | None = None


EngineMessage = EngineReady | EngineStartupFailed | StepOutputs

STATS_INTERVAL_S = 0.05


def client_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the engine sends."""
    return msgspec.msgpack.Decoder(EngineMessage)


def engine_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what a client sends."""
    return msgspec.msgpack.Decoder(ClientMessage)
