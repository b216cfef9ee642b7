"""Step CUDA graphs: one per padded step shape, over static input buffers.

A set of graphs serves steps whose rows each have at most ``max_query_len`` new tokens, one
graph per shape (rows, token rows): the decode graphs (one token a row, shapes ``(b, b)``),
the verify graphs of speculative decoding (K + 1 tokens a row, ``(b, b * (K + 1))``) and the
mixed graphs (steps with a prompt chunk: ``(rows, t)`` for ``t`` in steps of
``MIXED_TOKEN_STEP``). A step replays the smallest shape that holds its rows and tokens: the
step's tokens first, then padding. The graph reads static buffers: padding tokens have slot
``-1`` (nothing written), padding rows ``seq_len`` 0 and no query tokens (attention skips
them), and block-table rows hold valid ids; block tables are ``ceil(max_model_len /
block_size)`` wide, and attention is captured with ``max_seq_len = max_model_len`` (and, with
queries of several tokens, the backend's tile map made inside the graph), so one graph serves
every context length. The decode and verify graphs return the logits of every token row, the
mixed graphs those of each row's last token. A step's inputs reach the buffers through pinned
host mirrors, copied in one go; an event guards the mirrors' reuse.
"""

import logging
import time

import numpy as np
import torch

from engine.config import SpeculativeConfig
from engine.model import AttentionMetadata, LlamaModel

logger = logging.getLogger("engine.cuda_graphs")

MAX_GRAPH_BATCH_SIZE = 256
MIXED_TOKEN_STEP = 256  # the mixed graphs' token counts: multiples of this, ...
MAX_MIXED_TOKENS = 8192  # ... up to this: a larger step is bound by its products, not launches
# rows of the packed host mirror: token rows (ids, positions, slots, the feed per token), then
# row rows (sequence lengths, query starts)
_IDS, _POSITIONS, _SLOTS, _FEED, _SEQ_LENS, _QUERY_START = range(6)

Shape = tuple[int, int]  # (rows, token rows)


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH_SIZE) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8 up to
    ``min(max_num_seqs, limit)`` (that cap itself included when it is no multiple of 8)."""
    cap = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4) if s <= cap] + list(range(8, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding ``num_seqs`` rows, or None when none does."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


def mixed_shapes(max_num_seqs: int, max_num_batched_tokens: int) -> list[Shape]:
    """The mixed graphs' shapes: ``min(max_num_seqs, MAX_GRAPH_BATCH_SIZE)`` rows (a padding
    row costs a few empty attention programs), token rows in steps of ``MIXED_TOKEN_STEP`` up
    to the step's token budget or ``MAX_MIXED_TOKENS`` (padding tokens cost their share of the
    products)."""
    rows = min(max_num_seqs, MAX_GRAPH_BATCH_SIZE)
    budget = min(max_num_batched_tokens, MAX_MIXED_TOKENS)
    top = -(-budget // MIXED_TOKEN_STEP) * MIXED_TOKEN_STEP
    return [(rows, t) for t in range(MIXED_TOKEN_STEP, top + 1, MIXED_TOKEN_STEP)]


def pack_step(packed: np.ndarray, host: dict[str, np.ndarray], shape: Shape,
              feed: np.ndarray | None) -> None:
    """Write a step's ``host`` metadata (``ModelRunner.host_metadata``'s form) into the packed
    mirror ``packed [6, > tokens]`` for the graph of ``shape = (rows, tokens)``: token columns
    ``0..tokens`` (the step's tokens, then padding: id 0, position 0, slot -1), row columns
    ``0..rows`` (padding rows: ``seq_len`` 0, no tokens) and ``rows + 1`` query starts. The
    feed column of a token is ``feed[i]`` at row ``i``'s first token (its input id is
    ``sampled[feed[i]]``), else -1."""
    rows, width = shape
    n = len(host["seq_lens"])
    tokens = int(host["query_start_loc"][n])
    packed[_IDS, :tokens] = host["input_ids"]
    packed[_POSITIONS, :tokens] = host["positions"]
    packed[_SLOTS, :tokens] = host["slot_mapping"]
    packed[_IDS:_SLOTS, tokens:width] = 0
    packed[_SLOTS, tokens:width] = -1
    packed[_FEED, :width] = -1
    if feed is not None:
        packed[_FEED, host["query_start_loc"][:n]] = feed
    packed[_SEQ_LENS, :n] = host["seq_lens"]
    packed[_SEQ_LENS, n:rows] = 0
    packed[_QUERY_START, :n + 1] = host["query_start_loc"]
    packed[_QUERY_START, n + 1:rows + 1] = tokens


class StepGraphs:
    """The graphs of ``model`` over ``kv_cache`` for steps of at most ``max_query_len`` tokens
    a row, one per shape of ``shapes`` (ascending), captured into the memory pool ``pool``
    (None: a new one). ``row_logits``: a graph returns the logits of each row's last token,
    else of every token row. ``sampled``: the device tensor of the last step's sampled tokens,
    which a step's ``feed`` rows read as their input ids."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, sampled: torch.Tensor,
                 max_model_len: int, max_blocks_per_seq: int, shapes: list[Shape],
                 max_query_len: int = 1, row_logits: bool = False,
                 pool: tuple[int, int] | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampled = sampled
        self.max_model_len = max_model_len
        self.shapes = shapes
        self.max_query_len = max_query_len
        self.row_logits = row_logits
        self.graphs: dict[Shape, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        max_rows, max_tokens = max(r for r, _ in shapes), max(t for _, t in shapes)
        dev = kv_cache.device
        self.buffers = {
            "input_ids": torch.zeros(max_tokens, dtype=torch.long, device=dev),
            "positions": torch.zeros(max_tokens, dtype=torch.long, device=dev),
            "slot_mapping": torch.full((max_tokens,), -1, dtype=torch.long, device=dev),
            "block_tables": torch.zeros(max_rows, max_blocks_per_seq, dtype=torch.int32,
                                        device=dev),
            "seq_lens": torch.zeros(max_rows, dtype=torch.int32, device=dev),
            "query_start_loc": torch.arange(max_rows + 1, dtype=torch.int32, device=dev),
        }
        self.attn_out = torch.zeros(max_tokens, model.num_heads, model.head_dim,
                                    dtype=model.dtype, device=dev)
        # pinned mirrors of the small buffers (pack_step's rows) and of the block tables, and
        # their device landing places
        width = max(max_tokens, max_rows) + 1
        self.pinned = torch.zeros(6, width, dtype=torch.long).pin_memory()
        self.pinned_tables = torch.zeros(max_rows * max_blocks_per_seq,
                                         dtype=torch.int32).pin_memory()
        self.pinned_np = self.pinned.numpy()
        self.pinned_tables_np = self.pinned_tables.numpy()
        self.packed = torch.zeros(6, width, dtype=torch.long, device=dev)
        self.packed_tables = torch.zeros(max_rows * max_blocks_per_seq, dtype=torch.int32,
                                         device=dev)
        self.copied = torch.cuda.Event()
        self.copied.record()
        self.pool = self._capture(pool)

    def shape_for(self, rows: int, tokens: int) -> Shape | None:
        """The smallest shape holding ``rows`` rows of ``tokens`` token rows, or None."""
        for shape in self.shapes:
            if shape[0] >= rows and shape[1] >= tokens:
                return shape
        return None

    def _capture(self, pool: tuple[int, int] | None) -> tuple[int, int]:
        start = time.perf_counter()
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(warm):
            for shape in self.shapes:  # JIT-compiles every kernel variant the graphs will use
                self._spread_queries(shape)
                self.forward(shape)
        torch.cuda.current_stream().wait_stream(warm)
        torch.cuda.synchronize()
        with torch.inference_mode():
            for shape in reversed(self.shapes):  # largest first: smaller graphs reuse its pool
                self._spread_queries(shape)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.forward(shape)
                pool = graph.pool()
                self.graphs[shape] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs of steps of up to %d tokens a row (%s..%s) in "
                    "%.1fs", len(self.shapes), self.max_query_len, self.shapes[0],
                    self.shapes[-1], time.perf_counter() - start)
        assert pool is not None
        return pool

    def _spread_queries(self, shape: Shape) -> None:
        """Query starts that keep the capture-time forward of ``shape`` inside its tokens."""
        rows, tokens = shape
        if self.max_query_len > 1:
            starts = torch.arange(rows + 1, device=self.kv_cache.device) * (tokens // rows)
            self.buffers["query_start_loc"][:rows + 1].copy_(starts)

    def forward(self, shape: Shape) -> torch.Tensor:
        """The logits of the buffers' first ``shape = (rows, tokens)`` rows and token rows, run
        eagerly (what the graph of ``shape`` captured)."""
        (rows, tokens), g = shape, self.buffers
        kernels, starts = self.model.kernels, g["query_start_loc"][:rows + 1]
        meta = AttentionMetadata(
            slot_mapping=g["slot_mapping"][:tokens],
            block_tables=g["block_tables"][:rows],
            seq_lens=g["seq_lens"][:rows],
            query_start_loc=starts,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_model_len,
            attn_out=self.attn_out[:tokens],
            row_order=kernels.decode_row_order(g["seq_lens"][:rows]),
            extend_tiles=(kernels.extend_tiles(starts, tokens) if self.max_query_len > 1
                          else None),
        )
        hidden = self.model.forward(g["input_ids"][:tokens], g["positions"][:tokens], meta,
                                    self.kv_cache)
        if self.row_logits:  # each row's last token (a padding row: the step's last token)
            hidden = hidden[(starts[1:] - 1).clamp_(min=0).long()]
        return self.model.compute_logits(hidden)

    def load(self, host: dict[str, np.ndarray], shape: Shape, feed: np.ndarray | None) -> None:
        """Put a step's ``host`` metadata into the buffers of ``shape`` (:func:`pack_step`);
        ``feed[i] >= 0``: row ``i``'s first input id is ``sampled[feed[i]]``."""
        self.copied.synchronize()
        rows, width = shape
        n = len(host["seq_lens"])
        pack_step(self.pinned_np, host, shape, feed)
        table_width = host["block_tables"].shape[1]
        size = n * table_width
        self.pinned_tables_np[:size] = host["block_tables"].reshape(-1)
        g = self.buffers
        columns = max(width, rows) + 1
        self.packed[:, :columns].copy_(self.pinned[:, :columns], non_blocking=True)
        self.packed_tables[:size].copy_(self.pinned_tables[:size], non_blocking=True)
        self.copied.record()
        g["block_tables"][:n, :table_width].copy_(self.packed_tables[:size].view(n, table_width))
        ids = g["input_ids"][:width]
        ids.copy_(self.packed[_IDS, :width])
        if feed is not None:
            src = self.packed[_FEED, :width]
            ids.copy_(torch.where(src >= 0, self.sampled[src.clamp(min=0)], ids))
        g["positions"][:width].copy_(self.packed[_POSITIONS, :width])
        g["slot_mapping"][:width].copy_(self.packed[_SLOTS, :width])
        g["seq_lens"][:rows].copy_(self.packed[_SEQ_LENS, :rows])
        if self.max_query_len > 1:  # one token a row: the starts are the buffer's arange
            g["query_start_loc"][:rows + 1].copy_(self.packed[_QUERY_START, :rows + 1])

    def replay(self, shape: Shape) -> torch.Tensor:
        """Replay the graph of ``shape``; returns its static logits (``[tokens, vocab]``, or
        ``[rows, vocab]`` with ``row_logits``), valid until the next replay."""
        graph, logits = self.graphs[shape]
        graph.replay()
        return logits


def capture_step_graphs(model: LlamaModel, kv_cache: torch.Tensor, sampled: torch.Tensor,
                        max_model_len: int, max_blocks_per_seq: int, max_num_seqs: int,
                        max_num_batched_tokens: int, speculative_config: dict | None
                        ) -> tuple[StepGraphs, StepGraphs | None, StepGraphs]:
    """The decode graphs, with speculative decoding the verify graphs (batch sizes up to
    ``disable_by_batch_size``, K + 1 tokens a row; no drafts past it), and the mixed graphs,
    all in one memory pool."""
    decode = StepGraphs(model, kv_cache, sampled, max_model_len, max_blocks_per_seq,
                        [(b, b) for b in graph_batch_sizes(max_num_seqs)])
    verify = None
    if speculative_config is not None:
        spec = SpeculativeConfig.from_dict(speculative_config)
        q = spec.num_speculative_tokens + 1
        sizes = graph_batch_sizes(min(max_num_seqs, spec.disable_by_batch_size))
        verify = StepGraphs(model, kv_cache, sampled, max_model_len, max_blocks_per_seq,
                            [(b, b * q) for b in sizes], max_query_len=q, pool=decode.pool)
    mixed = StepGraphs(model, kv_cache, sampled, max_model_len, max_blocks_per_seq,
                       mixed_shapes(max_num_seqs, max_num_batched_tokens),
                       max_query_len=max_num_batched_tokens, row_logits=True,
                       pool=(verify or decode).pool)
    return decode, verify, mixed
