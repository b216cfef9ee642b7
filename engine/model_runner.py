"""Turns a scheduled batch into kernel inputs, owns the KV cache tensor, runs the model.

Host side: every step's metadata (token ids, positions, slot mapping, block tables, sequence
lengths, query offsets) is built with numpy and copied to the device without waiting; the only
host synchronisation per step is the sampler reading the sampled tokens.

CUDA graphs (CUDA only, off with ``EngineConfig.enforce_eager``): a pure-decode step (every row
has one new token) of up to the largest captured batch size replays the decode graph of the
next padded batch size; with speculative decoding, a step whose rows have at most K + 1 new
tokens (a verify) and that fits the largest verify graph (``disable_by_batch_size`` rows)
replays a verify graph; any other step without drafts of at most 256 rows (a prompt chunk
among decode rows) replays the mixed graph of its padded token count
(``engine/cuda_graphs.py``). Other steps run eagerly.

An FP8 KV cache (``kv_cache_dtype="fp8"``) gets its per-layer scales at start-up, before any
graph is captured: a forward pass over ``CALIBRATION_TOKENS`` seeded random token ids into a
model-dtype scratch cache, each scale ``FP8_HEADROOM`` × the layer's largest |K| (|V|) over the
FP8 maximum. Larger values saturate rather than overflow.
"""

import logging
import math
import os

import numpy as np
import torch

from chatgate_kernels.reference import FP8, FP8_MAX
from engine.config import EngineConfig
from engine.cuda_graphs import Shape, StepGraphs, capture_step_graphs
from engine.model import AttentionMetadata, LlamaModel
from engine.scheduler import ScheduledBatch
from engine.step_timing import NO_CLOCK, NoClock, StepClock
from engine.tensor_parallel import TensorParallel

logger = logging.getLogger("engine.model_runner")

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
CALIBRATION_TOKENS = 512
FP8_HEADROOM = 2.0


def one_host_thread() -> None:
    """Run torch's host-side ops on one thread, unless ``OMP_NUM_THREADS`` says otherwise (as
    vLLM's GPU workers do). A GPU engine's host tensors are a few rows of metadata, and torch's
    pool of intra-op threads, which spin for a while after every parallel op, takes the cores
    that the grammar worker's xgrammar threads fill masks on: on the H200's 16-core host, with
    16 torch threads, a few mask fills a run stalled for 3-6 ms (``docs/benchmarks.md`` section
    6)."""
    if "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() != 1:
        logger.info("torch host threads: %d -> 1 (a GPU engine; set OMP_NUM_THREADS to choose)",
                    torch.get_num_threads())
        torch.set_num_threads(1)


class ModelRunner:
    """``tp``: this process's rank of a tensor-parallel group (rank 0 runs the engine and
    sends each step's inputs to the others, which run :meth:`run_step` on them). The KV cache
    holds ``model.kv_cache_dtype``, the dtype the model's kernels were chosen for."""

    def __init__(self, model: LlamaModel, config: EngineConfig, max_model_len: int,
                 tp: TensorParallel | None = None) -> None:
        self.model = model
        self.tp = tp
        self.block_size = config.block_size
        self.device = model.device
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.cache_dtype = model.kv_cache_dtype  # the one its kernels were chosen for
        self.num_blocks = self._num_blocks(config, max_model_len)
        logger.info("allocating the KV cache: %d blocks of %d tokens (%.2f GiB, %s)",
                    self.num_blocks, self.block_size,
                    self.num_blocks * self.bytes_per_block / 2**30, self.cache_dtype)
        self.kv_cache = torch.zeros(self.cache_shape(self.num_blocks), dtype=self.cache_dtype,
                                    device=self.device)
        if self.cache_dtype == FP8:
            model.kv_scales = self._calibrate_kv_scales()
        # the last overlapped step's sampled tokens, which the next step reads as inputs
        # (``execute``'s ``feed``), and double-buffered host copies of them
        self.sampled = torch.zeros(config.max_num_seqs, dtype=torch.long, device=self.device)
        self._sampled_host = torch.zeros(2, config.max_num_seqs, dtype=torch.long,
                                         pin_memory=self.device.type == "cuda")
        self._sampled_turn = 0
        self.decode_graphs: StepGraphs | None = None
        self.verify_graphs: StepGraphs | None = None
        self.mixed_graphs: StepGraphs | None = None
        # the padded size of the decode graph whose logits the last step returned (every row
        # sampled), else None
        self.last_graph_size: int | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.decode_graphs, self.verify_graphs, self.mixed_graphs = capture_step_graphs(
                model, self.kv_cache, self.sampled, max_model_len, self.max_blocks_per_seq,
                config.max_num_seqs, config.max_num_batched_tokens, config.speculative_config)
        if self.device.type == "cuda":
            one_host_thread()

    def _step_graphs(self, host: dict[str, np.ndarray]) -> tuple[StepGraphs, Shape] | None:
        """The graphs that run the step ``host`` and the shape it replays, or None (eager)."""
        if host["block_tables"].shape[1] > self.max_blocks_per_seq:
            return None
        rows, tokens = len(host["seq_lens"]), int(host["query_start_loc"][-1])
        candidates = [self.decode_graphs, self.verify_graphs]
        if "num_drafts" not in host:  # the mixed graphs give a row's last logits alone
            candidates.append(self.mixed_graphs)
        for graphs in candidates:
            if graphs is not None and host["max_query_len"] <= graphs.max_query_len:
                shape = graphs.shape_for(rows, tokens)
                if shape is not None:
                    return graphs, shape
        return None

    @property
    def graphs(self) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
        """The captured decode graphs and their static logits, by padded batch size (none
        without CUDA graphs)."""
        if self.decode_graphs is None:
            return {}
        return {rows: graph for (rows, _), graph in self.decode_graphs.graphs.items()}

    @property
    def graph_sizes(self) -> list[int]:
        """The batch sizes of the captured decode graphs, ascending."""
        return [rows for rows, _ in self.decode_graphs.shapes] if self.decode_graphs else []

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The KV cache's shape with ``num_blocks`` blocks: ``[2, num_layers, num_blocks,
        block_size, num_kv_heads, head_dim]``."""
        m = self.model
        return (2, len(m.layers), num_blocks, self.block_size, m.num_kv_heads, m.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return math.prod(self.cache_shape(1)) * self.cache_dtype.itemsize

    def _num_blocks(self, config: EngineConfig, max_model_len: int) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if self.tp is not None:  # every rank's pool has the same blocks: the smallest one's
            return self.tp.min_over_ranks(self._budget_blocks(config, max_model_len))
        return self._budget_blocks(config, max_model_len)

    def _budget_blocks(self, config: EngineConfig, max_model_len: int) -> int:
        if config.kv_cache_bytes is not None:
            budget = config.kv_cache_bytes
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget(config, max_model_len)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of "
                             f"{self.bytes_per_block} bytes")
        return int(num_blocks)

    def _profile_cuda_budget(self, config: EngineConfig, max_model_len: int) -> int:
        """Device memory × utilisation, minus what is in use and the activation peak of a
        forward pass over ``max_num_batched_tokens`` tokens."""
        num_tokens = config.max_num_batched_tokens
        # as many sequences of at most max_model_len tokens as one step's token budget holds
        lens = [min(max_model_len, num_tokens - start)
                for start in range(0, num_tokens, max_model_len)]
        per_seq = [-(-n // self.block_size) for n in lens]
        blocks = sum(per_seq)
        m = self.model
        scratch = torch.zeros(self.cache_shape(blocks), dtype=self.cache_dtype,
                              device=self.device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        meta, position_ids = self.prefill_batch(lens)
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            hidden = m.forward(ids, position_ids, meta, scratch)
            m.compute_logits(hidden[-min(num_tokens, config.max_num_seqs):])
        torch.cuda.synchronize()
        activation_peak = torch.cuda.max_memory_allocated() - before
        del scratch, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        in_use = total - free
        budget = int(total * config.gpu_memory_utilization - in_use - activation_peak)
        logger.info("GPU memory: %.1f GiB total, %.1f GiB in use, activation peak %.2f GiB, "
                    "KV budget %.1f GiB at gpu_memory_utilization %.2f", total / 2**30,
                    in_use / 2**30, activation_peak / 2**30, budget / 2**30,
                    config.gpu_memory_utilization)
        return budget

    def prefill_batch(self, lens: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        """Kernel inputs and positions of sequences of ``lens`` tokens prefilled from scratch
        into consecutive blocks from block 0 (the start-up forward passes)."""
        bs = self.block_size
        per_seq = [-(-n // bs) for n in lens]
        first_block = np.cumsum([0] + per_seq[:-1])
        tables = np.zeros((len(lens), max(per_seq)), dtype=np.int32)
        for i, blocks in enumerate(per_seq):
            tables[i, :blocks] = np.arange(blocks) + first_block[i]
        positions = np.concatenate([np.arange(n) for n in lens])
        block_tables = self._to_device(tables)
        seq_lens = self._to_device(np.asarray(lens, dtype=np.int32))
        query_start_loc = self._to_device(np.cumsum([0] + lens).astype(np.int32))
        slot_mapping = self._to_device(np.repeat(first_block * bs, lens) + positions)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
            max_query_len=max(lens), max_seq_len=max(lens),
            plan=self.model.kernels.attention_plan(block_tables, seq_lens, query_start_loc,
                                                   slot_mapping, bs, self.model.num_kv_heads),
        )
        return meta, self._to_device(positions)

    @torch.inference_mode()
    def _calibrate_kv_scales(self) -> list[tuple[float, float]]:
        """Each layer's FP8 ``(k_scale, v_scale)`` from one forward pass (module docstring)."""
        m = self.model
        n = min(CALIBRATION_TOKENS, self.max_model_len)
        scratch = torch.zeros(self.cache_shape(-(-n // self.block_size)), dtype=m.dtype,
                              device=self.device)
        vocab = m.vocab_limit or m.vocab_size
        ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0))
        meta, positions = self.prefill_batch([n])
        m.forward(ids.to(self.device), positions, meta, scratch)
        amax = scratch.abs().amax(dim=(2, 3, 4, 5)).float()  # [2, num_layers]
        scales = (amax * FP8_HEADROOM / FP8_MAX).clamp_min(1e-6).tolist()
        logger.info("FP8 KV scales: k %.3g..%.3g, v %.3g..%.3g", min(scales[0]), max(scales[0]),
                    min(scales[1]), max(scales[1]))
        return list(zip(scales[0], scales[1], strict=True))

    # -- host-side metadata ------------------------------------------------------------------

    def host_metadata(self, batch: ScheduledBatch) -> dict[str, np.ndarray]:
        """Kernel inputs of one step as numpy arrays (see ``chatgate_kernels/__init__.py``)."""
        seqs = batch.seqs
        n = len(seqs)
        bs = self.block_size
        num_new = np.asarray(batch.num_new_tokens, dtype=np.int64)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
        ends = starts + num_new
        width = max(len(s.block_table) for s in seqs)
        tables = np.zeros((n, width), dtype=np.int32)
        for i, seq in enumerate(seqs):
            tables[i, :len(seq.block_table)] = seq.block_table
        query_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start[1:])
        if int(num_new.max()) == 1 and int(num_new.min()) == 1:
            positions = starts
            rows = np.arange(n)
            pairs = zip(seqs, starts.tolist(), strict=True)
            input_ids = np.fromiter((s.token_ids[p] for s, p in pairs), dtype=np.int64, count=n)
        else:
            total = int(query_start[-1])
            rows = np.repeat(np.arange(n), num_new)
            positions = np.arange(total, dtype=np.int64) - np.repeat(query_start[:-1] - starts,
                                                                    num_new)
            ids: list[int] = []
            for seq, start, end in zip(seqs, starts.tolist(), ends.tolist(), strict=True):
                tokens = seq.token_ids
                if end > len(tokens):  # a speculative step: the drafts follow
                    tokens = tokens + seq.draft_token_ids
                ids.extend(tokens[start:end])
            input_ids = np.asarray(ids, dtype=np.int64)
        slots = tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
        host = {"input_ids": input_ids, "positions": positions, "slot_mapping": slots,
                "block_tables": tables, "seq_lens": ends.astype(np.int32),
                "query_start_loc": query_start.astype(np.int32), "max_query_len":
                int(num_new.max()), "max_seq_len": int(ends.max())}
        if any(s.draft_token_ids for s in seqs):
            host["num_drafts"] = np.fromiter((len(s.draft_token_ids) for s in seqs),
                                             dtype=np.int64, count=n)
        return host

    # -- execution ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, sample_indices: list[int],
                feed: np.ndarray | None = None, host: dict[str, np.ndarray] | None = None,
                clock: StepClock | NoClock = NO_CLOCK) -> torch.Tensor:
        """Run one step; returns the logits (model dtype) of the sequences at ``sample_indices``
        (``1 + len(draft_token_ids)`` rows for a speculative one: :meth:`logit_rows`).

        ``feed[i] >= 0``: sequence ``i`` is decoding a token the host has not read yet, row
        ``feed[i]`` of :meth:`keep_sampled`'s last tokens, taken on the device. ``host``: the
        batch's :meth:`host_metadata`, if already made. ``clock``: the step's timing, which
        notes (and on CUDA times) a graph replay. On the CUDA-graph path the result is a view
        of the graph's static output: read it (the sampler does) before the next ``execute``."""
        if host is None:
            host = self.host_metadata(batch)
        if self.tp is None:
            return self.run_step(host, batch.copies, sample_indices, feed, clock)
        self.tp.broadcast_step((host, batch.copies, sample_indices))
        try:
            return self.run_step(host, batch.copies, sample_indices, feed, clock)
        except RuntimeError:  # a collective failed: a worker gone shows as WorkerDied
            self.tp.check_workers(wait_s=1.0)
            raise

    @torch.inference_mode()
    def run_step(self, host: dict[str, np.ndarray], copies: list[tuple[int, int]],
                 sample_indices: list[int], feed: np.ndarray | None = None,
                 clock: StepClock | NoClock = NO_CLOCK) -> torch.Tensor:
        """:meth:`execute` from the step's host metadata (what a tensor-parallel worker gets):
        block copies first, then the forward."""
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            raw = self.kv_cache.view(torch.uint8)  # no FP8 indexing kernels; bytes copy alike
            raw[:, :, dst] = raw[:, :, src]
        n = len(host["seq_lens"])
        chosen = self._step_graphs(host)
        self.last_graph_size = None
        if chosen is not None and chosen[0] is self.decode_graphs:
            graphs, shape = chosen
            graphs.load(host, shape, feed)
            padded = shape[0]
            logits = clock.replay_graph(padded, lambda _: graphs.replay(shape))[:n]
            if sample_indices != list(range(n)):
                return logits[self._to_device(np.asarray(sample_indices, dtype=np.int64))]
            self.last_graph_size = padded
            return logits
        if chosen is not None:
            graphs, shape = chosen
            graphs.load(host, shape, feed)
            rows = (np.asarray(sample_indices, dtype=np.int64) if graphs.row_logits
                    else self.logit_rows(host, sample_indices))
            return graphs.replay(shape)[self._to_device(rows)]
        block_tables = self._to_device(host["block_tables"])
        seq_lens = self._to_device(host["seq_lens"])
        query_start_loc = self._to_device(host["query_start_loc"])
        slot_mapping = self._to_device(host["slot_mapping"])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=host["max_query_len"],
            max_seq_len=host["max_seq_len"],
            plan=self.model.kernels.attention_plan(block_tables, seq_lens, query_start_loc,
                                                   slot_mapping, self.block_size,
                                                   self.model.num_kv_heads),
            row_order=self.model.kernels.decode_row_order(seq_lens),
            extend_tiles=(self.model.kernels.extend_tiles(query_start_loc,
                                                          len(host["input_ids"]))
                          if host["max_query_len"] > 1 else None),
        )
        input_ids = self._to_device(host["input_ids"])
        if feed is not None:
            rows = np.flatnonzero(feed >= 0)
            dst = host["query_start_loc"][rows].astype(np.int64)
            input_ids[self._to_device(dst)] = self.sampled[self._to_device(feed[rows])]
        hidden = self.model.forward(input_ids, self._to_device(host["positions"]), meta,
                                    self.kv_cache)
        return self.model.compute_logits(hidden[self._to_device(
            self.logit_rows(host, sample_indices))])

    @staticmethod
    def logit_rows(host: dict[str, np.ndarray], sample_indices: list[int]) -> np.ndarray:
        """The query rows whose logits a step returns: each sampled sequence's last one,
        preceded by one per draft of a speculative sequence (its drafts' positions, in order)."""
        last = host["query_start_loc"][1:].astype(np.int64)[sample_indices] - 1
        if "num_drafts" not in host:
            return last
        drafts = host["num_drafts"][sample_indices]
        return np.repeat(last - drafts, drafts + 1) + (
            np.arange(int((drafts + 1).sum())) - np.repeat(np.cumsum(drafts + 1) - drafts - 1,
                                                           drafts + 1))

    def keep_sampled(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Keep a step's sampled ``tokens`` on the device for the next step's ``feed`` and
        start their copy to the host. Returns the host tensor and the event after which it
        holds them (None on CPU, where it already does); it stays valid until the call after
        next (two host buffers take turns)."""
        n = tokens.shape[0]
        self.sampled[:n].copy_(tokens)
        host = self._sampled_host[self._sampled_turn, :n]
        self._sampled_turn ^= 1
        if self.device.type == "cpu":
            host.copy_(tokens)
            return host, None
        host.copy_(self.sampled[:n], non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cpu":
            return tensor
        return tensor.to(self.device, non_blocking=True)
