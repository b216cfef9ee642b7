"""chatgate's inference engine: paged KV cache, prefix caching, pinned sessions, continuous
batching and a Llama-family model runner. Knows tokens and blocks, nothing about HTTP."""

from engine.async_engine import AsyncEngine, EngineDeadError, EngineStartupError, EngineStepError
from engine.config import EngineConfig
from engine.info import EngineInfo
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

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
