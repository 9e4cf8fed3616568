"""The K/V pool, sized from a memory budget and bound to the model's attention layers."""

from __future__ import annotations

import torch
from torch import nn

from liteinfer import huge_pages, kernels
from liteinfer.layers import PagedAttention


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, int8: bool = False):
        # Indexed [blocks, kv_heads, block_size, dim], a block's rows for one KV head one contiguous run. On a CPU
        # the runs lie head-major, each head's blocks side by side (a [kv_heads, blocks, ...] tensor permuted to
        # that indexing; the kernels step by the pool's strides, kernels/pool_runs.h): decode attention reads one
        # head's blocks of a sequence in turn, so a sequence's consecutive blocks are one run. With 32-token blocks
        # it ran 13% faster over pools laid out so than over a block's heads side by side (the AMD Zen 4, 32 and 256
        # sequences, block tables in order and shuffled; benchmarks.md, "2026-12-06 (22:55"). With 16-token blocks
        # and an earlier kernel, heads side by side had been the faster (25-30% over scattered blocks). CUDA's
        # pools stay block-major (contiguous): unmeasured there.
        # One tensor per layer rather than views of one base: a compiled step (engine/compiled.py) then updates
        # each layer's own input in place; views of one base are aliased inputs, which torch.compile's AOTAutograd
        # merges into one synthetic base, the whole pool, when they are written.
        # Zeroed, not empty: attention over a gathered copy (CUDA, or CPU without liteinfer.kernels) multiplies
        # masked-out (probability 0) slots by their values, and 0 * NaN from uninitialised memory would poison the
        # output. The CPU kernel never reads past a sequence's position.
        # int8 (kv_cache_dtype="int8"): K as uint8 with four elements of a key side by side, V as int8 with four
        # keys' elements side by side, each row's scale in k_scales / v_scales (the layout is in
        # liteinfer/kernels/__init__.py; PagedAttention writes it).
        if int8 and head_dim % 4:
            raise ValueError(f"kv_cache_dtype='int8' lays four elements of a key side by side: it needs a head size "
                             f"divisible by 4, the model's is {head_dim}")
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        k_shape = (num_blocks, num_kv_heads, head_dim // 4, block_size, 4) if int8 else shape
        v_shape = (num_blocks, num_kv_heads, block_size // 4, head_dim, 4) if int8 else shape
        self.k = [pool_tensor(k_shape, torch.uint8 if int8 else dtype, device) for _ in range(num_layers)]
        self.v = [pool_tensor(v_shape, torch.int8 if int8 else dtype, device) for _ in range(num_layers)]
        self.k_scales = [pool_tensor(shape[:3], torch.float32, device) if int8 else None for _ in range(num_layers)]
        self.v_scales = [pool_tensor(shape[:3], torch.float32, device) if int8 else None for _ in range(num_layers)]
        self.int8 = int8
        self.device = device
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        int8: bool = False) -> int:
        row_bytes = head_dim + 4 if int8 else head_dim * dtype.itemsize  # int8: a byte an element and an fp32 scale
        return 2 * num_layers * block_size * num_kv_heads * row_bytes

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the pool, layer by layer: K, V, and with int8 their scales (the order `bind` takes)."""
        layers = zip(self.k, self.v, self.k_scales, self.v_scales)
        return [tensor for layer in layers for tensor in layer if tensor is not None]

    def bind(self, model: nn.Module, tensors: list[torch.Tensor] | None = None) -> None:
        """Point each attention layer, in model order, at its own slice of the pool; or at `tensors`, laid out as
        `tensors()` gives them (engine/packaged.py binds its step's inputs so while it traces)."""
        layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        if len(layers) != len(self.k):
            raise ValueError(f"model has {len(layers)} attention layers, the cache was sized for {len(self.k)}")
        tensors = iter(self.tensors() if tensors is None else tensors)
        for attn in layers:
            attn.k_cache, attn.v_cache = next(tensors), next(tensors)
            attn.k_scales, attn.v_scales = (next(tensors), next(tensors)) if self.int8 else (None, None)
        if self.device.type == "cpu":
            kernels.load()  # the decode attention that reads these pools where they lie


def pool_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool of `shape` ([blocks, kv_heads, ...]), as every tensor of a `KVCache` is made: on a CPU head-major
    and on huge pages (liteinfer/huge_pages.py), as the weights are: decode attention streams through a sequence's
    blocks."""
    if device.type == "cpu":
        return huge_pages.zeros((shape[1], shape[0], *shape[2:]), dtype).transpose(0, 1)
    return torch.zeros(shape, dtype=dtype, device=device)
