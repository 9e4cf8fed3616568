"""Sampling: per-request sampling parameters and the step that turns logits into next tokens.

This package owns `SamplingParams` (vLLM's names, defaults and validation) and the `Sampler`, which
takes one step's [num_rows, vocab] logits plus a `SamplingRow` per row and returns a `SamplerOutput`:
the next token of each row and, where requested, its logprobs from the model's raw distribution.
It never touches the KV cache or the model, and keeps no state between steps: token history and
seeded generators come in with each row, and stop checks and detokenisation belong to the engine.
"""

from liteinfer.sampling.params import RequestOutputKind, SamplingParams
from liteinfer.sampling.sampler import Sampler, SamplerOutput, SamplingRow

__all__ = ["RequestOutputKind", "Sampler", "SamplerOutput", "SamplingParams", "SamplingRow"]
