"""Step timing spans, recorded by ``LLMEngine.step`` when the engine is made with
``time_steps=True`` (``LLMEngine.step_timings``): off by default, and then no clock is read and
no CUDA event is recorded.

A step's host time runs from its start to its return; its named sections are consecutive
laps within it (each from the end of the one before, the first from the step's start), so
they are non-negative and sum to no more than the host time. Section names, in step order:
``schedule`` (host-tier copies and scheduling), ``read`` (waiting for the in-flight step's
tokens and its grammar masks' job), ``outputs`` (appending tokens: stop checks, text),
``prepare`` (the step's host metadata), ``forward`` (the model's launch, or its run where the
device is the CPU), ``grammar`` (starting the grammar masks of the rows drawn), ``draw``
(queueing an overlapped step's draw) or ``sample`` (sampling and reading the tokens at once).
A step records only the sections it went through; a section met twice adds up.

Each timing also carries the step's batch: its rows, the context tokens they hold once the step
has run (the KV its attention reads), the tokens it computed as the engine counts them
(``num_prefill_tokens + num_decode_tokens`` grew by that much), and the padded batch size of
the decode CUDA graph it replayed (None: an eager step, or no forward at all).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

Events = tuple[torch.cuda.Event, torch.cuda.Event]


def _elapsed_s(events: Events | None) -> float | None:
    if events is None:
        return None
    start, end = events
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@dataclass
class StepTiming:
    """One step's spans (seconds) and batch. ``device_s``: the time the device's current stream
    took from the step's start to its return, between two CUDA events (with overlapped
    scheduling it includes waiting for the step before); ``graph_device_s``: the decode graph's
    replay alone, between two CUDA events around it. Both None off a GPU (and the latter for a
    step that replayed no graph); reading them waits for the step's work on the device."""

    host_s: float
    sections: dict[str, float]
    rows: int = 0
    context_tokens: int = 0
    tokens_computed: int = 0
    graph_size: int | None = None
    _events: Events | None = field(default=None, repr=False)
    _graph_events: Events | None = field(default=None, repr=False)

    @property
    def device_s(self) -> float | None:
        return _elapsed_s(self._events)

    @property
    def graph_device_s(self) -> float | None:
        return _elapsed_s(self._graph_events)


def _started_events() -> Events:
    events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    events[0].record()
    return events


class StepClock:
    """Times one step: :meth:`lap` closes a section, :meth:`note_batch` and
    :meth:`replay_graph` note the batch, :meth:`stop` returns the timing."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._events = _started_events() if self._cuda else None
        self._graph_events: Events | None = None
        self._graph_size: int | None = None
        self._rows = self._context = 0
        self._start = self._last = time.perf_counter()
        self._sections: dict[str, float] = {}

    def lap(self, section: str) -> None:
        """Add the time since the last lap (or the start) to ``section``."""
        now = time.perf_counter()
        self._sections[section] = self._sections.get(section, 0.0) + now - self._last
        self._last = now

    def note_batch(self, host: dict[str, np.ndarray]) -> None:
        """Note the step's rows and their context from its host metadata (``seq_lens``)."""
        seq_lens = host["seq_lens"]
        self._rows, self._context = len(seq_lens), int(seq_lens.sum())

    def replay_graph(self, size: int, replay: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """``replay(size)``, the decode graph of padded batch ``size``, between two CUDA
        events on a GPU."""
        self._graph_size = size
        if not self._cuda:
            return replay(size)
        events = _started_events()
        logits = replay(size)
        events[1].record()
        self._graph_events = events
        return logits

    def stop(self, tokens_computed: int) -> StepTiming:
        if self._events is not None:
            self._events[1].record()
        return StepTiming(time.perf_counter() - self._start, self._sections, self._rows,
                          self._context, tokens_computed, self._graph_size, self._events,
                          self._graph_events)


class NoClock:
    """A clock that times nothing (timing off): every method only does the step's work."""

    def lap(self, section: str) -> None:
        pass

    def note_batch(self, host: dict[str, np.ndarray]) -> None:
        pass

    def replay_graph(self, size: int, replay: Callable[[int], torch.Tensor]) -> torch.Tensor:
        return replay(size)


NO_CLOCK = NoClock()
