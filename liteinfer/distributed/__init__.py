"""Parallel state: a rank's view of its tensor-parallel group.

Contract: parallel state is an explicit object passed to whoever needs it, never a module-level global, so that
several engines can live in one process or on one host. `TensorParallelGroup` holds a rank's index, the group
size and the two collectives the sharded layers call (a sum across ranks, a gather onto rank 0) over the group's
own c10d process group; with one rank both are the identity and no process group exists. `shard_range` says which
equal share of a dimension a rank holds. Starting and watching the ranks' processes is the engine's business
(`liteinfer.engine.workers`); this package depends on torch only.
"""

from liteinfer.distributed.group import TensorParallelGroup, shard_range

__all__ = ["TensorParallelGroup", "shard_range"]
