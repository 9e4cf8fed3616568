"""Phi-3 / Phi-3.5: Llama's layout, but checkpoints store q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj` (loaded whole into our packed parameters), the long-context models use LongRoPE scaling (see
layers/rotary.py), and the 4k models slide a window over every layer."""

from __future__ import annotations

from liteinfer.models.base import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    pass
