"""``OutputStream``: a request's deltas merge while its consumer is behind; with a stream
interval N the consumer is woken at once for the first delta, the last one and an error, and
otherwise once some sample has N new tokens."""

import asyncio

import pytest

from engine.output_stream import OutputStream
from engine.outputs import CompletionOutput, RequestOutput


def delta(*tokens: int, index: int = 0, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [CompletionOutput(index, "", list(tokens),
                                                "length" if finished else None)],
                         finished=finished)


async def take(stream: OutputStream) -> list[int] | None:
    """The first sample's tokens of what the consumer would be woken with now, else None."""
    if not stream.ready.is_set():
        return None
    return (await stream.get()).outputs[0].token_ids


async def test_every_delta_wakes_the_consumer_and_a_late_one_gets_them_merged():
    stream = OutputStream()
    stream.put(delta(1))
    assert await take(stream) == [1]
    stream.put(delta(2))
    stream.put(delta(3))
    assert await take(stream) == [2, 3]
    assert await take(stream) is None


async def test_an_interval_wakes_the_consumer_for_the_first_token_then_every_n():
    stream = OutputStream(interval=3)
    stream.put(delta(1))
    assert await take(stream) == [1]  # the first token at once
    for t in (2, 3):
        stream.put(delta(t))
        assert await take(stream) is None
    stream.put(delta(4))
    assert await take(stream) == [2, 3, 4]
    stream.put(delta(5, 6, 7))  # several tokens in one step (speculative decoding)
    assert await take(stream) == [5, 6, 7]
    stream.put(delta(8))
    stream.put(delta(9, finished=True))  # the end at once
    out = await stream.get()
    assert out.finished and out.outputs[0].token_ids == [8, 9]


async def test_an_interval_counts_each_sample_apart():
    stream = OutputStream(interval=2)
    stream.put(delta(1))
    await stream.get()
    stream.put(RequestOutput("r", [CompletionOutput(0, "", [2], None),
                                   CompletionOutput(1, "", [3], None)]))
    assert not stream.ready.is_set()  # one new token in each of two samples
    stream.put(delta(4, index=1))
    out = await stream.get()
    assert [c.token_ids for c in out.outputs] == [[2], [3, 4]]


async def test_an_error_wakes_the_consumer_behind_an_interval():
    stream = OutputStream(interval=8)
    stream.put(delta(1))
    await stream.get()
    stream.put(delta(2))
    stream.fail(RuntimeError("engine step failed"))
    assert (await stream.get()).outputs[0].token_ids == [2]  # what came before the error
    with pytest.raises(RuntimeError, match="engine step failed"):
        await asyncio.wait_for(stream.get(), 1)
