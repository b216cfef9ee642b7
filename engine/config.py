"""Engine configuration: vLLM's knob names, validated once at start-up."""

from dataclasses import dataclass

import torch

BLOCK_SIZES = (8, 16, 32)
# KV cache element types (vLLM's names): "auto" is the model's dtype; "fp8" (or "fp8_e4m3")
# stores float8_e4m3fn codes with one K and one V scale per layer.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass
class EngineConfig:
    """Everything the engine needs to start. ``None`` means "pick from the model/device"."""

    model: str = "smollm2"
    tokenizer: str | None = None  # a Hugging Face tokenizer folder instead of the model's own
    device: str | None = None
    dtype: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    pin_budget_fraction: float = 0.5
    seed: int = 0
    use_weight_cache: bool = True
    enforce_eager: bool = False
    # While sequences run, waiting ones are admitted only once this many slots are free (or
    # every waiting one fits), so new prefills arrive in groups: fewer steps mix prefill with
    # decode, and only pure-decode steps replay CUDA graphs. None: max_num_seqs // 16 when
    # CUDA graphs are on, else 1 (admit as soon as a slot frees).
    admission_batch: int | None = None
    # weight-only quantization of the linear layers (CPU): None (the model's dtype) or "int8"
    quantization: str | None = None
    # Overlapped scheduling (vLLM's --async-scheduling): while the device runs a step, the host
    # reads the previous one's tokens and schedules the next; a finished request computes one
    # extra token, discarded. Steps that need host-side sampling (grammars, penalties,
    # logprobs, the first token of n > 1) run synchronously. None: on with CUDA, off on CPU
    # (where nothing runs while the host works, so it would only delay each output by a step).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.admission_batch is not None and self.admission_batch < 1:
            raise ValueError(f"admission_batch must be at least 1, got {self.admission_batch}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if not 0.0 <= self.pin_budget_fraction <= 1.0:
            raise ValueError(
                f"pin_budget_fraction must be in [0, 1], got {self.pin_budget_fraction}"
            )

    @property
    def torch_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            names = {"float32": torch.float32, "float16": torch.float16,
                     "bfloat16": torch.bfloat16, "fp32": torch.float32,
                     "fp16": torch.float16, "bf16": torch.bfloat16}
            if self.dtype not in names:
                raise ValueError(f"dtype must be one of {sorted(names)}, got {self.dtype!r}")
            return names[self.dtype]
        return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
