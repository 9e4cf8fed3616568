"""Reusable building blocks that model files compose.

Contract: every layer here is a plain `nn.Module` that works on *packed* token batches — hidden states are
`[num_tokens, hidden]` for all sequences of a step laid end to end, never `[batch, seq, hidden]`. Parameters are
allocated with `torch.empty` (the loader fills them), and a layer whose parameter packs several checkpoint tensors
(fused qkv, gate/up) carries a `weight_loader` on that parameter saying where each shard goes. Attention reads and
writes K/V only through the paged cache it is bound to and the step's `AttentionMetadata`; layers hold no
per-request state. Under tensor parallelism a layer is built with its rank's `TensorParallelGroup` and holds only
that rank's shard (column-parallel q/k/v and gate/up, row-parallel o and down, vocabulary-split embedding and LM
head); its `weight_loader`s cut that shard out of the full checkpoint tensor, and its forward calls the group's
collectives. With one rank (the default) every layer is the plain, unsharded one.
"""

from liteinfer.layers.activation import GatedActivation
from liteinfer.layers.attention import AttentionMetadata, PagedAttention, PrefillSpan
from liteinfer.layers.decoder import FULL, SLIDING, DecoderLayer, DecoderSpec, GatedMLP, SelfAttention
from liteinfer.layers.embedding import LMHead, VocabEmbedding
from liteinfer.layers.linear import Linear, PackedLinear, RowParallelLinear, RowSlice
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
    "RowParallelLinear",
    "RowSlice",
    "RotaryEmbedding",
    "SelfAttention",
    "VocabEmbedding",
    "apply_rotary",
    "rope_parameters",
]
