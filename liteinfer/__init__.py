"""liteinfer: a lightweight, hackable LLM inference engine.

`LLM(model).generate(prompts, SamplingParams(...))` is the entry point; `LLMEngine` is the loop underneath. Each
sub-package states the contract it owns in its own docstring: `engine` (scheduling and the step loop), `models`
(architectures and loading), `layers` (shared building blocks), `cache` (the paged KV cache), `sampling`
(sampling parameters and the sampler), `entrypoints` (command line).
"""

from liteinfer.config import EngineConfig
from liteinfer.engine import LLMEngine
from liteinfer.llm import LLM
from liteinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from liteinfer.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
