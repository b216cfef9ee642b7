"""Turns a scheduled batch into kernel inputs, owns the KV cache tensor, runs the model."""

import logging

import torch

from engine.config import EngineConfig
from engine.model import AttentionMetadata, LlamaModel
from engine.scheduler import ScheduledBatch

logger = logging.getLogger("engine.model_runner")

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


class ModelRunner:
    def __init__(self, model: LlamaModel, config: EngineConfig, max_model_len: int) -> None:
        self.model = model
        self.block_size = config.block_size
        self.device = model.device
        self.num_blocks = self._num_blocks(config, max_model_len)
        shape = (2, len(model.layers), self.num_blocks, self.block_size,
                 model.num_kv_heads, model.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=model.dtype, device=self.device)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.num_blocks,
                    self.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**30)

    @property
    def bytes_per_block(self) -> int:
        m = self.model
        return (2 * len(m.layers) * self.block_size * m.num_kv_heads * m.head_dim
                * torch.tensor([], dtype=m.dtype).element_size())

    def _num_blocks(self, config: EngineConfig, max_model_len: int) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
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
        num_tokens = min(config.max_num_batched_tokens, max_model_len)
        blocks = -(-num_tokens // self.block_size)
        m = self.model
        scratch = torch.zeros((2, len(m.layers), blocks, self.block_size, m.num_kv_heads,
                               m.head_dim), dtype=m.dtype, device=self.device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            block_tables=torch.arange(blocks, device=self.device, dtype=torch.int32)[None],
            seq_lens=torch.tensor([num_tokens], device=self.device, dtype=torch.int32),
            query_start_loc=torch.tensor([0, num_tokens], device=self.device, dtype=torch.int32),
            max_query_len=num_tokens, max_seq_len=num_tokens,
        )
        with torch.inference_mode():
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            hidden = m.forward(ids, torch.arange(num_tokens, device=self.device), meta, scratch)
            m.compute_logits(hidden[-min(num_tokens, config.max_num_seqs):])
        torch.cuda.synchronize()
        activation_peak = torch.cuda.max_memory_allocated() - before
        del scratch, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        in_use = total - free
        budget = int(total * config.gpu_memory_utilization - in_use - activation_peak)
        logger.info("GPU memory: %.1f GiB total, %.1f GiB in use, activation peak %.2f GiB",
                    total / 2**30, in_use / 2**30, activation_peak / 2**30)
        return budget

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, sample_indices: list[int]) -> torch.Tensor:
        """Run one step; returns fp32 logits for the sequences at ``sample_indices``."""
        if batch.copies:
            src = torch.tensor([s for s, _ in batch.copies], device=self.device)
            dst = torch.tensor([d for _, d in batch.copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            query_start.append(query_start[-1] + num_new)
        width = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.long),
            block_tables=tensor(tables, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            query_start_loc=tensor(query_start, torch.int32),
            max_query_len=max(batch.num_new_tokens),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model.forward(tensor(input_ids, torch.long), tensor(positions, torch.long),
                                    meta, self.kv_cache)
        last = tensor([query_start[i + 1] - 1 for i in sample_indices], torch.long)
        return self.model.compute_logits(hidden[last])
