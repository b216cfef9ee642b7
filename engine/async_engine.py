"""asyncio client of the engine process: ``AsyncEngine`` starts ``python -m engine.core``, sends
it requests over ZeroMQ and hands each request's delta outputs to its consumer.

The event loop does no model work: it encodes requests, decodes one ``StepOutputs`` message per
engine step and routes its outputs. A consumer that falls behind gets the outputs that piled up
merged into one (vLLM's output collector), so a slow consumer costs fewer, larger deltas and
never holds the engine back. The outputs' text is made here, as each consumer takes them: the
engine sends token ids only, except for requests with stop strings (``engine.output_text``).

Chat prompts are rendered here (tokenized in batches in a worker thread) with the engine's own
tokenizer, which the engine process saves into this client's private folder before it reports
ready and this process reads back without torch, whatever form the model has. They are rendered
against a mirror of the engine's session pins (every pin and unpin arrives with the step that
made it). A stale mirror costs only cache reuse, never correctness: the engine
matches prompts to its real pins.

If the engine process dies, every open stream fails with ``EngineDeadError`` at once, later
calls raise it, and ``on_death`` callbacks run.

Alone, an ``AsyncEngine`` starts the engine process and stops it. Given an ``EngineLink`` whose
engine another process started (``--api-server-count N``: one engine, N clients), it attaches
to it, watches its pid, and on shutdown only tells the engine it is done.
"""

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine.batch_encoder import BatchEncoder
from engine.chat import PinnedTexts, chat_text, continue_pinned
from engine.config import EngineConfig
from engine.info import EngineInfo
from engine.ipc import (
    AbortRequests,
    AddRequest,
    ClientMessage,
    EngineReady,
    EngineStartupFailed,
    LockSession,
    Shutdown,
    StepOutputs,
    UnlockSession,
    UnpinSession,
    client_decoder,
)
from engine.launch import EngineLink, engine_command, engine_environment, ipc_links, process_exit
from engine.output_stream import OutputStream
from engine.output_text import OutputText
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from engine.tokenizer import read_folder

logger = logging.getLogger("engine.async")

SHUTDOWN_TIMEOUT_S = 30.0
ATTACHED_SEND_TIMEOUT_MS = 2000  # at most a few reconnect intervals (100 ms each)


class EngineStartupError(RuntimeError):
    """The engine process failed to start; the message is the engine's own error."""


class EngineDeadError(RuntimeError):
    """The engine process is gone; nothing more can be generated."""


class EngineStepError(RuntimeError):
    """The engine failed while running this request (the engine itself carries on)."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, log_level: str = "info",
                 link: EngineLink | None = None, stream_interval: int = 1) -> None:
        self.config = config
        self.stream_interval = stream_interval  # tokens a stream gathers (``OutputStream``)
        self.log_level = log_level
        self.link = link  # the engine another process started, to attach to
        self.pinned_at: dict[str, float] = {}  # session id -> monotonic time of its last pin
        self.info: EngineInfo | None = None
        self.tokenizer: Any = None
        self._batch_encoder: BatchEncoder
        self._pin_texts: PinnedTexts
        self.dead: str | None = None  # why the engine process is gone, once it is
        self.on_death: list[Callable[[str], None]] = []
        self._stats: EngineStats | None = None
        self._streams: dict[str, OutputStream] = {}
        self._calls: dict[int, asyncio.Future[bool]] = {}
        self._call_ids = itertools.count()
        self._pins: dict[str, list[int]] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = client_decoder()
        self._proc: asyncio.subprocess.Process | None = None
        self._ipc_dir: str | None = None
        self._parent_alive: int | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def shared(self) -> bool:
        """Whether other clients share the engine (it was started by another process)."""
        return self.link is not None

    async def start(self) -> None:
        """Start the engine process (or attach to the link's) and wait until it has loaded
        the model. Raises ``EngineStartupError`` with the engine's own error if it cannot
        start."""
        link = self.link
        if link is None:
            self._ipc_dir = tempfile.mkdtemp(prefix="chatgate-engine-")  # private (mode 0700)
            (link,) = ipc_links(self._ipc_dir, 1)
        self._sync_context = zmq.Context()
        self._to_engine = self._sync_context.socket(zmq.PUSH)
        self._to_engine.setsockopt(zmq.SNDHWM, 0)
        self._to_engine.setsockopt(zmq.LINGER, 0)  # what the engine has not taken is moot
        self._send_flags = zmq.NOBLOCK if self.link is None else 0
        self._to_engine.setsockopt(zmq.SNDTIMEO, ATTACHED_SEND_TIMEOUT_MS)
        self._to_engine.bind(link.inbox)
        self._async_context = zmq.asyncio.Context()
        self._from_engine = self._async_context.socket(zmq.PULL)
        self._from_engine.setsockopt(zmq.RCVHWM, 0)
        self._from_engine.bind(link.outbox)
        exited = await (self._spawn(link) if self.link is None else self._attach(link))
        first = asyncio.ensure_future(self._from_engine.recv())
        await asyncio.wait({exited, first}, return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            first.cancel()
            await self._close()
            code = "" if exited.result() is None else f" with code {exited.result()}"
            raise EngineStartupError(f"the engine process exited{code} before it was ready "
                                     "(its log above says why)")
        message = self._decoder.decode(first.result())
        if isinstance(message, EngineStartupFailed):
            if self._proc is not None:
                await self._stop_process(exited)
            await self._close()
            raise EngineStartupError(message.error)
        assert isinstance(message, EngineReady)
        self.info, self._stats = message.info, message.stats
        if self.info.has_tokenizer:
            self.tokenizer = await asyncio.to_thread(read_folder, Path(link.tokenizer_dir))
        self._batch_encoder = BatchEncoder(self.tokenizer)
        self._pin_texts = PinnedTexts(self.tokenizer)
        self._tasks = [asyncio.create_task(self._read_outputs(), name="engine-outputs"),
                       asyncio.create_task(self._watch(exited), name="engine-watch")]

    async def _spawn(self, link: EngineLink) -> asyncio.Future[int | None]:
        """Start the engine process; a future of its exit code."""
        parent_fd, self._parent_alive = os.pipe()  # the engine sees EOF when we are gone
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *engine_command(self.config, [link], parent_fd, self.log_level),
                pass_fds=(parent_fd,), env=engine_environment())
        finally:
            os.close(parent_fd)
        logger.info("engine process started (pid %d); loading %s", self._proc.pid,
                    self.config.model)
        return asyncio.create_task(self._proc.wait())

    async def _attach(self, link: EngineLink) -> asyncio.Future[int | None]:
        """Watch the engine process another process started."""
        assert link.engine_pid is not None
        return process_exit(link.engine_pid)

    async def shutdown(self) -> None:
        """Stop the engine process (in order; killed if it does not exit in time) and reap
        it, whatever its queue holds and whether or not it is still there to be told. Attached
        to another's engine: tell it this client is done (it stops when every client is)."""
        self._stopping = True
        if self.link is not None or (self._proc is not None and self._proc.returncode is None):
            with contextlib.suppress(EngineDeadError):  # gone already: nothing to tell
                self._send(Shutdown())
        if self._proc is not None and self._proc.returncode is None:
            await self._stop_process(self._proc.wait())
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._close()

    async def _stop_process(self, exited: Awaitable[int]) -> None:
        """Wait for the engine process to exit; kill it if it takes too long."""
        assert self._proc is not None
        try:
            await asyncio.wait_for(exited, SHUTDOWN_TIMEOUT_S)
        except TimeoutError:
            logger.warning("the engine process did not stop in %.0fs; killing it",
                           SHUTDOWN_TIMEOUT_S)
            self._proc.kill()
            await self._proc.wait()

    async def _close(self) -> None:
        if self._parent_alive is not None:
            os.close(self._parent_alive)
        # attached: the Shutdown just sent must leave before the socket goes
        self._to_engine.close(linger=0 if self.link is None else 2000)
        self._from_engine.close(linger=0)
        self._sync_context.term()
        self._async_context.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    async def _watch(self, exited: asyncio.Future[int | None]) -> None:
        code = await exited
        if self._stopping:
            return
        self.dead = ("the engine process exited unexpectedly" if code is None
                     else f"the engine process exited unexpectedly with code {code}")
        logger.error("%s; failing every open stream", self.dead)
        error = EngineDeadError(self.dead)
        self.fail_requests(error)
        for call in self._calls.values():
            if not call.done():
                call.set_exception(error)
        for callback in self.on_death:
            callback(self.dead)

    # -- what the engine told us -------------------------------------------------------------

    @property
    def pid(self) -> int:
        if self.link is not None and self.link.engine_pid is not None:
            return self.link.engine_pid
        assert self._proc is not None, "AsyncEngine.start() was not awaited"
        return self._proc.pid

    @property
    def model_name(self) -> str:
        assert self.info is not None, "AsyncEngine.start() was not awaited"
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        assert self.info is not None, "AsyncEngine.start() was not awaited"
        return self.info.max_model_len

    def stats(self) -> EngineStats:
        """The engine's latest snapshot (at most ``ipc.STATS_INTERVAL_S`` old while it steps,
        current while it is idle)."""
        assert self._stats is not None, "AsyncEngine.start() was not awaited"
        return self._stats

    async def render_chat(self, messages: list[dict], session_id: str | None = None,
                          tools: list[dict] | None = None) -> list[int]:
        """Chat template + generation prompt as token ids, continuing the tokens the engine
        has pinned under ``session_id`` (see ``engine.chat``). The template and the match
        against the pinned ids run here, on the event loop (a fraction of a millisecond: the
        pinned ids' text is the session's last prompt's plus a decode of its answer); the
        rest of the text is tokenized in batches off the loop (``engine.batch_encoder``).
        ``tools``: function definitions for a template that renders them."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        text = chat_text(self.tokenizer, messages, tools)
        if session_id is None:
            return await self._batch_encoder.encode(text)
        pinned = self._pins.get(session_id)
        kept, rest = continue_pinned(self.tokenizer, text, pinned,
                                     self._pin_texts.text(session_id, pinned) if pinned else None)
        prompt_ids = kept + await self._batch_encoder.encode(rest)
        self._pin_texts.remember(session_id, prompt_ids, text)
        return prompt_ids

    # -- requests ----------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        session_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's delta outputs until it finishes. Invalid input raises
        ``ValueError`` from the stream, with the engine's message: the engine process
        validates each request once, where it queues it (``EngineInfo.validate``; a caller
        that must refuse before it streams, as the gateway does, calls that first); leaving the
        iterator early aborts the request; ``EngineDeadError`` if the engine process dies
        meanwhile."""
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = None
        if self.tokenizer is not None and params.detokenize and not params.stop:
            assert self.info is not None
            text = OutputText(self.tokenizer, params, self.info.eos_token_ids)
            params = dataclasses.replace(params, detokenize=False)
        stream = self._streams[request_id] = OutputStream(self.stream_interval)
        finished = False
        try:
            self._send(AddRequest(request_id, prompt_token_ids, params, session_id, cache_salt))
            while not finished:
                output = await stream.get()
                finished = output.finished
                if text is not None:
                    text.fill(output)
                yield output
        finally:
            del self._streams[request_id]
            if not finished and self.dead is None and not self._stopping:
                with contextlib.suppress(EngineDeadError):  # a gone engine runs nothing
                    self._send(AbortRequests([request_id]))

    def fail_requests(self, error: Exception) -> int:
        """End every open request's stream with ``error`` (raised to its consumer, whose
        leaving the stream aborts the request in the engine); how many there were."""
        for stream in self._streams.values():
            stream.fail(error)
        return len(self._streams)

    async def unpin_session(self, session_id: str) -> bool:
        """Unpin the session's blocks; False if it had none pinned."""
        self._check_alive()
        self._pin_texts.forget(session_id)
        return await self._call(UnpinSession, session_id)

    async def lock_session(self, session_id: str) -> bool:
        """Take the session's turn lock in the engine, which every client shares; False while
        a client holds it. Release it with :meth:`unlock_session`."""
        return await self._call(LockSession, session_id)

    def unlock_session(self, session_id: str) -> asyncio.Future[bool] | None:
        """Release the session's turn lock: sent at once, without waiting; the future is done
        once the engine has released it (a lock another client asks for after that is free),
        None when no engine is connected (a gone engine holds no locks)."""
        try:
            call = self._start_call(UnlockSession, session_id)
        except EngineDeadError:
            return None
        # awaiting it is optional: an engine death nobody waits for is retrieved, not logged
        call.add_done_callback(lambda done: done.cancelled() or done.exception())
        return call

    async def _call(self, kind: type[UnpinSession | LockSession], session_id: str) -> bool:
        """Send a call about ``session_id`` and wait for the engine's answer."""
        self._check_alive()
        return await self._start_call(kind, session_id)

    def _start_call(self, kind: type[UnpinSession | LockSession | UnlockSession],
                    session_id: str) -> asyncio.Future[bool]:
        """Send a call about ``session_id``; the future of the engine's answer, forgotten
        once done."""
        call_id = next(self._call_ids)
        call = self._calls[call_id] = asyncio.get_running_loop().create_future()
        call.add_done_callback(lambda _: self._calls.pop(call_id, None))
        try:
            self._send(kind(call_id, session_id))
        except EngineDeadError:
            del self._calls[call_id]
            raise
        return call

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def _send(self, message: ClientMessage) -> None:
        """Queue ``message`` for the engine without blocking; ``EngineDeadError`` when no
        engine process is connected to take it (it has exited, or is exiting). Attached to
        another's engine, whose connection to this client's socket may come up to a reconnect
        interval after its ready message, the first sends may wait for it (``SNDTIMEO``)."""
        try:
            self._to_engine.send(self._encoder.encode(message), self._send_flags, copy=False)
        except zmq.Again:
            raise EngineDeadError("the engine process is not connected") from None

    async def _read_outputs(self) -> None:
        while True:
            data = await self._from_engine.recv(copy=False)
            message = self._decoder.decode(data.buffer)
            assert isinstance(message, StepOutputs)
            self._route(message)

    def _route(self, message: StepOutputs) -> None:
        if message.pin_changes:
            now = time.monotonic()
            for session_id, token_ids in message.pin_changes.items():
                if token_ids is None:
                    self._pins.pop(session_id, None)
                    self.pinned_at.pop(session_id, None)
                else:
                    self._pins[session_id] = token_ids
                    self.pinned_at[session_id] = now
        streams = self._streams
        for output in message.outputs:
            stream = streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
        for failed in message.failed:
            stream = streams.get(failed.request_id)
            if stream is not None:
                stream.fail(ValueError(failed.error) if failed.invalid
                            else EngineStepError(failed.error))
        for answer in message.answers:
            call = self._calls.get(answer.call_id)
            if call is not None and not call.done():
                call.set_result(answer.result)
        if message.stats is not None:
            self._stats = message.stats
