"""Tensor parallelism across the processes of one host (``--tensor-parallel-size N``).

Megatron-style splits, as vLLM and nano-vllm do them: each of the N ranks holds
``num_attention_heads / N`` query heads and ``num_key_value_heads / N`` KV heads (q/k/v
column-split, o row-split), ``intermediate_size / N`` of the MLP (gate/up column-split, down
row-split) and ``vocab_size / N`` rows of the embedding and the LM head; norms are replicated.
A layer's attention output and its MLP output are partial sums, added up by one all-reduce each;
the embedding is an all-reduce of each rank's rows (zeros for ids outside them) and the logits an
all-gather of each rank's vocabulary slice.

Rank 0 is the engine's own process: the scheduler, the block manager, the sampler and every
request live there alone. Ranks 1..N-1 are worker processes
(``engine.tensor_parallel_workers.start_workers``), each with
its shard and its own KV pool of the same number of blocks, addressed by the same block tables:
each step rank 0 broadcasts the step's host-side inputs (:meth:`TensorParallel.broadcast_step`)
over a Gloo group and every rank runs the same forward. torch.distributed's backend is NCCL on
CUDA (rank r on ``cuda:r``) and Gloo on CPU.

A worker that dies makes rank 0's next step raise :class:`WorkerDied` (checked before every
broadcast, and Gloo fails a collective whose peer is gone) instead of hanging; a worker whose
rank 0 is gone fails its next collective and exits.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)  # a peer that stopped answering


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process exited while the engine ran."""


def check_divisible(config: PretrainedConfig, world_size: int) -> None:
    """``ValueError`` naming every size of ``config`` that ``world_size`` ranks cannot split."""
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": config.num_key_value_heads,
             "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    bad = [f"{name}={value}" for name, value in sizes.items() if value % world_size]
    if bad:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's "
                         f"{', '.join(bad)}")


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world_size``'s share of a model's tensors (HF names)."""

    rank: int
    world_size: int

    def tensor(self, name: str, tensor: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
        """This rank's part of ``tensor``: a contiguous copy of a split one (so the full one
        can be freed), a replicated one (norms) as it is."""
        if any(p in name for p in ("q_proj.", "k_proj.", "v_proj.")):
            head_dim = (getattr(config, "head_dim", None)
                        or config.hidden_size // config.num_attention_heads)
            return self._rows(tensor, head_dim)
        if any(p in name for p in ("embed_tokens.", "lm_head.", "gate_proj.", "up_proj.")):
            return self._rows(tensor)
        if any(p in name for p in ("o_proj.", "down_proj.")):
            part = tensor.shape[1] // self.world_size
            return tensor[:, self.rank * part:(self.rank + 1) * part].contiguous()
        return tensor

    def weights(self, weights: dict[str, torch.Tensor],
                config: PretrainedConfig) -> dict[str, torch.Tensor]:
        """:meth:`tensor` of every weight; a tied LM head stays the embedding's tensor."""
        embed = weights["model.embed_tokens.weight"]
        out = {name: self.tensor(name, tensor, config) for name, tensor in weights.items()
               if not (name == "lm_head.weight" and tensor is embed)}
        out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
        return out

    def _rows(self, tensor: torch.Tensor, unit: int = 1) -> torch.Tensor:
        part = tensor.shape[0] // unit // self.world_size * unit
        return tensor[self.rank * part:(self.rank + 1) * part].contiguous()


@dataclass
class TensorParallel:
    """This process's place in the group, and the group's collectives."""

    rank: int
    world_size: int
    control: Any  # a Gloo group: step inputs travel as pickled host objects
    workers: list[mp.process.BaseProcess]  # rank 0 only: ranks 1..N-1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def min_over_ranks(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())

    def broadcast_step(self, step: Any) -> Any:
        """Rank 0: send ``step`` to every worker; a worker: receive it."""
        if self.rank == 0:
            self.check_workers()
        box = [step]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def check_workers(self, wait_s: float = 0.0) -> None:
        """``WorkerDied`` if a worker has exited (or exits within ``wait_s``)."""
        for rank, proc in enumerate(self.workers, start=1):
            if wait_s:
                proc.join(timeout=wait_s)
            if not proc.is_alive():
                raise WorkerDied(f"tensor-parallel worker rank {rank} exited "
                                 f"(exit code {proc.exitcode}); the engine cannot continue")

    def shutdown(self) -> None:
        """Rank 0: end the workers (they hold no state of their own; a signal, not a
        collective, so a dead or stuck rank cannot make it hang; SIGKILL, since they ignore
        SIGTERM as the engine process does) and leave the group (safe to call twice)."""
        if not dist.is_initialized():
            return
        for proc in self.workers:
            proc.kill()
        for proc in self.workers:
            proc.join()
        dist.destroy_process_group()


def device_for_rank(device: torch.device, rank: int) -> torch.device:
    """Rank ``r`` of a CUDA engine runs on ``cuda:r``; every rank of a CPU engine on the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def join_group(rank: int, world_size: int, init_method: str,
               device: torch.device) -> TensorParallel:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks compute at once: each gets its share of the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    # the first collective sets NCCL's communicator up: here, not inside a CUDA-graph capture
    dist.all_reduce(torch.zeros(1, device=device))
    return TensorParallel(rank, world_size, control, [])
