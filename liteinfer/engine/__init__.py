"""The engine core: requests in, tokens out, one forward pass per step.

Contract: `LLMEngine` owns every running request. `add_request` validates and queues (raising `ValueError` before
anything is queued), `step` asks the `Scheduler` for a batch, has the `ModelRunner` run the model and sample, and
hands back a `RequestOutput` for every request that advanced; `abort_request` ends a request and frees its blocks
at once. When KV blocks run out the scheduler preempts and recomputes rather than failing, and a failure inside one
request ends that request alone. The engine never blocks on I/O and holds no threads: sync and async front ends
drive the same `step`. `AsyncLLM` is the async one: a background loop that runs `step` off the event loop's
thread, with per-request streams, cancellation and a bounded queue. With `speculative_config` a decode step also
computes prompt lookup's draft tokens and keeps those its own samples confirm (`speculative`): the same tokens, in
fewer steps. With `tensor_parallel_size` > 1 the engine's
process is rank 0 and `workers` runs the other ranks (a dead one raises `WorkerError`); with `data_parallel_size`
> 1 both front ends drive `data_parallel.DataParallelEngine`, the same request interface over Ray replicas.
"""

from liteinfer.engine.async_llm import AsyncLLM
from liteinfer.engine.llm_engine import LLMEngine

__all__ = ["AsyncLLM", "LLMEngine"]
