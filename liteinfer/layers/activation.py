"""Gated activations."""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from liteinfer import kernels

# Hugging Face `hidden_act` names -> the function applied to the gate, and its name for our kernel.
_GATE_ACTIVATIONS = {
    "silu": (F.silu, "silu"),  # SwiGLU (Llama, Qwen, Mistral, Phi-3)
    "gelu_pytorch_tanh": (partial(F.gelu, approximate="tanh"), "gelu_tanh"),  # GeGLU (Gemma)
}


class GatedActivation(nn.Module):
    """act(gate) * up, with gate and up packed side by side in the last dimension."""

    def __init__(self, hidden_act: str):
        super().__init__()
        if hidden_act not in _GATE_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r} (supported: {', '.join(_GATE_ACTIVATIONS)})")
        self.act, self.kernel_act = _GATE_ACTIVATIONS[hidden_act]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        # SiLU in compiled graphs too: ours has a faster exp than inductor's kernel for it (SLEEF's accurate one),
        # ~10 us less a layer in a decode step of 32 sequences of SmolLM2 (docs/benchmarks.md). GELU stays inductor's.
        in_graphs = self.kernel_act == "silu"
        if kernels.pointwise_takes(gate_up, in_graphs) and gate_up.dim() == 2 and gate_up.is_contiguous():
            return torch.ops.liteinfer.gated_activation(gate_up, self.kernel_act)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up
