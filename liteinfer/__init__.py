"""liteinfer: a lightweight, hackable LLM inference engine.

`LLM(model).generate(prompts, SamplingParams(...))` is the entry point, `AsyncLLM` its asyncio twin (streaming,
cancellation); `LLMEngine` is the loop underneath both. Each sub-package states the contract it owns in its own
docstring: `engine` (scheduling and the step loop), `models` (architectures and loading), `layers` (shared building
blocks), `cache` (the paged KV cache), `sampling` (sampling parameters and the sampler), `entrypoints` (command
line, OpenAI-compatible server).
"""

from liteinfer.config import EngineConfig, SpeculativeConfig
from liteinfer.engine import AsyncLLM, LLMEngine
from liteinfer.llm import LLM
from liteinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from liteinfer.sampling import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "SpeculativeConfig",
    "StructuredOutputsParams",
]
