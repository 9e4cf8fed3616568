"""A rank's tensor-parallel group: who it is, and the collectives the sharded layers call."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# How long a collective waits for a peer that is alive but silent. A dead peer is noticed at once (its sockets
# close); this only bounds a hang, and it must outlast the slowest rank's step.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """(start, length) of rank's equal share of `total` (which `size` must divide)."""
    if total % size:
        raise ValueError(f"{total} does not split evenly over {size} tensor-parallel ranks")
    length = total // size
    return rank * length, length


@dataclass
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    # The group's own c10d process group (gloo on CPU, NCCL on CUDA); None with one rank. It is built directly,
    # not through init_process_group, so that it is not torch's process-wide default group.
    process_group: dist.ProcessGroup | None = None

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, device: torch.device) -> TensorParallelGroup:
        """Join the group through `store` (blocks until every rank has joined)."""
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            process_group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = COLLECTIVE_TIMEOUT
            # Every rank is on this host: loopback, whatever the host name resolves to.
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            process_group = dist.ProcessGroupGloo(store, rank, size, options)
        return cls(rank, size, process_group)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def shard(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's share of a dimension of size `total`."""
        return shard_range(total, self.rank, self.size)

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds: an equal share, or with fewer KV heads than ranks, the
        one head its query heads use (each KV head then lives on size / num_kv_heads ranks)."""
        if num_kv_heads >= self.size:
            return shard_range(num_kv_heads, self.rank, self.size)
        if self.size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {self.size} ranks")
        return self.rank * num_kv_heads // self.size, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        if self.size > 1:
            self.process_group.allreduce([x]).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """On rank 0, every rank's `x` side by side along the last dimension (rank order); None elsewhere."""
        if self.size == 1:
            return x
        x = x.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        outputs = [[torch.empty_like(x) for _ in range(self.size)]] if self.is_first else []
        self.process_group.gather(outputs, [x], options).wait()
        return torch.cat(outputs[0], dim=-1) if self.is_first else None
