"""The engine's client face: what a process that talks to the engine over ZeroMQ imports (the
gateway does, through this module only). Importing it imports neither torch nor
``chatgate_kernels`` nor xgrammar; ``tests/engine/test_client_face.py`` holds it to that.

One module of re-exports rather than a package: the engine process uses the same modules (the
IPC messages, ``SamplingParams``, outputs, ``EngineConfig``, ``EngineInfo``, ``EngineStats``),
so they stay where they are and this face names the torch-free subset. ``AsyncEngine`` reads
the tokenizer the engine process saved for it (see ``engine.async_engine``).
"""

from engine.async_engine import AsyncEngine, EngineDeadError, EngineStartupError, EngineStepError
from engine.chat import supports_tools
from engine.config import EngineConfig
from engine.info import EngineInfo
from engine.ipc import AbortRequests, AddRequest, EngineReady, StepOutputs
from engine.logs import configure_logging, logging_config
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob, merge_outputs
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from engine.structured_output import StructuredOutput

__all__ = [
    "AbortRequests",
    "AddRequest",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineInfo",
    "EngineReady",
    "EngineStartupError",
    "EngineStats",
    "EngineStepError",
    "RequestOutput",
    "SamplingParams",
    "StepOutputs",
    "StructuredOutput",
    "TokenLogprob",
    "configure_logging",
    "logging_config",
    "merge_outputs",
    "supports_tools",
]
