"""Qwen2 and Qwen2.5: Llama's layout with biases on the q/k/v projections (not on o_proj), and sliding-window
attention in the layers its `layer_types` name."""

from __future__ import annotations

from transformers import PretrainedConfig

from liteinfer.layers import DecoderSpec
from liteinfer.models.base import DecoderForCausalLM, spec_from_config


class Qwen2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def spec(config: PretrainedConfig) -> DecoderSpec:
        return spec_from_config(config, qkv_bias=True, o_bias=False)
