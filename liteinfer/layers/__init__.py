"""Reusable building blocks that model files compose.

Contract: every layer here is a plain `nn.Module` that works on *packed* token batches — hidden states are
`[num_tokens, hidden]` for all sequences of a step laid end to end, never `[batch, seq, hidden]`. Parameters are
allocated with `torch.empty` (the loader fills them), and a layer whose parameter packs several checkpoint tensors
(fused qkv, gate/up) carries a `weight_loader` on that parameter saying where each shard goes. Attention reads and
writes K/V only through the paged cache it is bound to and the step's `AttentionMetadata`; layers hold no
per-request state.
"""

from liteinfer.layers.activation import GatedActivation
from liteinfer.layers.attention import AttentionMetadata, PagedAttention, PrefillSpan
from liteinfer.layers.decoder import FULL, SLIDING, DecoderLayer, DecoderSpec, GatedMLP, SelfAttention
from liteinfer.layers.embedding import LMHead, VocabEmbedding
from liteinfer.layers.linear import Linear, PackedLinear
from liteinfer.layers.norm import GemmaRMSNorm, RMSNorm
from liteinfer.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters

__all__ = [
    "FULL",
    "SLIDING",
    "AttentionMetadata",
    "DecoderLayer",
    "DecoderSpec",
    "GatedActivation",
    "GatedMLP",
    "GemmaRMSNorm",
    "LMHead",
    "Linear",
    "PackedLinear",
    "PagedAttention",
    "PrefillSpan",
    "RMSNorm",
    "RotaryEmbedding",
    "SelfAttention",
    "VocabEmbedding",
    "apply_rotary",
    "rope_parameters",
]
