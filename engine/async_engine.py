"""asyncio front of the engine: one background thread runs the step loop; the event loop only
enqueues commands and receives outputs, so it never waits on the model.

Every mutation of engine state happens on the step thread (commands are closures it runs
between steps); outputs cross back with ``call_soon_threadsafe``.
"""

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

logger = logging.getLogger("engine.async")
T = TypeVar("T")

STATS_INTERVAL_S = 0.05  # while busy, the stats snapshot (O(blocks in use)) is this fresh


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._streams: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats = self.engine.stats()
        self._stats_at = time.monotonic()

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def render_chat(self, messages: list[dict], session_id: str | None = None) -> list[int]:
        return self.engine.render_chat(messages, session_id)

    def stats(self) -> EngineStats:
        """A snapshot from the step thread: taken whenever it goes idle and at least every
        ``STATS_INTERVAL_S`` while it steps."""
        return self._stats

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        session_id: str | None = None,
        cache_salt: str | None = None,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs until the request finishes. Invalid input raises ``ValueError``
        before anything is queued; leaving the iterator early aborts the request."""
        self.engine.validate(prompt_token_ids, params)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._streams[request_id] = stream

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt_token_ids, params, prompt=prompt,
                                        session_id=session_id, cache_salt=cache_salt)
            except ValueError as error:
                self._deliver(request_id, error)

        self._submit(add)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(lambda: self.engine.abort(request_id))

    async def abort(self, request_id: str) -> None:
        def run() -> None:
            output = self.engine.abort(request_id)
            if output is not None:
                self._deliver(request_id, output)

        await self._call(run)

    async def release_session(self, session_id: str) -> bool:
        return await self._call(lambda: self.engine.release_session(session_id))

    # -- step thread -------------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the step thread and await its result."""
        assert self._loop is not None, "AsyncEngine.start() was not awaited"
        future: asyncio.Future[T] = self._loop.create_future()
        loop = self._loop

        def run() -> None:
            try:
                result = fn()
            except Exception as error:  # noqa: BLE001 - handed to the awaiting caller
                loop.call_soon_threadsafe(future.set_exception, error)
            else:
                loop.call_soon_threadsafe(future.set_result, result)

        self._submit(run)
        return await future

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(stream.put_nowait, item)

    def _run(self) -> None:
        while not self._stopping.is_set():
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as error:
                    logger.exception("engine step failed; aborting the running requests")
                    self._fail_all(error)
                    outputs = []
                for output in outputs:
                    self._deliver(output.request_id, output)
                if time.monotonic() - self._stats_at >= STATS_INTERVAL_S:
                    self._snapshot()
            else:
                self._snapshot()
                self._wake.wait()
                self._wake.clear()

    def _snapshot(self) -> None:
        self._stats = self.engine.stats()
        self._stats_at = time.monotonic()

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._deliver(request_id, RuntimeError(f"engine step failed: {error}"))
