"""Rotary position embedding (the Hugging Face "rotate half" layout), with llama3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_parameters(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from a transformers config: 5.x keeps both in `rope_parameters`, 4.x in two fields."""
    params = getattr(config, "rope_parameters", None)
    if params:
        scaling = params if params.get("rope_type", "default") != "default" else None
        return float(params["rope_theta"]), scaling
    scaling = getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(getattr(config, "rope_theta", 10000.0)), scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's long-context rule: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = scaling["factor"]
    low_factor, high_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    blend = ((original_len / wavelen - low_factor) / (high_factor - low_factor)).clamp(0, 1)
    # blend is 0 for wavelengths longer than original_len / low_factor and 1 below original_len / high_factor.
    return (1 - blend) * inv_freq / factor + blend * inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type"))
            if rope_type != "llama3":
                raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, llama3)")
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # Kept in fp32 whatever the model dtype, and out of the state dict: it is derived, not loaded.
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, [T, 1, head_dim]: computed once per step and shared by every layer."""
        cos, sin = self.cos_sin[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by the positions' angles ("rotate half" layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
