"""Decode CUDA graphs: one per padded batch size, over static input buffers.

A pure-decode step (every row has one new token) of up to the largest captured batch size
replays the graph captured at the next padded batch size (:func:`graph_batch_sizes`). The graph
reads static buffers: padding rows have slot ``-1`` (nothing written), ``seq_len`` 0 (attention
yields zeros) and block-table rows that hold valid ids; block tables are ``ceil(max_model_len /
block_size)`` wide, and attention is captured with ``max_seq_len = max_model_len``, so one graph
serves every context length. A step's inputs reach the buffers through pinned host mirrors,
copied in one go; an event guards the mirrors' reuse.
"""

import logging
import time

import numpy as np
import torch

from engine.model import AttentionMetadata, LlamaModel

logger = logging.getLogger("engine.cuda_graphs")

MAX_GRAPH_BATCH_SIZE = 256


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH_SIZE) -> list[int]:
    """Decode batch sizes to capture: 1, 2, 4, 8, then every multiple of 8 up to
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


class DecodeGraphs:
    """The decode graphs of ``model`` over ``kv_cache``, captured at ``sizes`` (ascending).
    ``sampled``: the device tensor of the last step's sampled tokens, which a step's ``feed``
    rows read as their input ids."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, sampled: torch.Tensor,
                 max_model_len: int, max_blocks_per_seq: int, sizes: list[int]) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampled = sampled
        self.max_model_len = max_model_len
        self.sizes = sizes
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        max_bs, dev = sizes[-1], kv_cache.device
        self.buffers = {
            "input_ids": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.long, device=dev),
            "block_tables": torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32,
                                        device=dev),
            "seq_lens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            "query_start_loc": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
        }
        self.attn_out = torch.zeros(max_bs, model.num_heads, model.head_dim, dtype=model.dtype,
                                    device=dev)
        # pinned mirrors of the small buffers (ids, positions, slots, seq lens, feed rows) and
        # of the block tables, and their device landing places
        self.pinned = torch.zeros(5, max_bs + 1, dtype=torch.long).pin_memory()
        self.pinned_tables = torch.zeros(max_bs * max_blocks_per_seq,
                                         dtype=torch.int32).pin_memory()
        self.pinned_np = self.pinned.numpy()
        self.pinned_tables_np = self.pinned_tables.numpy()
        self.packed = torch.zeros(5, max_bs + 1, dtype=torch.long, device=dev)
        self.packed_tables = torch.zeros(max_bs * max_blocks_per_seq, dtype=torch.int32,
                                         device=dev)
        self.copied = torch.cuda.Event()
        self.copied.record()
        self._capture()

    def _capture(self) -> None:
        start = time.perf_counter()
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(warm):
            for size in self.sizes:  # JIT-compiles every kernel variant the graphs will use
                self.forward(size)
        torch.cuda.current_stream().wait_stream(warm)
        torch.cuda.synchronize()
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.forward(size)
                pool = graph.pool()
                self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1fs", len(self.sizes),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - start)

    def forward(self, size: int) -> torch.Tensor:
        """The logits of the buffers' first ``size`` rows, run eagerly (what the graph of
        ``size`` captured)."""
        g = self.buffers
        meta = AttentionMetadata(
            slot_mapping=g["slot_mapping"][:size],
            block_tables=g["block_tables"][:size],
            seq_lens=g["seq_lens"][:size],
            query_start_loc=g["query_start_loc"][:size + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            attn_out=self.attn_out[:size],
            row_order=self.model.kernels.decode_row_order(g["seq_lens"][:size]),
        )
        hidden = self.model.forward(g["input_ids"][:size], g["positions"][:size], meta,
                                    self.kv_cache)
        return self.model.compute_logits(hidden)

    def load(self, host: dict[str, np.ndarray], n: int, padded: int,
             feed: np.ndarray | None) -> None:
        """Put a decode step's ``n`` rows of ``host`` metadata into the buffers, rows ``n`` to
        ``padded`` as padding; ``feed[i] >= 0``: row ``i``'s input id is ``sampled[feed[i]]``."""
        self.copied.synchronize()
        p = self.pinned_np
        p[0, :n] = host["input_ids"]
        p[1, :n] = host["positions"]
        p[2, :n] = host["slot_mapping"]
        p[3, :n] = host["seq_lens"]
        p[4, :n] = -1 if feed is None else feed
        p[0:2, n:padded] = 0
        p[2, n:padded] = -1
        p[3, n:padded] = 0
        p[4, n:padded] = -1
        width = host["block_tables"].shape[1]
        size = n * width
        self.pinned_tables_np[:size] = host["block_tables"].reshape(-1)
        g = self.buffers
        self.packed[:, :padded].copy_(self.pinned[:, :padded], non_blocking=True)
        self.packed_tables[:size].copy_(self.pinned_tables[:size], non_blocking=True)
        self.copied.record()
        g["block_tables"][:n, :width].copy_(self.packed_tables[:size].view(n, width))
        g["input_ids"][:padded].copy_(self.packed[0, :padded])
        if feed is not None:
            src = self.packed[4, :padded]
            ids = g["input_ids"][:padded]
            ids.copy_(torch.where(src >= 0, self.sampled[src.clamp(min=0)], ids))
        g["positions"][:padded].copy_(self.packed[1, :padded])
        g["slot_mapping"][:padded].copy_(self.packed[2, :padded])
        g["seq_lens"][:padded].copy_(self.packed[3, :padded])

    def replay(self, padded: int) -> torch.Tensor:
        """Replay the graph of batch size ``padded``; returns its static logits
        ``[padded, vocab]``, valid until the next replay."""
        graph, logits = self.graphs[padded]
        graph.replay()
        return logits
