"""Mistral: Llama's layout with sliding-window attention in every layer when `sliding_window` is set (older
checkpoints; recent ones leave it null and attend to everything)."""

from __future__ import annotations

from liteinfer.models.base import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    pass
