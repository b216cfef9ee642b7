"""The one place the benchmarks reach into the engine's state beyond its public methods:
``StepRecorder`` replaces ``LLMEngine.step`` on the instance, to note each step's batch
(``scheduler.running``, the engine's token counters, ``runner.num_graph_steps``), and the
runner's captured graphs in ``runner.graphs``, to time each replay on the device."""

import time

import torch

from benchmarks._common import log


class TimedGraph:
    """A decode CUDA graph whose every replay is bracketed by CUDA events, so that its device
    time is measured in the very steps it runs in (same clocks, same cache contents)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, replays: list) -> None:
        self.graph, self.replays = graph, replays

    def replay(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.replays.append((start, end))


class StepRecorder:
    """Wraps ``LLMEngine.step`` to time every step and note its batch composition: rows,
    whether it replayed a CUDA graph, tokens computed, and the context its rows hold (the KV
    a decode step reads); on CUDA each graph replay is also timed on the device
    (:class:`TimedGraph`, ``graph_s``: one entry per step, None for an eager step)."""

    def __init__(self, engine, device: torch.device, total: int) -> None:
        self.engine, self.device, self.total = engine, device, total
        self.inner = engine.step
        self.steps: list[tuple[float, int, bool]] = []  # (seconds, rows, CUDA-graph step)
        self.work: list[tuple[int, int]] = []  # (tokens computed, context tokens of the rows)
        self.replays: list = []  # (start, end) events of each graph replay, in order
        self.step_replays: list[int | None] = []  # each step's index into replays
        self.finished = 0
        self.last_log = time.perf_counter()
        graphs = engine.runner.graphs
        self.graphs = dict(graphs)
        if device.type == "cuda":
            for size, (graph, logits) in self.graphs.items():
                graphs[size] = (TimedGraph(graph, self.replays), logits)
        engine.step = self.step

    def step(self):
        sched = self.engine.scheduler
        runner = self.engine.runner
        graph_steps = runner.num_graph_steps
        rows = len(sched.running)
        computed = self.engine.num_prefill_tokens + self.engine.num_decode_tokens
        start = time.perf_counter()
        outputs = self.inner()
        elapsed = time.perf_counter() - start
        graph = runner.num_graph_steps > graph_steps
        self.steps.append((elapsed, rows, graph))
        self.step_replays.append(len(self.replays) - 1 if graph and self.replays else None)
        self.work.append((self.engine.num_prefill_tokens + self.engine.num_decode_tokens
                          - computed, sum(s.num_computed_tokens for s in sched.running)))
        self.finished += sum(o.finished for o in outputs)
        if time.perf_counter() - self.last_log > 5:
            self.last_log = time.perf_counter()
            log(f"  engine: {self.finished}/{self.total} requests done, {len(self.steps)} steps, "
                f"{len(sched.running)} running, {len(sched.waiting)} waiting")
        return outputs

    def restore(self) -> None:
        self.engine.step = self.inner
        self.engine.runner.graphs.update(self.graphs)

    def graph_s(self) -> list[float | None]:
        """Each step's graph replay, device seconds (None: an eager step, or no CUDA)."""
        if self.replays:
            torch.cuda.synchronize()
        return [self.replays[i][0].elapsed_time(self.replays[i][1]) / 1e3 if i is not None
                else None for i in self.step_replays]

