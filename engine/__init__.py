"""chatgate's inference engine: paged KV cache, prefix caching, pinned sessions, continuous
batching and a Llama-family model runner. Knows tokens and blocks, nothing about HTTP.

The package face is ``engine.client``'s (torch-free); ``LLM``, the offline engine, is imported
on first use (``from engine import LLM`` loads torch and the kernels, ``import engine`` does
not)."""

from typing import Any

from engine.client import (
    AsyncEngine,
    CompletionOutput,
    EngineConfig,
    EngineDeadError,
    EngineInfo,
    EngineStartupError,
    EngineStats,
    EngineStepError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineDeadError",
    "EngineStartupError",
    "EngineStepError",
    "EngineConfig",
    "EngineInfo",
    "EngineStats",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM  # noqa: PLC0415 (torch and the kernels, on first use)
        return LLM
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
