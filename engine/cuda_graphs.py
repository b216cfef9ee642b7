"""Step CUDA graphs: one per padded batch size, over static input buffers.

A set of graphs serves steps whose rows each have at most ``query_len`` new tokens: the decode
graphs (``query_len`` 1, every row one token) and the verify graphs of speculative decoding
(``query_len`` K + 1: a row's last token and its drafts). A step of ``n`` rows replays the
graph captured at the next padded batch size ``padded`` (:func:`graph_batch_sizes`), which runs
``padded * query_len`` token rows: the step's tokens first, then padding. The graph reads static
buffers: padding tokens have slot ``-1`` (nothing written), padding rows ``seq_len`` 0 and no
query tokens (attention skips them), and block-table rows that hold valid ids; block tables are
``ceil(max_model_len / block_size)`` wide, and attention is captured with ``max_seq_len =
max_model_len`` and ``max_query_len = query_len``, so one graph serves every context length.
A step's inputs reach the buffers through pinned host mirrors, copied in one go; an event
guards the mirrors' reuse.
"""

import logging
import time

import numpy as np
import torch

from engine.config import SpeculativeConfig
from engine.model import AttentionMetadata, LlamaModel

logger = logging.getLogger("engine.cuda_graphs")

MAX_GRAPH_BATCH_SIZE = 256
# rows of the packed host mirror: token rows (ids, positions, slots, the feed per token), then
# row rows (sequence lengths, query starts)
_IDS, _POSITIONS, _SLOTS, _FEED, _SEQ_LENS, _QUERY_START = range(6)


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


def pack_step(packed: np.ndarray, host: dict[str, np.ndarray], padded: int, query_len: int,
              feed: np.ndarray | None) -> None:
    """Write a step's ``host`` metadata (``ModelRunner.host_metadata``'s form) into the packed
    mirror ``packed [6, >= padded * query_len + 1]``: token columns ``0..padded * query_len``
    (the step's tokens, then padding: id 0, position 0, slot -1), row columns ``0..padded``
    (padding rows: ``seq_len`` 0, no tokens) and ``padded`` + 1 query starts. The feed column of
    a token is ``feed[i]`` at row ``i``'s first token (its input id is ``sampled[feed[i]]``),
    else -1."""
    n = len(host["seq_lens"])
    tokens = int(host["query_start_loc"][n])
    width = padded * query_len
    packed[_IDS, :tokens] = host["input_ids"]
    packed[_POSITIONS, :tokens] = host["positions"]
    packed[_SLOTS, :tokens] = host["slot_mapping"]
    packed[_IDS:_SLOTS, tokens:width] = 0
    packed[_SLOTS, tokens:width] = -1
    packed[_FEED, :width] = -1
    if feed is not None:
        packed[_FEED, host["query_start_loc"][:n]] = feed
    packed[_SEQ_LENS, :n] = host["seq_lens"]
    packed[_SEQ_LENS, n:padded] = 0
    packed[_QUERY_START, :n + 1] = host["query_start_loc"]
    packed[_QUERY_START, n + 1:padded + 1] = tokens


class StepGraphs:
    """The graphs of ``model`` over ``kv_cache`` for steps of at most ``query_len`` tokens a
    row, captured at ``sizes`` (ascending) into the memory pool ``pool`` (None: a new one).
    ``sampled``: the device tensor of the last step's sampled tokens, which a step's ``feed``
    rows read as their input ids."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, sampled: torch.Tensor,
                 max_model_len: int, max_blocks_per_seq: int, sizes: list[int],
                 query_len: int = 1, pool: tuple[int, int] | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampled = sampled
        self.max_model_len = max_model_len
        self.sizes = sizes
        self.query_len = query_len
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        max_bs, dev = sizes[-1], kv_cache.device
        max_tokens = max_bs * query_len
        self.buffers = {
            "input_ids": torch.zeros(max_tokens, dtype=torch.long, device=dev),
            "positions": torch.zeros(max_tokens, dtype=torch.long, device=dev),
            "slot_mapping": torch.full((max_tokens,), -1, dtype=torch.long, device=dev),
            "block_tables": torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32,
                                        device=dev),
            "seq_lens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            "query_start_loc": torch.arange(0, max_tokens + 1, query_len, dtype=torch.int32,
                                            device=dev),
        }
        self.attn_out = torch.zeros(max_tokens, model.num_heads, model.head_dim,
                                    dtype=model.dtype, device=dev)
        # pinned mirrors of the small buffers (pack_step's rows) and of the block tables, and
        # their device landing places
        self.pinned = torch.zeros(6, max_tokens + 1, dtype=torch.long).pin_memory()
        self.pinned_tables = torch.zeros(max_bs * max_blocks_per_seq,
                                         dtype=torch.int32).pin_memory()
        self.pinned_np = self.pinned.numpy()
        self.pinned_tables_np = self.pinned_tables.numpy()
        self.packed = torch.zeros(6, max_tokens + 1, dtype=torch.long, device=dev)
        self.packed_tables = torch.zeros(max_bs * max_blocks_per_seq, dtype=torch.int32,
                                         device=dev)
        self.copied = torch.cuda.Event()
        self.copied.record()
        self.pool = self._capture(pool)

    def _capture(self, pool: tuple[int, int] | None) -> tuple[int, int]:
        start = time.perf_counter()
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(warm):
            for size in self.sizes:  # JIT-compiles every kernel variant the graphs will use
                self.forward(size)
        torch.cuda.current_stream().wait_stream(warm)
        torch.cuda.synchronize()
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.forward(size)
                pool = graph.pool()
                self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs of %d-token rows (batch %d..%d) in %.1fs",
                    len(self.sizes), self.query_len, self.sizes[0], self.sizes[-1],
                    time.perf_counter() - start)
        assert pool is not None
        return pool

    def forward(self, size: int) -> torch.Tensor:
        """The logits of the buffers' first ``size`` rows (``size * query_len`` token rows),
        run eagerly (what the graph of ``size`` captured)."""
        g, tokens = self.buffers, size * self.query_len
        meta = AttentionMetadata(
            slot_mapping=g["slot_mapping"][:tokens],
            block_tables=g["block_tables"][:size],
            seq_lens=g["seq_lens"][:size],
            query_start_loc=g["query_start_loc"][:size + 1],
            max_query_len=self.query_len,
            max_seq_len=self.max_model_len,
            attn_out=self.attn_out[:tokens],
            row_order=self.model.kernels.decode_row_order(g["seq_lens"][:size]),
        )
        hidden = self.model.forward(g["input_ids"][:tokens], g["positions"][:tokens], meta,
                                    self.kv_cache)
        return self.model.compute_logits(hidden)

    def load(self, host: dict[str, np.ndarray], n: int, padded: int,
             feed: np.ndarray | None) -> None:
        """Put a step's ``n`` rows of ``host`` metadata into the buffers, rows ``n`` to
        ``padded`` as padding (:func:`pack_step`); ``feed[i] >= 0``: row ``i``'s first input id
        is ``sampled[feed[i]]``."""
        self.copied.synchronize()
        width = padded * self.query_len
        pack_step(self.pinned_np, host, padded, self.query_len, feed)
        table_width = host["block_tables"].shape[1]
        size = n * table_width
        self.pinned_tables_np[:size] = host["block_tables"].reshape(-1)
        g = self.buffers
        self.packed[:, :width + 1].copy_(self.pinned[:, :width + 1], non_blocking=True)
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
        g["seq_lens"][:padded].copy_(self.packed[_SEQ_LENS, :padded])
        if self.query_len > 1:  # one token a row: the starts are the buffer's arange
            g["query_start_loc"][:padded + 1].copy_(self.packed[_QUERY_START, :padded + 1])

    def replay(self, padded: int) -> torch.Tensor:
        """Replay the graph of batch size ``padded``; returns its static logits
        ``[padded * query_len, vocab]``, valid until the next replay."""
        graph, logits = self.graphs[padded]
        graph.replay()
        return logits


def capture_step_graphs(model: LlamaModel, kv_cache: torch.Tensor, sampled: torch.Tensor,
                        max_model_len: int, max_blocks_per_seq: int, max_num_seqs: int,
                        speculative_config: dict | None
                        ) -> tuple[StepGraphs, StepGraphs | None]:
    """The decode graphs and, with speculative decoding, the verify graphs (batch sizes up to
    ``disable_by_batch_size``, K + 1 tokens a row; no drafts past it) in the same memory pool."""
    decode = StepGraphs(model, kv_cache, sampled, max_model_len, max_blocks_per_seq,
                        graph_batch_sizes(max_num_seqs))
    if speculative_config is None:
        return decode, None
    spec = SpeculativeConfig.from_dict(speculative_config)
    verify = StepGraphs(model, kv_cache, sampled, max_model_len, max_blocks_per_seq,
                        graph_batch_sizes(min(max_num_seqs, spec.disable_by_batch_size)),
                        query_len=spec.num_speculative_tokens + 1, pool=decode.pool)
    return decode, verify
