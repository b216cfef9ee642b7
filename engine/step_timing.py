"""Step timing spans, recorded by ``LLMEngine.step`` when the engine is made with
``time_steps=True`` (``LLMEngine.step_timings``): off by default, and then no clock is read.

A step's host time runs from its start to its return; its named sections are consecutive
laps within it (each from the end of the one before, the first from the step's start), so
they are non-negative and sum to no more than the host time. Section names, in step order:
``schedule`` (host-tier copies and scheduling), ``read`` (waiting for the in-flight step's
tokens and its grammar masks' job), ``outputs`` (appending tokens: stop checks, text),
``prepare`` (the step's host metadata), ``forward`` (the model's launch, or its run where the
device is the CPU), ``grammar`` (starting the grammar masks of the rows drawn), ``draw``
(queueing an overlapped step's draw) or ``sample`` (sampling and reading the tokens at once).
A step records only the sections it went through; a section met twice adds up.
"""

import time
from dataclasses import dataclass, field

import torch


@dataclass
class StepTiming:
    """One step's spans, in seconds. ``device_s``: the time the device's current stream took
    from the step's start to its return, between two CUDA events (with overlapped scheduling it
    includes waiting for the step before); None off a GPU. Reading it waits for the step's
    work on the device."""

    host_s: float
    sections: dict[str, float]
    _events: tuple[torch.cuda.Event, torch.cuda.Event] | None = field(default=None, repr=False)

    @property
    def device_s(self) -> float | None:
        if self._events is None:
            return None
        start, end = self._events
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class StepClock:
    """Times one step: :meth:`lap` closes a section, :meth:`stop` returns the timing."""

    def __init__(self, device: torch.device) -> None:
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._start = self._last = time.perf_counter()
        self._sections: dict[str, float] = {}

    def lap(self, section: str) -> None:
        """Add the time since the last lap (or the start) to ``section``."""
        now = time.perf_counter()
        self._sections[section] = self._sections.get(section, 0.0) + now - self._last
        self._last = now

    def stop(self) -> StepTiming:
        if self._events is not None:
            self._events[1].record()
        return StepTiming(time.perf_counter() - self._start, self._sections, self._events)


class NoClock:
    """A clock that times nothing (timing off): :meth:`lap` is a no-op."""

    def lap(self, section: str) -> None:
        pass


NO_CLOCK = NoClock()
