"""The worker processes of a tensor-parallel engine (ranks 1..N-1; ``engine/tensor_parallel.py``
holds the group and its collectives): started by rank 0, each builds its shard and KV pool,
then runs every step rank 0 broadcasts."""

import logging
import multiprocessing as mp
import socket

import torch.distributed as dist

from engine.config import EngineConfig
from engine.device import torch_device
from engine.runner_factory import build_runner
from engine.tensor_parallel import TensorParallel, device_for_rank, join_group

logger = logging.getLogger("engine.tensor_parallel_workers")


def start_workers(config: EngineConfig) -> TensorParallel:
    """Start ranks 1..N-1 for ``config`` and join the group as rank 0."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one "
                           "tensor-parallel engine per process")
    world_size = config.tensor_parallel_size
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_method = f"tcp://127.0.0.1:{port}"
    context = mp.get_context("spawn")
    workers = [context.Process(target=_worker_main, args=(config, rank, init_method),
                               name=f"tp-worker-{rank}", daemon=True)
               for rank in range(1, world_size)]
    for proc in workers:
        proc.start()
    tp = join_group(0, world_size, init_method, device_for_rank(torch_device(config), 0))
    tp.workers = workers
    logger.info("tensor parallel: %d ranks (%s)", world_size, dist.get_backend())
    return tp


def _worker_main(config: EngineConfig, rank: int, init_method: str) -> None:
    """A worker: build this rank's shard and KV pool, then run every step rank 0 sends."""
    logging.basicConfig(level=logging.WARNING,
                        format=f"[tp rank {rank}] %(levelname)s %(name)s: %(message)s")
    tp = join_group(rank, config.tensor_parallel_size, init_method,
                    device_for_rank(torch_device(config), rank))
    runner = build_runner(config, tp)
    try:
        while True:
            runner.run_step(*tp.broadcast_step(None))
    except RuntimeError as e:  # rank 0 is gone (its collectives fail)
        logger.warning("rank 0 stopped answering: %s", e)
    finally:
        dist.destroy_process_group()
