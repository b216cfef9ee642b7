"""A model runner from an ``EngineConfig``: the model loaded (this rank's shard of it under
tensor parallelism), built with the kernels of its device and KV cache, and its runner."""

import torch

from chatgate_kernels.reference import FP8
from engine.config import EngineConfig
from engine.device import torch_device, torch_dtype
from engine.loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.quantized_cpu_model import build_model
from engine.tensor_parallel import Shard, TensorParallel, device_for_rank


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
                 loaded: LoadedModel | None = None, own_weights: bool = False) -> ModelRunner:
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
    model = build_model(loaded.config, weights, max_model_len, vocab_limit=loaded.vocab_limit,
                        quantization=config.quantization, tp=tp,
                        kv_cache_dtype=kv_cache_dtype(config))
    del weights  # what the model did not keep goes now
    return ModelRunner(model, config, max_model_len, tp)


def kv_cache_dtype(config: EngineConfig) -> torch.dtype | None:
    """The KV cache's dtype: FP8 for ``kv_cache_dtype="fp8"``, else None (``auto``: the model
    picks, see ``LlamaModel`` and ``QuantizedCpuModel``)."""
    return FP8 if config.kv_cache_dtype.startswith("fp8") else None
