"""``OutputStream``: one request's outputs between the engine client's reader and the request's
consumer (vLLM's output collector)."""

import asyncio

from engine.outputs import RequestOutput, merge_outputs


class OutputStream:
    """One request's outputs not yet taken by its consumer, merged into one while it is behind;
    then an error, if the request failed.

    With ``interval`` N above 1 (vLLM's and SGLang's ``stream_interval``), the consumer is woken
    once some sample has N new tokens, and at once for the first output, the last one and an
    error: fewer, larger deltas, each costing its consumer a wake-up and a network write."""

    __slots__ = ("pending", "error", "ready", "interval", "_taken")

    def __init__(self, interval: int = 1) -> None:
        self.pending: RequestOutput | None = None
        self.error: Exception | None = None
        self.ready = asyncio.Event()
        self.interval = interval
        self._taken = False  # whether the consumer has had an output

    def put(self, output: RequestOutput) -> None:
        if self.pending is None:
            self.pending = output
        else:
            merge_outputs(self.pending, output)
        if (self.interval > 1 and self._taken and not output.finished
                and max((len(c.token_ids) for c in self.pending.outputs), default=0)
                < self.interval):
            return
        self.ready.set()

    def fail(self, error: Exception) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> RequestOutput:
        await self.ready.wait()
        output, self.pending = self.pending, None
        self._taken = True
        if output is None:
            assert self.error is not None
            raise self.error
        if self.error is None:
            self.ready.clear()
        return output
