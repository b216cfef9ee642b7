"""Turns a scheduled batch into kernel inputs, owns the KV cache tensor, runs the model.

Host side: every step's metadata (token ids, positions, slot mapping, block tables, sequence
lengths, query offsets) is built with numpy and copied to the device without waiting; the only
host synchronisation per step is the sampler reading the sampled tokens.

CUDA graphs (CUDA only, off with ``EngineConfig.enforce_eager``): a pure-decode step (every row
has one new token) of up to the largest captured batch size replays a graph captured at the
next padded batch size (:func:`graph_batch_sizes`). The graph reads static buffers: padding rows
have slot ``-1`` (nothing written), ``seq_len`` 0 (attention yields zeros) and block-table rows
that hold valid ids; block tables are ``ceil(max_model_len / block_size)`` wide, and attention
is captured with ``max_seq_len = max_model_len``, so one graph serves every context length.

An FP8 KV cache (``kv_cache_dtype="fp8"``) gets its per-layer scales at start-up, before any
graph is captured: a forward pass over ``CALIBRATION_TOKENS`` seeded random token ids into a
model-dtype scratch cache, each scale ``FP8_HEADROOM`` × the layer's largest |K| (|V|) over the
FP8 maximum. Larger values saturate rather than overflow.
"""

import logging
import math
import os
import time

import numpy as np
import torch

import chatgate_kernels
from engine.config import EngineConfig
from engine.device import torch_device, torch_dtype
from engine.loader import LoadedModel, load_model
from engine.model import AttentionMetadata, LlamaModel
from engine.scheduler import ScheduledBatch
from engine.tensor_parallel import Shard, TensorParallel, device_for_rank

logger = logging.getLogger("engine.model_runner")

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
MAX_GRAPH_BATCH_SIZE = 256
CALIBRATION_TOKENS = 512
FP8_HEADROOM = 2.0


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


def model_len(config: EngineConfig, loaded: LoadedModel) -> int:
    """The context length ``config`` asks for (default: the model's); ``ValueError`` past the
    model's ``max_position_embeddings``."""
    limit = loaded.config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                         f"max_position_embeddings {limit}")
    return config.max_model_len or limit


def load_for_rank(config: EngineConfig, rank: int = 0) -> LoadedModel:
    """``config.model`` loaded onto rank ``rank``'s device: its share of the weights when
    ``config.tensor_parallel_size`` > 1 (``ValueError`` if the model's sizes do not split)."""
    world_size = config.tensor_parallel_size
    return load_model(config.model, device_for_rank(torch_device(config), rank),
                      torch_dtype(config), seed=config.seed, use_cache=config.use_weight_cache,
                      tokenizer=config.tokenizer,
                      shard=Shard(rank, world_size) if world_size > 1 else None)


def build_runner(config: EngineConfig, tp: TensorParallel | None = None,
                 loaded: LoadedModel | None = None, own_weights: bool = False) -> "ModelRunner":
    """The model (this rank's shard of it under ``tp``) and its runner; loads the model unless
    ``loaded`` is given (whole, or this rank's shard). With ``own_weights`` (always when it
    loads the model itself) the weights are the runner's alone: ``loaded.state_dict`` is
    emptied, so the float weights that quantized layers replace are freed before the runner
    sizes the KV pool from the free device memory."""
    if loaded is None:
        loaded, own_weights = load_for_rank(config, tp.rank if tp is not None else 0), True
    max_model_len = model_len(config, loaded)
    weights = loaded.state_dict
    if own_weights:
        loaded.state_dict = {}
    if tp is not None and loaded.shard is None:
        weights = Shard(tp.rank, tp.world_size).weights(weights, loaded.config)
    model = LlamaModel(loaded.config, weights, max_model_len, vocab_limit=loaded.vocab_limit,
                       quantization=config.quantization, tp=tp)
    del weights  # what the model did not keep goes now
    return ModelRunner(model, config, max_model_len, tp)


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
    sends each step's inputs to the others, which run :meth:`run_step` on them)."""

    def __init__(self, model: LlamaModel, config: EngineConfig, max_model_len: int,
                 tp: TensorParallel | None = None) -> None:
        self.model = model
        self.tp = tp
        self.block_size = config.block_size
        self.device = model.device
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        fp8 = config.kv_cache_dtype.startswith("fp8")
        self.cache_dtype = chatgate_kernels.reference.FP8 if fp8 else model.dtype
        self.num_blocks = self._num_blocks(config, max_model_len)
        logger.info("allocating the KV cache: %d blocks of %d tokens (%.2f GiB, %s)",
                    self.num_blocks, self.block_size,
                    self.num_blocks * self.bytes_per_block / 2**30, self.cache_dtype)
        self.kv_cache = torch.zeros(self._cache_shape(self.num_blocks), dtype=self.cache_dtype,
                                    device=self.device)
        if fp8:
            model.kv_scales = self._calibrate_kv_scales()
        # the last overlapped step's sampled tokens, which the next step reads as inputs
        # (``execute``'s ``feed``), and double-buffered host copies of them
        self.sampled = torch.zeros(config.max_num_seqs, dtype=torch.long, device=self.device)
        self._sampled_host = torch.zeros(2, config.max_num_seqs, dtype=torch.long,
                                         pin_memory=self.device.type == "cuda")
        self._sampled_turn = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_sizes: list[int] = []
        # the padded size of the decode graph whose logits the last step returned (every row
        # sampled), else None
        self.last_graph_size: int | None = None
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_graphs(graph_batch_sizes(config.max_num_seqs))
        if self.device.type == "cuda":
            one_host_thread()

    def _cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        m = self.model
        return (2, len(m.layers), num_blocks, self.block_size, m.num_kv_heads, m.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return math.prod(self._cache_shape(1)) * self.cache_dtype.itemsize

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
        scratch = torch.zeros(self._cache_shape(blocks), dtype=self.cache_dtype,
                              device=self.device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        meta, position_ids = self._prefill_batch(lens)
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

    def _prefill_batch(self, lens: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
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
            plan=chatgate_kernels.attention_plan(block_tables, seq_lens, query_start_loc,
                                                 slot_mapping, bs, self.model.num_kv_heads,
                                                 self.model.dtype),
        )
        return meta, self._to_device(positions)

    @torch.inference_mode()
    def _calibrate_kv_scales(self) -> list[tuple[float, float]]:
        """Each layer's FP8 ``(k_scale, v_scale)`` from one forward pass (module docstring)."""
        m = self.model
        n = min(CALIBRATION_TOKENS, self.max_model_len)
        scratch = torch.zeros(self._cache_shape(-(-n // self.block_size)), dtype=m.dtype,
                              device=self.device)
        vocab = m.vocab_limit or m.vocab_size
        ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0))
        meta, positions = self._prefill_batch([n])
        m.forward(ids.to(self.device), positions, meta, scratch)
        amax = scratch.abs().amax(dim=(2, 3, 4, 5)).float()  # [2, num_layers]
        scales = (amax * FP8_HEADROOM / chatgate_kernels.reference.FP8_MAX).clamp_min(1e-6).tolist()
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
                ids.extend(seq.token_ids[start:end])
            input_ids = np.asarray(ids, dtype=np.int64)
        slots = tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
        return {"input_ids": input_ids, "positions": positions, "slot_mapping": slots,
                "block_tables": tables, "seq_lens": ends.astype(np.int32),
                "query_start_loc": query_start.astype(np.int32), "max_query_len":
                int(num_new.max()), "max_seq_len": int(ends.max())}

    # -- execution ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, sample_indices: list[int],
                feed: np.ndarray | None = None,
                host: dict[str, np.ndarray] | None = None) -> torch.Tensor:
        """Run one step; returns the logits (model dtype) of the sequences at ``sample_indices``.

        ``feed[i] >= 0``: sequence ``i`` is decoding a token the host has not read yet, row
        ``feed[i]`` of :meth:`keep_sampled`'s last tokens, taken on the device. ``host``: the
        batch's :meth:`host_metadata`, if already made. On the CUDA-graph path the result is a
        view of the graph's static output: read it (the sampler does) before the next
        ``execute``."""
        if host is None:
            host = self.host_metadata(batch)
        if self.tp is None:
            return self.run_step(host, batch.copies, sample_indices, feed)
        self.tp.broadcast_step((host, batch.copies, sample_indices))
        try:
            return self.run_step(host, batch.copies, sample_indices, feed)
        except RuntimeError:  # a collective failed: a worker gone shows as WorkerDied
            self.tp.check_workers(wait_s=1.0)
            raise

    @torch.inference_mode()
    def run_step(self, host: dict[str, np.ndarray], copies: list[tuple[int, int]],
                 sample_indices: list[int], feed: np.ndarray | None = None) -> torch.Tensor:
        """:meth:`execute` from the step's host metadata (what a tensor-parallel worker gets):
        block copies first, then the forward."""
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            raw = self.kv_cache.view(torch.uint8)  # no FP8 indexing kernels; bytes copy alike
            raw[:, :, dst] = raw[:, :, src]
        n = len(host["seq_lens"])
        padded = (padded_batch_size(n, self.graph_sizes)
                  if self.graphs and host["max_query_len"] == 1
                  and host["block_tables"].shape[1] <= self.max_blocks_per_seq else None)
        self.last_graph_size = None
        if padded is not None:
            logits = self._replay(host, n, padded, feed)[:n]
            self.num_graph_steps += 1
            if sample_indices != list(range(n)):
                return logits[self._to_device(np.asarray(sample_indices, dtype=np.int64))]
            self.last_graph_size = padded
            return logits
        self.num_eager_steps += 1
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
            plan=chatgate_kernels.attention_plan(block_tables, seq_lens, query_start_loc,
                                                 slot_mapping, self.block_size,
                                                 self.model.num_kv_heads, self.cache_dtype),
            row_order=chatgate_kernels.decode_row_order(seq_lens),
        )
        input_ids = self._to_device(host["input_ids"])
        if feed is not None:
            rows = np.flatnonzero(feed >= 0)
            dst = host["query_start_loc"][rows].astype(np.int64)
            input_ids[self._to_device(dst)] = self.sampled[self._to_device(feed[rows])]
        hidden = self.model.forward(input_ids, self._to_device(host["positions"]), meta,
                                    self.kv_cache)
        last = host["query_start_loc"][1:].astype(np.int64)[sample_indices] - 1
        return self.model.compute_logits(hidden[self._to_device(last)])

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

    # -- CUDA graphs -------------------------------------------------------------------------

    def _capture_graphs(self, sizes: list[int]) -> None:
        start = time.perf_counter()
        max_bs = sizes[-1]
        m, dev = self.model, self.device
        self._g = {
            "input_ids": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.long, device=dev),
            "block_tables": torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32,
                                        device=dev),
            "seq_lens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            "query_start_loc": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
        }
        self._attn_out = torch.zeros(max_bs, m.num_heads, m.head_dim, dtype=m.dtype, device=dev)
        # Pinned host mirrors of the small buffers, copied in one go per step; the event guards
        # their reuse (complete by the next step: the copies run before the step's forward).
        self._pinned = torch.zeros(5, max_bs + 1, dtype=torch.long).pin_memory()
        self._pinned_np = self._pinned.numpy()
        self._pinned_tables = torch.zeros(max_bs * self.max_blocks_per_seq,
                                          dtype=torch.int32).pin_memory()
        self._pinned_tables_np = self._pinned_tables.numpy()
        self._packed = torch.zeros(5, max_bs + 1, dtype=torch.long, device=dev)
        self._packed_tables = torch.zeros(max_bs * self.max_blocks_per_seq, dtype=torch.int32,
                                          device=dev)
        self._copied = torch.cuda.Event()
        self._copied.record()

        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(warm):
            for size in sizes:  # JIT-compiles every kernel variant the graphs will use
                self._decode_forward(size)
        torch.cuda.current_stream().wait_stream(warm)
        torch.cuda.synchronize()
        pool = None
        with torch.inference_mode():
            for size in reversed(sizes):  # largest first: smaller graphs reuse its pool
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._decode_forward(size)
                pool = graph.pool()
                self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        self.graph_sizes = sizes
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1fs", len(sizes),
                    sizes[0], max_bs, time.perf_counter() - start)

    def _decode_forward(self, size: int) -> torch.Tensor:
        g = self._g
        meta = AttentionMetadata(
            slot_mapping=g["slot_mapping"][:size],
            block_tables=g["block_tables"][:size],
            seq_lens=g["seq_lens"][:size],
            query_start_loc=g["query_start_loc"][:size + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            attn_out=self._attn_out[:size],
            row_order=chatgate_kernels.decode_row_order(g["seq_lens"][:size]),
        )
        hidden = self.model.forward(g["input_ids"][:size], g["positions"][:size], meta,
                                    self.kv_cache)
        return self.model.compute_logits(hidden)

    def _replay(self, host: dict[str, np.ndarray], n: int, padded: int,
                feed: np.ndarray | None) -> torch.Tensor:
        self._copied.synchronize()
        p = self._pinned_np
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
        self._pinned_tables_np[:size] = host["block_tables"].reshape(-1)
        g = self._g
        self._packed[:, :padded].copy_(self._pinned[:, :padded], non_blocking=True)
        self._packed_tables[:size].copy_(self._pinned_tables[:size], non_blocking=True)
        self._copied.record()
        g["block_tables"][:n, :width].copy_(self._packed_tables[:size].view(n, width))
        g["input_ids"][:padded].copy_(self._packed[0, :padded])
        if feed is not None:
            src = self._packed[4, :padded]
            ids = g["input_ids"][:padded]
            ids.copy_(torch.where(src >= 0, self.sampled[src.clamp(min=0)], ids))
        g["positions"][:padded].copy_(self._packed[1, :padded])
        g["slot_mapping"][:padded].copy_(self._packed[2, :padded])
        g["seq_lens"][:padded].copy_(self._packed[3, :padded])
        graph, logits = self.graphs[padded]
        graph.replay()
        return logits
