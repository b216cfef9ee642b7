"""``OutputStream``: one request's outputs between the engine client's reader and the request's
consumer (vLLM's output collector)."""

import asyncio

from engine.outputs import RequestOutput, merge_outputs


class OutputStream:
    """One request's outputs not yet taken by its consumer, merged into one while it is behind;
    then an error, if the request failed."""

    __slots__ = ("pending", "error", "ready")

    def __init__(self) -> None:
        self.pending: RequestOutput | None = None
        self.error: Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self.pending is None:
            self.pending = output
        else:
            merge_outputs(self.pending, output)
        self.ready.set()

    def fail(self, error: Exception) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> RequestOutput:
        await self.ready.wait()
        output, self.pending = self.pending, None
        if output is None:
            assert self.error is not None
            raise self.error
        if self.error is None:
            self.ready.clear()
        return output
