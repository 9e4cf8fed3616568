"""Rotary position embedding (the Hugging Face "rotate half" layout), with llama3, linear, longrope and yarn scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from liteinfer import kernels


def rope_parameters(config: Any, layer_type: str | None = None) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from a transformers config: 5.x keeps both in `rope_parameters` (one dict per layer type
    where layer types differ, as in Gemma 3: pass `layer_type`), 4.x in two fields."""
    params = getattr(config, "rope_parameters", None)
    if params and layer_type in params:
        params = params[layer_type]
    if params:
        theta, scaling = float(params["rope_theta"]), params
    else:
        theta, scaling = float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None) or {}
    if scaling.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        scaling = None
    elif rope_type == "longrope" and not scaling.get("factor"):
        # The model's own extension, from its config: the context served (`RotaryEmbedding`'s) may be shorter.
        scaling = {**scaling, "factor": config.max_position_embeddings / scaling["original_max_position_embeddings"]}
    return theta, scaling


def positions_served(config: Any) -> int:
    """The longest context the model's rope serves: max_position_embeddings, but with YaRN what it was made for,
    original_max_position_embeddings x factor (vLLM's rule: Qwen's model cards add YaRN to a config whose
    max_position_embeddings is the original context). Linear scaling keeps max_position_embeddings: Hub configs
    store the extended length there (Gemma 3's do), which vLLM multiplies by the factor once more."""
    layer_types = set(getattr(config, "layer_types", None) or [None])
    served = config.max_position_embeddings
    for layer_type in layer_types:
        _, scaling = rope_parameters(config, layer_type)
        if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
            served = int(scaling["original_max_position_embeddings"] * scaling["factor"])
    return served


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's long-context rule: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = scaling["factor"]
    low_factor, high_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    blend = ((original_len / wavelen - low_factor) / (high_factor - low_factor)).clamp(0, 1)
    # blend is 0 for wavelengths longer than original_len / low_factor and 1 below original_len / high_factor.
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def _yarn(powers: torch.Tensor, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023): (inverse frequencies, factor scaling cos and sin). A pair that turns more than
    `beta_fast` times over the original context keeps its frequency, one that turns less than `beta_slow` times is
    interpolated (divided by `factor`), and the pairs between blend the two along a linear ramp; cos and sin grow
    with log(factor) to keep attention's entropy over the longer context."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    head_dim = 2 * len(powers)

    def pair_turning(turns: float) -> float:  # the (fractional) pair whose wavelength fits `turns` times in original
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    first, last = pair_turning(scaling.get("beta_fast") or 32), pair_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, head_dim - 1)
    ramp = ((torch.arange(len(powers), dtype=torch.float32) - first) / ((last - first) or 1e-3)).clamp(0, 1)
    inv_freq = (1 - ramp) / powers + ramp / (factor * powers)

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:  # DeepSeek's: the ratio of two such scales
            attention_factor = _yarn_scale(factor, mscale) / _yarn_scale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_scale(factor)
    return inv_freq, attention_factor


def _yarn_scale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _longrope_inv_freq(
    powers: torch.Tensor, max_position: int, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: (inverse frequencies, factor scaling cos and sin); each frequency has its own divisor.

    The divisors are `long_factor` when the positions served (`max_position`, the engine's max_model_len) run past
    the original context, else `short_factor`: llama.cpp's rule, by context size. transformers picks per forward
    pass by the sequence's length instead, and recomputes the sequence's whole cache when it grows past the original
    context; cached K/V shared between sequences (prefix caching) cannot follow each sequence's length, so here the
    context decides.
    The two agree on every sequence when the context fits in the original one, and otherwise on every sequence
    whose prompt runs past it.
    """
    original = scaling["original_max_position_embeddings"]
    factor = scaling["factor"]  # the model's (`rope_parameters`), not the context served
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:  # the paper's default: make up for the entropy of the longer context
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    divisors = scaling["long_factor" if max_position > original else "short_factor"]
    return 1.0 / (torch.tensor(divisors, dtype=torch.float32) * powers), attention_factor


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        inv_freq = 1.0 / powers
        rope_type = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
        attention_factor = 1.0
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":  # positions interpolated: angles shrink by `factor`
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "longrope":
            inv_freq, attention_factor = _longrope_inv_freq(powers, max_position, scaling)
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn(powers, theta, scaling)
        elif rope_type is not None:
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r} (supported: default, llama3, linear, longrope, yarn)"
            )
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor
        # Kept in fp32 whatever the model dtype, and out of the state dict: it is derived, not loaded.
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, [T, 1, head_dim]: computed once per step and shared by every layer."""
        cos, sin = self.cos_sin[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def rotate_queries_and_keys(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary` to q and k, [T, heads, head_dim] each (one kernel call for both in eager steps on CPU)."""
    heads_side_by_side = all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (q, k))
    if kernels.pointwise_takes(q) and cos.dtype == q.dtype and heads_side_by_side:
        return torch.ops.liteinfer.rotary(q, k, cos, sin)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by the positions' angles ("rotate half" layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    half = x1.shape[-1]
    cos1, sin1 = cos[..., :half], sin[..., :half]  # (the two halves of cos and sin are equal)
    # x * cos + rotate_half(x) * sin, half by half: the same roundings, and no rotated copy of x for inductor to write.
    return torch.cat([x1 * cos1 - x2 * sin1, x2 * cos1 + x1 * sin1], dim=-1)
