"""Engine configuration: vLLM's knob names, validated once at start-up.

``EngineConfig`` is the one declaration of the engine's settings: ``LLM(**kwargs)`` passes into
it, the gateway validates ``chatgate serve``'s engine settings as it (pydantic reads the
dataclass), and the CLI derives one flag per field whose metadata has a ``help`` (the flag is
the field's name with dashes: ``max_num_seqs`` -> ``--max-num-seqs``; ``choices`` restricts it).
Plain data (no torch): the engine process resolves device and dtype (``engine.device``).
"""

import json
from dataclasses import dataclass, field, fields
from typing import Any

BLOCK_SIZES = (8, 16, 32)
# dtype names; ``engine.device.torch_dtype`` maps them to torch dtypes
DTYPES = ("float32", "float16", "bfloat16", "fp32", "fp16", "bf16")
# ``engine.quantization.CHOICES``, named here so that the config imports no torch
QUANTIZATION_CHOICES = ("int8", "int4", "fp8", "auto", "none")
# KV cache element types (vLLM's names): "auto" is the model's dtype; "fp8" (or "fp8_e4m3")
# stores float8_e4m3fn codes with one K and one V scale per layer.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def _flag(default: Any, help: str, choices: tuple | None = None,  # noqa: A002
          serve_default: Any = None, parse: Any = None) -> Any:
    """A field that ``chatgate serve`` exposes as a flag (with ``serve_default`` as the flag's
    default where serving wants another than the library; ``parse``: the flag's text to the
    field's value, where the field's type cannot read it)."""
    metadata: dict[str, Any] = {"help": help}
    if parse is not None:
        metadata["parse"] = parse
    if choices is not None:
        metadata["choices"] = choices
    if serve_default is not None:
        metadata["serve_default"] = serve_default
    return field(default=default, metadata=metadata)


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object text (``--speculative-config``) as a dict."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {text!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """``speculative_config``'s fields (vLLM's names). Drafts are the up to
    ``num_speculative_tokens`` tokens that followed the latest earlier occurrence of the
    longest suffix of ``prompt_lookup_min``..``prompt_lookup_max`` tokens; one of the two
    given alone stands for both, neither: 4 and 2. ``disable_by_batch_size``: no drafts while
    more sequences than this run (default 4; see ``engine.speculative`` for the rule)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = 4

    @staticmethod
    def from_dict(options: dict[str, Any]) -> "SpeculativeConfig":
        """Validate ``options``; ``ValueError`` naming the field that is wrong."""
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {options!r}")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; "
                             f"known: {sorted(known)}")
        if options.get("method") != "ngram":
            raise ValueError("speculative_config: method must be 'ngram' (prompt lookup), "
                             f"got {options.get('method')!r}")
        values = dict(options)
        low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if low is None and high is not None:
            values["prompt_lookup_min"] = high
        elif high is None and low is not None:
            values["prompt_lookup_max"] = low
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        for name in known - {"method"}:
            value = values.get(name, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, "
                                 f"got {value!r}")
        config = SpeculativeConfig(**values)
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError("speculative_config: prompt_lookup_min "
                             f"({config.prompt_lookup_min}) exceeds prompt_lookup_max "
                             f"({config.prompt_lookup_max})")
        return config


@dataclass
class EngineConfig:
    """Everything the engine needs to start. ``None`` means "pick from the model/device"."""

    model: str = _flag("smollm2", "model name or path (default: smollm2, SmolLM2-135M-Instruct)")
    tokenizer: str | None = _flag(None, "a Hugging Face tokenizer folder to use instead of the "
                                        "model's own")
    device: str | None = _flag(None, "cpu, cuda, cuda:N (default: cuda if present)")
    dtype: str | None = _flag(None, "weights and activations (default: bfloat16 on CUDA, "
                                    "float32 on CPU)", ("auto", *DTYPES))
    block_size: int = _flag(16, "tokens per KV block", BLOCK_SIZES)
    num_kv_blocks: int | None = _flag(None, "explicit KV-cache size in blocks (overrides "
                                            "memory sizing)")
    kv_cache_bytes: int | None = _flag(None, "KV-cache byte budget (CPU sizing)")
    kv_cache_dtype: str = _flag("auto", "KV cache element type: auto (the model's dtype; "
                                        "bfloat16 under the CPU's int8/int4 layers) or "
                                        "fp8 (e4m3 with per-layer scales: twice the blocks in "
                                        "the same memory)", KV_CACHE_DTYPES)
    gpu_memory_utilization: float = _flag(0.9, "fraction of GPU memory for weights, "
                                               "activations and the KV cache")
    max_num_seqs: int = _flag(128, "sequences per step at most")
    max_num_batched_tokens: int = _flag(2048, "tokens per step at most, computed or copied back "
                                        "from the host KV tier (chunked prefill)")
    max_model_len: int | None = _flag(None, "context length (default: the model's)")
    enable_prefix_caching: bool = _flag(True, "share KV blocks of equal prefixes")
    kv_offloading_size: float = _flag(0.0, "GiB of host memory for a second KV tier: blocks "
                                            "leaving the device pool are copied there and come "
                                            "back by copy instead of recompute (0 = off)")
    pin_budget_fraction: float = 0.5  # of the pool that pinned sessions may hold
    seed: int = _flag(0, "seed of the weights of dummy models and of unseeded sampling")
    use_weight_cache: bool = True  # converted GGUF weights cached on disk
    enforce_eager: bool = _flag(False, "disable CUDA graphs")
    # While sequences run, waiting ones are admitted only once this many slots are free (or
    # every waiting one fits), so new prefills arrive in groups: fewer steps mix prefill with
    # decode, and only pure-decode steps replay CUDA graphs.
    admission_batch: int | None = _flag(None, "while requests run, admit waiting ones once "
                                              "this many slots are free (default: "
                                              "max-num-seqs/16 with CUDA graphs, else 1)")
    # The library's default is the exact float path (greedy equals transformers' there);
    # ``chatgate serve`` defaults to "auto": int8 on the CPU, the most correct answers on
    # everyday questions and 3.6x float32's speed per stream (int4 is faster but loops more)
    quantization: str | None = _flag(None, "weight-only int8 or int4 linear layers (CPU): a "
                                           "quarter or an eighth of float32's bytes per step; "
                                           "fp8 (GPUs of compute capability 8.9+): FP8 "
                                           "weights and per-token FP8 activations; "
                                           "auto (default): int8 on the CPU, none elsewhere; "
                                           "none: float weights",
                                     QUANTIZATION_CHOICES, serve_default="auto")
    # Overlapped scheduling (vLLM's --async-scheduling): while the device runs a step, the host
    # reads the previous one's tokens and schedules the next; a finished request computes one
    # extra token, discarded. Rows with grammars or penalties are sampled once the previous
    # token is read (while the forward runs); steps with logprobs or the first token of n > 1
    # run synchronously. Off on CPU by default, where nothing runs while the host works, so it
    # would only delay each output by a step.
    async_scheduling: bool | None = _flag(None, "schedule the next step while the device runs "
                                                "this one (default: on with CUDA, off on CPU)")

    # Megatron-style tensor parallelism over this many processes of one host (one GPU each on
    # CUDA, NCCL; Gloo on CPU): see engine/tensor_parallel.py
    tensor_parallel_size: int = _flag(1, "split every layer across this many processes (one "
                                         "GPU each on CUDA; Gloo on the CPU)")

    # Speculative decoding (vLLM's --speculative-config, method "ngram" only): see
    # engine/speculative.py; off (None) by default
    speculative_config: dict[str, Any] | None = _flag(
        None, 'speculative decoding as JSON, e.g. {"method": "ngram", '
              '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} '
              '(default: off)', parse=json_object)

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # raises if it is wrong
        if self.dtype == "auto":
            self.dtype = None
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, "
                             f"got {self.quantization!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                     "kv_cache_bytes", "admission_batch", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size must be >= 0, got {self.kv_offloading_size}")
        if self.tensor_parallel_size > 1:
            # the host tier and the device-side token feed act on rank 0's cache and buffers
            if self.kv_offloading_size > 0:
                raise ValueError("kv_offloading_size is not supported with "
                                 "tensor_parallel_size > 1")
            if self.async_scheduling:
                raise ValueError("async_scheduling is not supported with "
                                 "tensor_parallel_size > 1")
        if not 0.0 <= self.pin_budget_fraction <= 1.0:
            raise ValueError(
                f"pin_budget_fraction must be in [0, 1], got {self.pin_budget_fraction}"
            )
