"""Gemma 2 and Gemma 3 (text): the shared decoder with Gemma's choices.

Embeddings scaled by sqrt(hidden_size); (1 + w) RMSNorms, also after attention and after the MLP; a GELU-tanh
gated MLP; queries scaled by query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5; local sliding-window
layers alternating with global ones (as `layer_types` lists them). Gemma 2 soft-caps the attention scores and the
final logits; Gemma 3 drops the caps and instead normalises each query and key head, and its local layers rotate
with their own base frequency (`rope_parameters` per layer type).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from liteinfer.layers import DecoderSpec
from liteinfer.models.base import DecoderForCausalLM, spec_from_config


def gemma_spec(config: PretrainedConfig, *, qk_norm: bool, attn_softcap: float | None) -> DecoderSpec:
    return spec_from_config(
        config,
        hidden_act=config.hidden_activation,
        gemma_norm=True,
        sandwich_norm=True,
        embed_scale=config.hidden_size**0.5,
        attn_scale=config.query_pre_attn_scalar**-0.5,
        qk_norm=qk_norm,
        attn_softcap=attn_softcap,
        final_softcap=config.final_logit_softcapping,
    )


class Gemma2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def spec(config: PretrainedConfig) -> DecoderSpec:
        return gemma_spec(config, qk_norm=False, attn_softcap=config.attn_logit_softcapping)


class Gemma3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def spec(config: PretrainedConfig) -> DecoderSpec:
        # transformers' Gemma 3 never applies attn_logit_softcapping (null in the released configs anyway).
        return gemma_spec(config, qk_norm=True, attn_softcap=None)
