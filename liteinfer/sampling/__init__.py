"""Sampling: per-request sampling parameters and the step that turns logits into next tokens.

This package owns `SamplingParams` (vLLM's names, defaults and validation) and the `Sampler`, which
takes one step's [num_rows, vocab] logits plus a `SamplingRow` per row and returns a `SamplerOutput`:
the next token of each row and, where requested, its logprobs from the model's raw distribution.
It never touches the KV cache or the model, and keeps no state between steps: token history, seeds (a seeded row's
draw is a function of its seed and position) and a structured output's grammar matcher (`structured.py`) come in
with each row; stop checks, detokenisation and advancing the matchers belong to the engine.
"""

from liteinfer.sampling.params import RequestOutputKind, SamplingParams
from liteinfer.sampling.sampler import NO_TOKEN, Sampler, SamplerOutput, SamplingRow
from liteinfer.sampling.structured import GrammarMatchers, StructuredOutputsParams

__all__ = [
    "NO_TOKEN",
    "GrammarMatchers",
    "RequestOutputKind",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SamplingRow",
    "StructuredOutputsParams",
]
