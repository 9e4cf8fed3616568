"""Linear layers whose weights come from one checkpoint tensor or from several packed together."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b), with W stored [out, in] as in Hugging Face checkpoints."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """Several projections of the same input fused into one matmul (q/k/v, gate/up).

    `shards` names each projection and its output width in order; the checkpoint's separate tensors are copied
    into their row range by `weight_loader(param, tensor, shard_id)`, so one GEMM replaces several. A checkpoint
    that stores the projections already fused in this order (Phi-3) loads whole, with shard_id None.
    """

    def __init__(self, input_size: int, shards: dict[str | int, int], bias: bool = False):
        super().__init__(input_size, sum(shards.values()), bias)
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shards.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for param in self.parameters():
            param.weight_loader = self.load_shard

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        target = param.data if shard_id is None else param.data.narrow(0, *self.shard_offsets[shard_id])
        if target.shape != loaded.shape:
            what = "fused tensor" if shard_id is None else f"shard {shard_id!r}"
            raise ValueError(f"{what}: expected shape {tuple(target.shape)}, got {tuple(loaded.shape)}")
        target.copy_(loaded)
