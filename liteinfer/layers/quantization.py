"""Weight-only quantization of the linear layers and the LM head, for the CPU: int8 or int4 (the head in int8), each
with a scale and a zero per group of 32 inputs.

Weights are quantized once loaded, from the loaded float weights (no calibration data); activations keep the
model's dtype, and our kernel (kernels/gemv.cpp) multiplies them by the quantized weights directly, at any number of
rows (larger batches a few dozen rows of W at a time in AMX's tiles or, dequantized, in the packed linears':
kernels/__init__.py says where and to what accuracy). Weights that are already such groups come back exactly (a
GGUF's Q4_1 and Q8_0 blocks: SmolLM2's layers and embeddings). At batch 1 a
decode step streams every weight from memory once, so fewer bytes per weight is fewer milliseconds per token; large
batches are bound by arithmetic instead, where quantized weights save memory rather than time (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
from torch import nn

from liteinfer.layers.embedding import LMHead
from liteinfer.layers.linear import Linear, gemv_takes

# int4 in groups of 32: a GGUF's Q4_1 groups (SmolLM2's layers), whose levels it then reproduces (on SmolLM2 in fp32,
# 8 chat prompts x 48 greedy tokens: all 8 identical to the fp32 model, against 0 with groups of 64).
INT4_GROUP_SIZE = 32
_GEMV_INT4_BLOCK = 64  # inputs per block of the GEMV's int4 layout: two groups
INT8_GROUP_SIZE = 32
FP16_MAX = torch.finfo(torch.float16).max


class Int8Weight(nn.Module):
    """W ≈ q * scale + zero per group of INT8_GROUP_SIZE inputs, q in [-128, 127], the scale and zero in fp16 (each
    group on the nearer of two grids: `levels`).

    Groups of 32 over one scale per row: on SmolLM2 (fp32, 8 chat prompts, 48 greedy tokens each) per-row int8 kept 3
    prompts identical to the fp32 model, symmetric groups of 32 5, groups of 64 with a zero 5 and of 32 all 8: the
    GGUF's layers are 4-bit levels in groups of 32, which 255 steps of the same group nearly reproduce. fp16 scales and
    zeros kept all 8, bf16 ones 6 (docs/benchmarks.md); they add 4 bytes to a group's 32.
    """

    def __init__(self, q: torch.Tensor, scales_and_zeros: torch.Tensor):
        super().__init__()
        # Buffers, so that they are named with the model's state: the CPU's packaged decode step is handed them by
        # name (engine/packaged.py).
        self.register_buffer("q", q)  # [out, in] int8
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [out, 2, in / group] fp16: scales, then zeros

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether the weight comes in whole groups of inputs, its values in fp16's range (the zeros are fp16)."""
        return weight.shape[1] % INT8_GROUP_SIZE == 0 and bool(weight.abs().amax() < FP16_MAX / 2)

    @staticmethod
    def levels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [out, in] int8, scales_and_zeros [out, 2, in / group] fp16). Each group takes whichever of two grids
        lands nearer its weights (squared error): its range in 255 steps, or its largest |w| in 127 steps either side
        of zero. Checkpoints often hold weights that are already levels of such a grid in groups of 32 (a GGUF's
        Q4_1 layers and Q8_0 embeddings), which one of the two then nearly reproduces."""
        out_features, in_features = weight.shape
        groups = weight.float().view(out_features, in_features // INT8_GROUP_SIZE, INT8_GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        step = (high - low) / 255
        q, scales, zeros, error = _on_grid(groups, step, low + 128 * step)  # low at level -128, high at 127
        q_sym, scales_sym, zeros_sym, error_sym = _on_grid(groups, torch.maximum(high, -low) / 127,
                                                           torch.zeros_like(low))
        symmetric = error_sym < error
        q = torch.where(symmetric[..., None], q_sym, q)
        scales, zeros = torch.where(symmetric, scales_sym, scales), torch.where(symmetric, zeros_sym, zeros)
        return q.to(torch.int8).view(out_features, in_features), torch.stack([scales, zeros], dim=1)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Weight:
        return cls(*cls.levels(weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gemv_takes(x, any_rows=True):  # one row or many: our kernel is int8's only (kernels/gemv.cpp)
            return torch.ops.liteinfer.gemv(x, self.q, self.scales_and_zeros, None)
        return x @ self.dequantized(x.dtype).T  # (no compiler for the kernels: the same weights, slowly)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return _dequantized(self.q.float(), self.scales_and_zeros, dtype)

    @classmethod
    def dequantize_float(cls, weight: torch.Tensor) -> torch.Tensor:
        """The weight `from_float(weight)` stands for."""
        return cls.from_float(weight).dequantized(torch.float32)


def _dequantized(levels: torch.Tensor, scales_and_zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """levels [out, in] (floats) * scale + zero per group, from scales_and_zeros [out, 2, groups] as both quantized
    forms hold them (a row's scales, then its zeros), in fp32, then in `dtype`."""
    out_features, in_features = levels.shape
    scales, zeros = scales_and_zeros.float().unbind(1)
    groups = levels.view(out_features, scales.shape[1], -1)
    return (groups * scales[..., None] + zeros[..., None]).view(out_features, in_features).to(dtype)


def _on_grid(groups: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`groups` [..., group] on int8's grid q * scale + zero, one per group: (q in [-128, 127] as floats, the scales
    and zeros in fp16, each group's squared error). The scale and zero are rounded to fp16 before the levels are
    chosen, so that the levels make up for it; fp16's smallest step keeps a group of equal values from a zero scale."""
    scales, zeros = scales.clamp(min=2**-24).half(), zeros.half()
    q = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None]).clamp(-128, 127)
    error = (q * scales.float()[..., None] + zeros.float()[..., None] - groups).square().sum(-1)
    return q, scales, zeros, error


class Int4Weight(nn.Module):
    """W ≈ (q - 8) * scale + zero per group of INT4_GROUP_SIZE inputs, q in [0, 15] (asymmetric: min..max), the
    scale and zero in the activations' dtype; the levels in our kernel's layout (`gemv_int4_layout`), which takes any
    number of rows (kernels/gemv.cpp). PyTorch's int4 matmul, which took batches before, wanted a second copy of the
    levels in its own packing; on SmolLM2 it ran fp32 batches 30-50x and bf16 batches on an AMX CPU 1.1-6x slower
    than ours, bf16 batches without AMX 1.4-1.6x faster (docs/benchmarks.md).
    """

    def __init__(self, q: torch.Tensor, scales_and_zeros: torch.Tensor):
        super().__init__()
        self.register_buffer("q", q)  # [out, in / 2] bytes in gemv_int4_layout
        # [out, 2, in / group] in the activations' dtype: a row's scales, then its zeros
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether the kernel takes the shape: whole blocks of its layout (two groups)."""
        return weight.shape[1] % _GEMV_INT4_BLOCK == 0

    @staticmethod
    def levels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [out, in] int32 in 0..15, scale, zero [out, in / group]) such that W ≈ (q - 8) * scale + zero."""
        out_features, in_features = weight.shape
        groups = weight.float().view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=1e-8)
        q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
        return q.view(out_features, in_features), scales, low + 8 * scales

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int4Weight:
        q, scales, zeros = cls.levels(weight)
        return cls(gemv_int4_layout(q), torch.stack([scales, zeros], dim=1).to(weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gemv_takes(x, any_rows=True):
            return torch.ops.liteinfer.gemv(x, self.q, self.scales_and_zeros, None)
        return x @ self.dequantized(x.dtype).T  # (no compiler for the kernels: the same weights, slowly)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return _dequantized(gemv_int4_levels(self.q).float() - 8, self.scales_and_zeros, dtype)

    @classmethod
    def dequantize_float(cls, weight: torch.Tensor) -> torch.Tensor:
        """The weight `from_float(weight)` stands for."""
        return cls.from_float(weight).dequantized(torch.float32)


def gemv_int4_layout(q: torch.Tensor) -> torch.Tensor:
    """Levels q [out, in] (0..15) as kernels/gemv.cpp reads them: each block of 64 inputs (two groups) as sixteen
    little-endian 16-bit lanes, lane l holding inputs l, 16 + l, 32 + l, 48 + l from its lowest nibble up; so byte
    2 l + b holds inputs 32 b + l (low nibble) and 32 b + 16 + l (high)."""
    out_features, in_features = q.shape
    # input 32 b + 16 h + l of a block: [out, block, byte of the lane b, low/high nibble h, lane l]
    nibbles = q.to(torch.uint8).view(out_features, in_features // _GEMV_INT4_BLOCK, 2, 2, 16)
    lane_bytes = nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)  # [out, block, byte of the lane, lane]
    return lane_bytes.transpose(-1, -2).contiguous().view(out_features, in_features // 2)


def gemv_int4_levels(packed: torch.Tensor) -> torch.Tensor:
    """The levels q [out, in] (uint8) that `gemv_int4_layout` packed."""
    out_features, half = packed.shape
    lane_bytes = packed.view(out_features, half // 32, 16, 2).transpose(-1, -2)  # [out, block, byte b, lane l]
    nibbles = torch.stack([lane_bytes & 0xF, lane_bytes >> 4], dim=-2)  # [out, block, b, low/high h, l]
    return nibbles.reshape(out_features, half * 2)


QUANTIZATION_METHODS = {"int8": Int8Weight, "int4": Int4Weight}


def quantize_linears(model: nn.Module, method: str) -> int:
    """Replace the float weight of every loaded `Linear` and of the LM head by its quantized form; returns how many
    were quantized.

    The LM head, a fifth of SmolLM2's weights, is quantized to int8 under both methods: on SmolLM2 int4 took 0.8 ms
    less per token with it (6.9 -> 6.1 ms compiled; with an int4 head the model repeated one token), and with int8
    in groups of 32 the head keeps the greedy tokens as the layers do (docs/benchmarks.md; with one int8 scale per
    row it had halved them). A layer whose shape its kernel cannot take keeps its float weight; the embeddings stay
    in the model's dtype (a tied head gets a quantized copy).
    """
    count = 0
    for module in model.modules():
        weight_cls = _quantized_form(module, method)
        if weight_cls is not None:
            module.quantized = weight_cls.from_float(module.weight.data)
            module.weight = None  # the float copy is not needed any more
            count += 1
    return count


def _quantized_form(module: nn.Module, method: str) -> type[Int8Weight] | type[Int4Weight] | None:
    """What `module`'s weight becomes under `method`; None: it stays in floats."""
    if isinstance(module, LMHead):
        weight_cls = Int8Weight
    elif isinstance(module, Linear):
        weight_cls = QUANTIZATION_METHODS[method]
    else:
        return None
    return weight_cls if weight_cls.fits(module.weight) else None
