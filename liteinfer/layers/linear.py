"""Linear layers, whole or sharded over tensor-parallel ranks (Megatron-style).

A column-parallel layer (`PackedLinear`) holds a slice of W's rows, i.e. of the outputs: this rank's attention
heads of q/k/v, its share of the MLP's gate/up. It needs no communication. A row-parallel layer
(`RowParallelLinear`) holds the matching slice of W's columns, multiplies this rank's share of the activations and
sums the partial outputs over the ranks (one all-reduce). Pairing them (q/k/v then o, gate/up then down) costs one
all-reduce per pair. With one rank each is a plain linear.

Loading: each parameter's `weight_loader(param, loaded, shard_id=None)` cuts this rank's slice out of the
checkpoint tensor before copying it. `loaded` is a `torch.Tensor` or a lazy checkpoint tensor with the same
`shape` / `narrow` (see models/loader.py), so only this rank's slice is ever read from the file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from liteinfer import kernels
from liteinfer.distributed import TensorParallelGroup


class Linear(nn.Module):
    """y = x W^T (+ b), with W stored [out, in] as in Hugging Face checkpoints (until packed or quantized)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        # Set by layers/quantization.py once the weights are loaded: then it holds W, and `weight` is None.
        self.quantized: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantized is not None:
            y = self.quantized(x)
            return y if bias is None else y + bias
        return linear(x, self.weight, bias)


# oneDNN picks its prepacked weight layout for about this many rows per GEMM: a full decode batch.
ONEDNN_BATCH_HINT = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b), W as loaded ([out, in]) or packed by `pack_linears`."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if weight.dim() == 4:  # pack_weight's layout
        y = torch.ops.liteinfer.packed_linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return y.view(*x.shape[:-1], y.shape[-1])
    if gemv_takes(x) and weight.dtype == x.dtype and weight.is_contiguous():
        return torch.ops.liteinfer.gemv(x, weight, None, bias)
    return F.linear(x, weight, bias)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    """act(x G^T + b_g) * (x U^T + b_u) in one pass, for W = [G; U] packed by `pack_gate_up`."""
    y = torch.ops.liteinfer.packed_gated_linear(x.reshape(-1, x.shape[-1]), weight, bias, act)
    return y.view(*x.shape[:-1], y.shape[-1])


def gemv_takes(x: torch.Tensor, any_rows: bool = False) -> bool:
    """Whether `kernels`' gemv takes `x`: a single sequence's decode step (any_rows: any number of rows, as int8
    weights take it), on CPU, where it streams W faster than oneDNN does (docs/benchmarks.md)."""
    return (x.dim() == 2 and (any_rows or x.shape[0] == 1) and x.is_cpu and x.dtype in (torch.float32, torch.bfloat16)
            and kernels.available())


PACKED_GROUP = 48  # outputs per group of `pack_weight`'s layout: the kernel's three blocks of 16


def _pair(dtype: torch.dtype) -> int:
    """Inputs per step of the packed layout: the two bf16 that one vdpbf16ps multiplies, or one fp32."""
    return 2 if dtype == torch.bfloat16 else 1


def _float_as_loaded(weight: torch.Tensor) -> bool:
    """W as the checkpoint gave it: [out, in], fp32 or bf16, on the CPU, not packed by either kernel."""
    return (not weight.is_mkldnn and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16))


def packable(weight: torch.Tensor) -> bool:
    """Whether `kernels`' packed_linear takes W: as loaded, in a dtype that this CPU's build multiplies (building the
    kernels if they are not yet), out a multiple of 16 and in one of the step's inputs."""
    return (_float_as_loaded(weight) and weight.shape[0] % 16 == 0 and weight.shape[1] % _pair(weight.dtype) == 0
            and kernels.load() and kernels.packed_linear_available(weight.dtype))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] as packed_linear reads it: outputs in groups of 48 (the last group 16 or 32 when 48 does not
    divide out), each group stored step by step along the inputs, a step holding the group's weights for one input
    pair (bf16) or one input (fp32). Shaped [out / 16, in / pair, 16, pair] to carry out and in; the storage order
    is the kernel's, so index it only through `unpack_weight`."""
    out_features, in_features = weight.shape
    pair = _pair(weight.dtype)
    groups = [group.reshape(len(group), in_features // pair, pair).transpose(0, 1).reshape(-1)
              for group in weight.split(PACKED_GROUP)]
    return torch.cat(groups).view(out_features // 16, in_features // pair, 16, pair)


def pack_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """W = [G; U] (a gated MLP's gate and up rows, [2 * size, in]) as packed_gated_linear reads it: each half packed
    by `pack_weight` on its own, so that their groups of 48 cover the same outputs ([2, size / 16, in / pair, 16,
    pair])."""
    return torch.stack([pack_weight(half) for half in weight.chunk(2)])


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """`pack_weight`'s inverse (and `pack_gate_up`'s): W [out, in]."""
    if packed.dim() == 5:
        return torch.cat([unpack_weight(half) for half in packed])
    blocks, steps, _, pair = packed.shape
    flat, rows = packed.reshape(-1), []
    for start in range(0, blocks * 16, PACKED_GROUP):
        size = min(PACKED_GROUP, blocks * 16 - start)
        rows.append(flat[start * steps * pair:(start + size) * steps * pair].view(steps, size, pair).transpose(0, 1))
    return torch.cat(rows).reshape(blocks * 16, steps * pair)


def packed_entries(weight: torch.Tensor, rows: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """W[rows][:, inputs] of a W packed by `pack_weight`, read where the packed layout keeps them (W [out, in] is
    never unpacked whole)."""
    blocks, steps, _, pair = weight.shape
    out_features, in_features = blocks * 16, steps * pair
    group_start = rows - rows % PACKED_GROUP
    group_size = (out_features - group_start).clamp(max=PACKED_GROUP)
    # pack_weight's order: group by group; in a group, input step by step, each step the group's outputs side by side.
    index = (group_start[:, None] * in_features + (inputs // pair) * (group_size[:, None] * pair)
             + (rows - group_start)[:, None] * pair + inputs % pair)
    return weight.reshape(-1)[index]


def packed_rows(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The given output rows of a W packed by `pack_weight`, packed on their own (padded with zero rows to a multiple
    of 16): `kernels`' packed_rows, a copy of each row's runs."""
    return torch.ops.liteinfer.packed_rows(weight, rows)


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks W of `dtype` on this CPU: bf16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and
    without them oneDNN refuses the reorder (an AVX2-only CPU keeps bf16 W as loaded for PyTorch's own matmul)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def left_for_onednn(module: nn.Module) -> bool:
    """Whether `pack_linears` with `onednn` would prepack `module`'s W for oneDNN, W our kernel does not take."""
    weight = getattr(module, "weight", None)
    return weight is not None and _float_as_loaded(weight) and not packable(weight) and onednn_packs(weight.dtype)


def pack_linears(model: nn.Module, modules: tuple[type[nn.Module], ...], onednn: bool = True) -> None:
    """Repack the loaded float W of each of `modules` (which multiply through `linear`) for the fastest kernel this
    CPU has for it: our packed linear where it takes W (`packable`); otherwise, with `onednn`, oneDNN's blocked
    layout for batches of about ONEDNN_BATCH_HINT rows; otherwise W stays as loaded.

    Our kernel ran SmolLM2's linears about 1.5x faster than oneDNN's prepacked matmul at 32 rows (bf16 and fp32),
    1.2x at one row (bf16), and level with it from 256 rows up; oneDNN prepacked ran 1.15x (bf16) to 1.7x (fp32)
    faster than plain `F.linear` at 32 rows (docs/benchmarks.md). On a CPU with AMX, whose tiles both use for
    bf16, ours ran 1.2-1.3x oneDNN at 32 rows, 0.8-0.9x at 256 and level at 1,024. Both layouts are opaque to the
    checkpoint's loaders, so weights are loaded first; a head tied to the embeddings gets a packed copy of its own
    (the embedding still looks rows up). oneDNN's packed tensors cannot be traced by torch.compile, ours can: the
    compiled engine packs with onednn=False first. A gated MLP's gate/up (`PackedLinear.gated_activation` set) is
    packed in halves for packed_gated_linear where our kernel takes each half (`pack_gate_up`).
    """
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, modules) or weight is None or not _float_as_loaded(weight):
            continue
        if getattr(module, "gated_activation", None) and packable(weight[: weight.shape[0] // 2]):
            packed = pack_gate_up(weight.data)
        elif packable(weight):
            packed = pack_weight(weight.data)
        elif onednn and left_for_onednn(module):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.data, ONEDNN_BATCH_HINT)
        else:
            continue
        module.weight = nn.Parameter(packed, requires_grad=False)


class RowSlice(NamedTuple):
    """The rows a rank holds of one projection: [start, start + size) of the checkpoint tensor's `total`."""

    total: int
    start: int
    size: int

    @classmethod
    def whole(cls, total: int) -> RowSlice:
        return cls(total, 0, total)


class PackedLinear(Linear):
    """Several projections of the same input fused into one matmul (q/k/v, gate/up); column-parallel.

    `shards` names each projection and the rows of it this rank holds, in order; the checkpoint's separate tensors
    are copied (this rank's rows only) into their range by `weight_loader(param, tensor, shard_id)`, so one GEMM
    replaces several. A checkpoint that stores the projections already fused in this order (Phi-3) loads whole,
    with shard_id None: each projection's rows are then cut out of the fused tensor.
    """

    def __init__(self, input_size: int, shards: dict[str | int, RowSlice | int], bias: bool = False):
        shards = {k: RowSlice.whole(s) if isinstance(s, int) else s for k, s in shards.items()}
        super().__init__(input_size, sum(s.size for s in shards.values()), bias)
        self.shards = shards
        # Set by a gated MLP (our kernel's name for its activation) when these are its gate and up: `pack_linears`
        # may then pack W in halves, and `forward` then makes act(gate) * up itself.
        self.gated_activation: str | None = None
        self.shard_offsets: dict[str | int, int] = {}  # where each projection's rows start in our parameter
        offset = 0
        for shard_id, rows in shards.items():
            self.shard_offsets[shard_id] = offset
            offset += rows.size
        for param in self.parameters():
            param.weight_loader = self.load_shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.makes_activation:
            return gated_linear(x, self.weight, self.bias, self.gated_activation)
        return super().forward(x)

    @property
    def makes_activation(self) -> bool:
        """Whether `forward` returns act(gate) * up rather than gate and up (W packed in halves)."""
        return self.weight is not None and self.weight.dim() == 5

    def load_shard(self, param: nn.Parameter, loaded, shard_id: str | int | None = None) -> None:
        shard_ids = list(self.shards) if shard_id is None else [shard_id]
        expected = (sum(self.shards[i].total for i in shard_ids), *param.shape[1:])
        if tuple(loaded.shape) != expected:
            what = "fused tensor" if shard_id is None else f"shard {shard_id!r}"
            raise ValueError(f"{what}: expected shape {expected}, got {tuple(loaded.shape)}")
        offset = 0  # where this projection starts in `loaded`
        for i in shard_ids:
            rows = self.shards[i]
            target = param.data.narrow(0, self.shard_offsets[i], rows.size)
            target.copy_(loaded.narrow(0, offset + rows.start, rows.size))
            offset += rows.total


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T, + b: this rank holds W's columns for its share of the input features (the
    output of a column-parallel layer), and the bias is added once, after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TensorParallelGroup | None = None):
        self.tp = tp or TensorParallelGroup()
        self.input_start, local_input = self.tp.shard(input_size)
        super().__init__(local_input, output_size, bias)
        self.input_size = input_size
        self.weight.weight_loader = self.load_weight

    def load_weight(self, param: nn.Parameter, loaded) -> None:
        expected = (param.shape[0], self.input_size)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expected shape {expected}, got {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(1, self.input_start, param.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias
