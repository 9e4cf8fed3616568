"""Qwen3 (dense): Llama's layout with an RMSNorm over each query and key head before rotary, and a `head_dim`
set independently of hidden_size / heads."""

from __future__ import annotations

from transformers import PretrainedConfig

from liteinfer.layers import DecoderSpec
from liteinfer.models.base import DecoderForCausalLM, spec_from_config


class Qwen3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def spec(config: PretrainedConfig) -> DecoderSpec:
        return spec_from_config(config, qk_norm=True)
