"""CUDA graphs of the sampler's draw for decode steps whose rows are all ``sampler.plain``
(greedy, or temperature alone), with or without grammar masks: ``sampler.draw_plain`` over a
decode graph's static logits, replayed in one launch instead of a dozen host-dispatched ops
(a step of greedy rows without masks is one argmax: it is left to the eager sampler).
The tokens are those of the eager draw (``tests/engine/test_sampler.py`` checks the function
the graphs hold against ``sampler.draw``)."""

import torch

from engine.sampler import draw_plain, filled_keys, plain
from engine.sampling_params import SamplingParams
from engine.stream_wait import HostSignal
from engine.structured import GrammarMasks, apply_bitmask


class DrawGraphs:
    """One graph per decode graph batch size and kind of draw (sampled rows or greedy only,
    masked or not), captured on first use (sampled and unmasked: for every size at once). Per
    draw with sampled rows, their temperatures and keys go to the device in one copy from a
    pinned buffer (reused once its last copy is done). A masked graph reads the grammar
    bitmask where the grammar worker writes it (``GrammarMasks.device``, one int32 row per
    row, all bits set where a row has no grammar) behind a wait for its job's signal that the
    graph holds itself (one graph per ``GrammarMasks.ended_bits``: a job's bits alternate), so
    a masked draw is one launch too; a new bitmask or signal (the worker's bitmask grew, or a
    new worker) has its graphs captured anew."""

    def __init__(self, logits: dict[int, torch.Tensor]) -> None:
        """``logits``: each decode graph's static logits output, by padded batch size. The
        graphs without masks are captured here, for every size."""
        self._logits = logits
        max_rows = max(logits)
        device = logits[max_rows].device
        # row 0: temperature, row 1: noise key (< 2**32, exact in float64)
        self._staged = torch.zeros(2, max_rows, dtype=torch.float64, pin_memory=True)
        self._inputs = torch.zeros(2, max_rows, dtype=torch.float64, device=device)
        self._copied = torch.cuda.Event()
        self._copied.record()
        # the bitmask and signal the masked graphs hold
        self._bitmask: torch.Tensor | None = None
        self._signal: HostSignal | None = None
        # (size, masked, greedy only, the signal bits waited for: 0 for none)
        self._graphs: dict[tuple[int, bool, bool, int],
                           tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        for size in sorted(logits, reverse=True):  # largest first: the others reuse its pool
            self._graphs[size, False, False, 0] = self._capture(size, False, False, 0)

    @staticmethod
    def covers(params: list[SamplingParams], masks: GrammarMasks | None) -> bool:
        """Whether a graph draws these rows: all ``plain``, under masks a kernel reads in place
        (``GrammarMasks.in_place``) if any, and not all greedy without masks (an argmax, left
        to the eager sampler)."""
        return all(map(plain, params)) and (masks.in_place if masks is not None
                                            else not all(p.greedy for p in params))

    def draw(self, size: int, params: list[SamplingParams], keys: list[int | None],
             masks: GrammarMasks | None) -> torch.Tensor:
        """The tokens of the first ``len(params)`` rows of the size-``size`` decode graph's
        logits (all rows ``plain``), drawn on the device without waiting for them, under
        ``masks`` if any (their ``device`` bitmask with at least ``size`` rows) once filled:
        the graph waits for them on the device where ``masks`` have a signal, else the host
        waits before it is launched."""
        n = len(params)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:  # (a greedy-only graph reads no inputs)
            self._copied.synchronize()
            staged = self._staged.numpy()
            staged[0, :n] = [p.temperature for p in params]
            staged[1, :n] = 0  # a greedy row draws no key (nor does the eager sampler fill one)
            staged[1, sampled] = filled_keys([keys[i] for i in sampled])
            self._inputs.copy_(self._staged, non_blocking=True)  # 4 KB at most: all of it
            self._copied.record()
        bits = 0
        if masks is not None:
            assert masks.device is not None and masks.device.shape[0] >= size
            if (self._bitmask is None or masks.device.data_ptr() != self._bitmask.data_ptr()
                    or masks.signal is not self._signal):
                self._graphs = {key: graph for key, graph in self._graphs.items() if not key[1]}
                self._bitmask, self._signal = masks.device, masks.signal
            if masks.signal is not None:
                bits = masks.ended_bits
            else:  # no signal to hold a wait for: the host waits for the masks
                masks.result()
        key = (size, masks is not None, not sampled, bits)
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)
        graph, tokens = self._graphs[key]
        graph.replay()
        return tokens[:n]

    def _capture(self, size: int, masked: bool, greedy_only: bool,
                 bits: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The graph and its static tokens output; a masked one reads ``self._bitmask`` and
        starts with a wait for ``bits`` of ``self._signal`` (none for 0)."""
        bitmask = self._bitmask[:size] if masked and self._bitmask is not None else None
        signal = self._signal if bits else None

        def body() -> torch.Tensor:
            if signal is not None:
                signal.stream_wait(bits)
            return draw_plain(self._logits[size], self._inputs[0, :size].float(),
                              self._inputs[1, :size].long(),
                              (lambda x: apply_bitmask(x, bitmask)) if bitmask is not None
                              else None, greedy_only)

        # one eager run on a side stream first: it compiles the Triton kernels
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            tokens = body()
        self._pool = graph.pool()
        return graph, tokens
