"""Model implementations and how to find and load them.

Contract: a model class is registered here under the Hugging Face `architectures` name it implements. It takes a
transformers config (and, to build one tensor-parallel rank's shard, that rank's `TensorParallelGroup`), allocates
its parameters empty (the loader streams the checkpoint in), and exposes `forward(input_ids [T], positions [T],
attn_metadata) -> hidden [T, H]` over a packed batch and `compute_logits(hidden [N, H]) -> [N, vocab]` (None on
ranks other than 0), so the runner pays for the LM head only where it samples, and `greedy_tokens(hidden [N, H])
-> [N] or None`, each row's argmax of those logits where the head can find it without computing them all. Models
own no KV cache and no request state. `transformers` supplies configs and tokenizers here, never modelling code.
"""

from __future__ import annotations

from torch import nn

from liteinfer.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from liteinfer.models.llama import LlamaForCausalLM
from liteinfer.models.mistral import MistralForCausalLM
from liteinfer.models.phi3 import Phi3ForCausalLM
from liteinfer.models.qwen2 import Qwen2ForCausalLM
from liteinfer.models.qwen3 import Qwen3ForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    model_cls.__name__: model_cls
    for model_cls in (
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        LlamaForCausalLM,
        MistralForCausalLM,
        Phi3ForCausalLM,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
    )
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    for arch in architectures or []:
        if arch in _REGISTRY:
            return _REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {architectures}; supported: {', '.join(supported_architectures())}"
    )


__all__ = ["get_model_class", "supported_architectures"]
