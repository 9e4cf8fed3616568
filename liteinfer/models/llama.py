"""Llama (and the many checkpoints that share its layout, e.g. SmolLM2) over the shared layers."""

from __future__ import annotations

import torch
from torch import nn

from liteinfer.layers import (
    AttentionMetadata,
    Linear,
    LMHead,
    PackedLinear,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    VocabEmbedding,
    apply_rotary,
    rope_parameters,
)

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of the step's positions


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=bias)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.split_sizes = [q_size, kv_size, kv_size]

    def forward(self, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q = apply_rotary(q.view(-1, self.num_heads, self.head_dim), *rope)
        k = apply_rotary(k.view(-1, self.num_kv_heads, self.head_dim), *rope)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Llama MLP supports hidden_act='silu', got {config.hidden_act!r}")
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, {0: size, 1: size}, bias=bias)
        self.down_proj = Linear(size, config.hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: Rope, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        theta, scaling = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb(positions, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # Checkpoint tensor name -> (our packed parameter, shard): see liteinfer.models.loader.
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        tied = self.model.embed_tokens if getattr(config, "tie_word_embeddings", False) else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states of every token; logits are computed only where a token is sampled."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
