"""The decoder layer every supported family is built from, and `DecoderSpec`: the typed description of what
varies between families, which each family's model file reads from its transformers config.

A layer is pre-norm, x + attn(norm(x)) then + mlp(norm(.)), with the residual add fused into the following norm;
Gemma 2/3 also normalise each sublayer's output before it joins the residual ("sandwich" norms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from liteinfer.distributed import TensorParallelGroup
from liteinfer.layers.activation import GatedActivation
from liteinfer.layers.attention import AttentionMetadata, PagedAttention
from liteinfer.layers.linear import PackedLinear, RowParallelLinear, RowSlice
from liteinfer.layers.norm import GemmaRMSNorm, RMSNorm
from liteinfer.layers.rotary import rotate_queries_and_keys

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of the step's positions
RopeParams = tuple[float, dict[str, Any] | None]  # (theta, scaling), as `rope_parameters` reads them
FULL, SLIDING = "full_attention", "sliding_attention"  # the Hugging Face `layer_types` names


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    max_position: int  # positions served: the engine's max_model_len (the rotary tables' length)
    layer_types: tuple[str, ...]  # FULL or SLIDING, per layer
    sliding_window: int | None  # keys a query of a SLIDING layer sees, itself included
    rope: RopeParams  # of FULL layers
    local_rope: RopeParams  # of SLIDING layers: their own base frequency in Gemma 3, else the same as `rope`
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each query and key head before rotary (Qwen3, Gemma 3)
    gemma_norm: bool = False  # every norm is a GemmaRMSNorm
    sandwich_norm: bool = False
    embed_scale: float | None = None  # embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # scores are q.k times this; None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention scores become cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # so do the output logits

    def __post_init__(self):
        unknown = set(self.layer_types) - {FULL, SLIDING}
        if unknown:
            raise ValueError(f"unsupported attention layer types {sorted(unknown)} (supported: {FULL}, {SLIDING})")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError(f"{SLIDING} layers need a sliding_window")

    def norm(self, size: int) -> RMSNorm:
        return (GemmaRMSNorm if self.gemma_norm else RMSNorm)(size, self.norm_eps)


class SelfAttention(nn.Module):
    """Fused q/k/v projection, optional q/k norm, rotary, paged attention and the output projection.

    Under tensor parallelism each rank holds its share of the query heads and the KV heads they read (q/k/v
    column-parallel, o row-parallel), and attends over them alone."""

    def __init__(self, spec: DecoderSpec, sliding_window: int | None, tp: TensorParallelGroup):
        super().__init__()
        dim = self.head_dim = spec.head_dim
        first_head, self.num_heads = tp.shard(spec.num_heads)
        first_kv_head, self.num_kv_heads = tp.kv_head_range(spec.num_kv_heads)
        q_rows = RowSlice(spec.num_heads * dim, first_head * dim, self.num_heads * dim)
        kv_rows = RowSlice(spec.num_kv_heads * dim, first_kv_head * dim, self.num_kv_heads * dim)
        self.split_sizes = [q_rows.size, kv_rows.size, kv_rows.size]
        self.qkv_proj = PackedLinear(spec.hidden_size, {"q": q_rows, "k": kv_rows, "v": kv_rows}, bias=spec.qkv_bias)
        self.o_proj = RowParallelLinear(q_rows.total, spec.hidden_size, bias=spec.o_bias, tp=tp)
        self.q_norm = spec.norm(self.head_dim) if spec.qk_norm else None
        self.k_norm = spec.norm(self.head_dim) if spec.qk_norm else None
        scale = spec.attn_scale or self.head_dim**-0.5
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale, sliding_window, spec.attn_softcap
        )

    def forward(self, hidden: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate_queries_and_keys(q, k, *rope)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v, meta))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, spec: DecoderSpec, tp: TensorParallelGroup):
        super().__init__()
        rows = RowSlice(spec.intermediate_size, *tp.shard(spec.intermediate_size))
        self.gate_up_proj = PackedLinear(spec.hidden_size, {0: rows, 1: rows}, bias=spec.mlp_bias)
        self.down_proj = RowParallelLinear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias, tp=tp)
        self.act = GatedActivation(spec.hidden_act)
        # SiLU in the gate/up matmul itself where our packed kernel takes W (layers/linear.py: pack_linears): the
        # gate/up outputs then never go out to memory and back (a prompt step of 2,048 tokens of SmolLM2: 12 MB a
        # layer each way). GELU stays a separate op: inductor's own is the faster in compiled graphs.
        if self.act.kernel_act == "silu":
            self.gate_up_proj.gated_activation = "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(gate_up if self.gate_up_proj.makes_activation else self.act(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_type: str, tp: TensorParallelGroup):
        super().__init__()
        self.self_attn = SelfAttention(spec, spec.sliding_window if layer_type == SLIDING else None, tp)
        self.mlp = GatedMLP(spec, tp)
        self.input_layernorm = spec.norm(spec.hidden_size)
        # Without sandwich norms this is the norm before the MLP (the checkpoints' name for it).
        self.post_attention_layernorm = spec.norm(spec.hidden_size)
        self.sandwich_norm = spec.sandwich_norm
        if spec.sandwich_norm:
            self.pre_feedforward_layernorm = spec.norm(spec.hidden_size)
            self.post_feedforward_layernorm = spec.norm(spec.hidden_size)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: Rope, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it); their sum is the hidden state after the layer."""
        if residual is None:  # first layer: the residual stream starts as the embeddings
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, meta)
        if self.sandwich_norm:
            hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
