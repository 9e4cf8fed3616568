"""What every supported family shares: the decoder stack over `layers/`, the LM head, and the reading of the
config fields that all transformers configs spell alike. A family's file says only what differs (`spec`)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig

from liteinfer.distributed import TensorParallelGroup
from liteinfer.layers import (
    FULL,
    SLIDING,
    AttentionMetadata,
    DecoderLayer,
    DecoderSpec,
    LMHead,
    RotaryEmbedding,
    VocabEmbedding,
    rope_parameters,
)


def spec_from_config(config: PretrainedConfig, **family) -> DecoderSpec:
    """The DecoderSpec of the fields every family's config spells alike; `family` sets the family's own."""
    num_layers = config.num_hidden_layers
    sliding_window = getattr(config, "sliding_window", None)
    # Qwen2/3 and Gemma list each layer's kind; in Mistral and Phi-3 a window, when set, applies to every layer.
    layer_types = getattr(config, "layer_types", None) or [SLIDING if sliding_window else FULL] * num_layers
    attention_bias = getattr(config, "attention_bias", False)
    fields = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        norm_eps=config.rms_norm_eps,
        max_position=config.max_position_embeddings,
        layer_types=tuple(layer_types),
        sliding_window=sliding_window,
        rope=rope_parameters(config, FULL),
        local_rope=rope_parameters(config, SLIDING),
        tie_word_embeddings=getattr(config, "tie_word_embeddings", False),
        hidden_act=getattr(config, "hidden_act", "silu"),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=getattr(config, "mlp_bias", False),
    )
    return DecoderSpec(**{**fields, **family})


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, tp: TensorParallelGroup):
        super().__init__()
        self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.embed_scale = spec.embed_scale
        self.layers = nn.ModuleList(DecoderLayer(spec, layer_type, tp) for layer_type in spec.layer_types)
        self.layer_types = spec.layer_types
        self.norm = spec.norm(spec.hidden_size)
        self.rotary_emb = RotaryEmbedding(spec.head_dim, spec.max_position, *spec.rope)
        self.local_rotary_emb = None
        if spec.local_rope != spec.rope:
            self.local_rotary_emb = RotaryEmbedding(spec.head_dim, spec.max_position, *spec.local_rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            # Rounded to the activation dtype first, as the reference does (sqrt(640) is 25.25 in bf16).
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        rope = self.rotary_emb(positions, hidden.dtype)
        local_rope = rope if self.local_rotary_emb is None else self.local_rotary_emb(positions, hidden.dtype)
        residual = None
        for layer, layer_type in zip(self.layers, self.layer_types):
            hidden, residual = layer(hidden, residual, local_rope if layer_type == SLIDING else rope, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """A decoder-only LM; a family subclasses it and overrides `spec` where its config needs more than the
    common reading."""

    # Checkpoint tensor name -> (our packed parameter, shard), for every family: see liteinfer.models.loader.
    # Checkpoints that store a packed tensor themselves (Phi-3's qkv_proj, gate_up_proj) load it whole.
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, tp: TensorParallelGroup | None = None,
                 max_model_len: int | None = None):
        """`max_model_len`: the positions the engine serves, if fewer than the config's limit (long-rope picks its
        factors by it)."""
        super().__init__()
        self.config = config
        spec = self.spec(config)
        if max_model_len is not None:
            spec = replace(spec, max_position=max_model_len)
        tp = tp or TensorParallelGroup()
        self.model = DecoderModel(spec, tp)
        tied = self.model.embed_tokens if spec.tie_word_embeddings else None
        self.lm_head = LMHead(spec.vocab_size, spec.hidden_size, tied_to=tied, tp=tp)
        self.final_softcap = spec.final_softcap

    @staticmethod
    def spec(config: PretrainedConfig) -> DecoderSpec:
        return spec_from_config(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states of every token; logits are computed only where a token is sampled."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of the given rows; None on tensor-parallel ranks other than 0 (they only send theirs)."""
        logits = self.lm_head(hidden)
        if logits is not None and self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of `compute_logits(hidden)`, where the head finds it without computing every logit
        (`LMHead.greedy_tokens`); None where it does not."""
        return self.lm_head.greedy_tokens(hidden)
