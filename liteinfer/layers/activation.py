"""Gated activations."""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

# Hugging Face `hidden_act` names -> the function applied to the gate.
_GATE_ACTIVATIONS = {
    "silu": F.silu,  # SwiGLU (Llama, Qwen, Mistral, Phi-3)
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),  # GeGLU (Gemma)
}


class GatedActivation(nn.Module):
    """act(gate) * up, with gate and up packed side by side in the last dimension."""

    def __init__(self, hidden_act: str):
        super().__init__()
        if hidden_act not in _GATE_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r} (supported: {', '.join(_GATE_ACTIVATIONS)})")
        self.act = _GATE_ACTIVATIONS[hidden_act]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up
