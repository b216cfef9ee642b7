"""Tokenization for an event loop: texts encoded in batches, in one worker thread.

A thread per text looks free but is not while the event loop is busy (streaming): each worker
thread must win the GIL back from the loop after every release, and a thread waiting for the
GIL waits up to the interpreter's switch interval (5 ms) each time. A burst of chat turns, one
thread each, then took 130-270 ms to tokenize on a 16-core machine where the encoding itself
was under 1 ms a turn. Here every text that arrives while a batch is being encoded waits for
the next batch, and a batch is one call into the tokenizer (which releases the GIL while it
encodes): one thread hand-off per batch instead of one per text. A short text (the new turn of
a session whose earlier turns are pinned) is encoded on the spot: a hand-off costs more than
encoding it.
"""

import asyncio
from typing import Any

# Texts up to this many characters are encoded on the event loop (tens of microseconds).
INLINE_CHARS = 512


class BatchEncoder:
    """``await encode(text)``: ``tokenizer.encode(text, add_special_tokens=False)``, batched
    unless ``text`` is at most ``INLINE_CHARS`` long.

    Invariant: at most one batch is in the worker thread at a time; every text queued while it
    runs goes into the next one, which starts as soon as it returns."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._queue: list[tuple[str, asyncio.Future[list[int]]]] = []
        self._drainer: asyncio.Task[None] | None = None

    async def encode(self, text: str) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return self._encode([text])[0] if text else []
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._queue.append((text, future))
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain(), name="batch-encoder")
        return await future

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    ids = await asyncio.to_thread(self._encode, [text for text, _ in batch])
                except Exception as error:  # noqa: BLE001 - handed to every waiting caller
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    continue
                for (_, future), token_ids in zip(batch, ids, strict=True):
                    if not future.done():  # its caller may have been cancelled meanwhile
                        future.set_result(token_ids)
        finally:
            self._drainer = None

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]
