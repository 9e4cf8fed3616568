"""Llama (and the many checkpoints that share its layout, e.g. SmolLM2, TinyLlama): the shared decoder as is,
with the q/k/v/o biases of `attention_bias`, the MLP biases of `mlp_bias` and llama3 rope scaling."""

from __future__ import annotations

from liteinfer.models.base import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass
