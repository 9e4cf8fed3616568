"""Tensor-parallel worker processes: ranks 1..N-1 of an engine, started, fed and stopped by rank 0.

Rank 0 is the engine's own process: it schedules, prepares each step's inputs, runs its shard of the forward and
samples. Every other rank is a child process (torch.multiprocessing, spawned) that owns its shard of the weights
and of the KV pool and runs the same forward on each step's inputs, joining rank 0 in the layers' collectives.

Two channels per worker:
- a pipe from rank 0, for start-up and for each step's `StepInputs` (a few KB of int64; see step_inputs.py). A
  pipe, not a collective, because an idle engine sends nothing for as long as it likes, and because the pipe's
  end tells a worker that rank 0 is gone;
- the c10d process group (gloo on CPU, NCCL on CUDA) for the all-reduces and the logits gather inside the step.
  Its rendezvous store listens on a port the OS picks, so any number of engines can share a host.

Failure: a worker that raises sends its traceback up the pipe and exits; one that is killed just exits. Either
way rank 0's next collective or pipe write fails at once (a dead peer's sockets close), and `WorkerPool.check`
turns that into a `WorkerError` naming the rank, its exit code and its traceback. The engine is then down: every
later step raises the same error. Workers are daemon processes, stopped by `shutdown()`, by a finalizer when the
pool is collected, and at interpreter exit.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from transformers import PretrainedConfig

from liteinfer import huge_pages
from liteinfer.cache import KVCache
from liteinfer.distributed import TensorParallelGroup
from liteinfer.engine.step_inputs import StepInputs
from liteinfer.layers import LMHead
from liteinfer.layers.linear import Linear, left_for_onednn, pack_linears
from liteinfer.layers.quantization import quantize_linears
from liteinfer.models import get_model_class
from liteinfer.models.loader import build_model, iter_checkpoint
from liteinfer.models.source import ModelSource

# Connecting to the store; the workers' start-up (imports) happens before they connect, so this is generous.
_STORE_TIMEOUT = timedelta(minutes=5)
_STOP_GRACE_S = 10.0  # how long a worker gets to leave on its own before it is terminated


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the engine cannot continue."""


@dataclass
class ShardSpec:
    """What one rank needs to build its shard of the model and of the KV pool (picklable: sent to workers)."""

    source: ModelSource
    hf_config: PretrainedConfig
    dtype: torch.dtype
    device_type: str  # cpu | cuda; rank r of a CUDA engine uses cuda:r
    block_size: int
    num_threads: int  # torch CPU threads per rank, as rank 0 has them
    max_model_len: int
    quantization: str | None = None  # int8 | int4 weight-only, see layers/quantization.py
    kv_cache_int8: bool = False  # kv_cache_dtype="int8", see cache/kv_cache.py

    def device(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device_type == "cuda" else torch.device("cpu")

    def build_model(self, tp: TensorParallelGroup, device: torch.device, onednn: bool = True) -> nn.Module:
        """onednn=False leaves plain the float weights that our packed linear cannot take, as torch.compile needs
        them to trace (engine/compiled.py)."""
        model_cls = get_model_class(self.hf_config.architectures)
        checkpoint = iter_checkpoint(self.source, self.hf_config, lazy=True)
        model = build_model(model_cls, self.hf_config, self.dtype, device, checkpoint, tp, self.max_model_len)
        if self.quantization is not None:
            quantize_linears(model, self.quantization)
        pack_weights(model, onednn)
        if device.type == "cpu":
            huge_pages.move(model_tensors(model))
        return model

    def kv_cache_dims(self, tp: TensorParallelGroup) -> tuple[int, int, int]:
        """(layers, this rank's KV heads, head dim) of the pool."""
        hf = self.hf_config
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        return hf.num_hidden_layers, tp.kv_head_range(num_kv_heads)[1], head_dim

    def kv_cache(self, tp: TensorParallelGroup, num_blocks: int, device: torch.device) -> KVCache:
        num_layers, num_kv_heads, head_dim = self.kv_cache_dims(tp)
        return KVCache(num_layers, num_blocks, self.block_size, num_kv_heads, head_dim, self.dtype, device,
                       self.kv_cache_int8)


def pack_weights(model: nn.Module, onednn: bool = True) -> None:
    """Pack the float weights that quantization left (all of them without it) for the fastest kernels
    (`layers/linear.py: pack_linears`; with onednn=False, only those torch.compile can trace), and let the head give
    greedy tokens from its logits in bytes and a few exact ones (`LMHead.screen_greedy`) unless the model caps its
    logits (capped logits can tie where the raw ones do not)."""
    pack_linears(model, (Linear, LMHead), onednn)
    if getattr(model, "final_softcap", None) is None:
        for module in model.modules():
            if isinstance(module, LMHead):
                module.screen_greedy()


def weights_left_for_onednn(model: nn.Module) -> bool:
    """Whether `pack_weights(model)` would prepack some float W for oneDNN: W that our kernel does not take."""
    return any(left_for_onednn(module) for module in model.modules() if isinstance(module, (Linear, LMHead)))


def model_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor the forward reads: parameters and buffers (quantized weights' included)."""
    for module in model.modules():
        yield from module.parameters(recurse=False)
        yield from module.buffers(recurse=False)


# Scored prompt positions go through the LM head this many rows a call: a long chunk's [rows, vocab] logits (SmolLM2:
# 400 MB in fp32 at 2,048 rows; a 152k vocabulary's 1.2 GB) are never taken whole, nor their log-softmax.
SCORED_ROWS_AT_ONCE = 256


def head_groups(hidden: torch.Tensor, num_sampling: int) -> list[torch.Tensor]:
    """The rows of `hidden` (a step's `sample_rows`) as every rank gives them to the LM head, one call a group: the
    sampling rows together, then the scored prompt positions `SCORED_ROWS_AT_ONCE` at a time. With tensor
    parallelism each call is a collective, so all ranks must cut alike."""
    groups = [hidden[:num_sampling]] if num_sampling else []
    if len(hidden) > num_sampling:  # (an empty tensor splits into one empty group: a call the other ranks skip)
        groups += hidden[num_sampling:].split(SCORED_ROWS_AT_ONCE)
    return groups


def run_step(model: nn.Module, step: StepInputs) -> None:
    """The forward a rank other than 0 runs: all tokens, then the LM head on the rows of `step.sample_rows` in rank
    0's groups (it gathers the logits)."""
    hidden = sampling_hidden(model, step)
    for rows in [] if hidden is None else head_groups(hidden, step.num_sampling):
        model.compute_logits(rows)


def sampling_hidden(model: nn.Module, step: StepInputs) -> torch.Tensor | None:
    """The forward over all tokens; the final hidden states of the rows of `step.sample_rows` (None when none)."""
    hidden = model(step.input_ids, step.meta.positions, step.meta)
    return hidden[step.sample_rows] if len(step.sample_rows) else None


class WorkerPool:
    """Rank 0's handle on ranks 1..N-1."""

    def __init__(self, store: dist.TCPStore):
        self.store = store  # the rendezvous; kept for as long as the group lives
        self.processes: list[mp.Process] = []
        self.conns: list[Connection] = []  # rank 0's end of each worker's pipe
        self.error: WorkerError | None = None
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns)

    @classmethod
    def start(cls, spec: ShardSpec, size: int) -> tuple[WorkerPool, TensorParallelGroup]:
        """Spawn ranks 1..size-1 and join them in one group; returns the pool and rank 0's group."""
        # Port 0: the OS picks a free one, and the workers are told which.
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=_STORE_TIMEOUT, wait_for_workers=False)
        context = mp.get_context("spawn")
        pool = cls(store)
        try:
            for rank in range(1, size):
                ours, theirs = context.Pipe()
                process = context.Process(
                    target=_worker_main, args=(rank, size, store.port, theirs, spec),
                    name=f"liteinfer-tp-rank{rank}", daemon=True,
                )
                process.start()
                theirs.close()  # the worker's end lives in the worker only, so its death reads as EOF here
                pool.processes.append(process)
                pool.conns.append(ours)
            for rank in range(1, size):
                pool._expect(rank, "starting")
            tp = TensorParallelGroup.connect(store, 0, size, spec.device(0))
        except BaseException:
            pool.shutdown()
            raise
        return pool, tp

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Have every worker allocate its pool of `num_blocks` blocks (rank 0 decided how many) and wait."""
        for conn in self.conns:
            conn.send(num_blocks)
        for rank in range(1, len(self.conns) + 1):
            self._expect(rank, "loading its shard")

    def send(self, step: StepInputs) -> None:
        if self.error is not None:
            raise self.error
        data = step.to_bytes()
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as exc:
            self.check(failed=exc)
            raise

    def check(self, failed: BaseException | None = None) -> None:
        """Raise `WorkerError` if a worker has died. After a failed collective or pipe write (`failed`), give the
        dead worker a moment to finish exiting, so that its exit is seen rather than raced."""
        if self.error is None:
            for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
                if failed is not None:
                    process.join(_STOP_GRACE_S / len(self.processes))
                if process.exitcode is not None:
                    self.error = WorkerError(f"tensor-parallel worker rank {rank} died (exit code "
                                             f"{process.exitcode}){_last_words(conn)}; the engine is stopped")
                    break
        if self.error is not None:
            self.shutdown()
            raise self.error from failed

    def shutdown(self) -> None:
        self._finalizer()

    def _expect(self, rank: int, doing: str) -> None:
        """Wait for worker `rank`'s next message ("ok"); raise `WorkerError` if it fails or dies instead."""
        process, conn = self.processes[rank - 1], self.conns[rank - 1]
        wait([conn, process.sentinel])
        try:
            message = conn.recv() if conn.poll() else None
        except EOFError:  # died without a word
            message = None
        if message == "ok":
            return
        if isinstance(message, tuple):  # ("error", traceback)
            detail = f":\n{message[1]}"
        else:
            process.join(_STOP_GRACE_S)
            detail = f" (exit code {process.exitcode})"
        self.error = WorkerError(f"tensor-parallel worker rank {rank} failed while {doing}{detail}")
        self.shutdown()
        raise self.error


def _last_words(conn: Connection) -> str:
    """The traceback a worker sent before it exited, if it sent one."""
    try:
        while conn.poll():
            message = conn.recv()
            if isinstance(message, tuple) and message[0] == "error":
                return f":\n{message[1]}"
    except (EOFError, OSError):
        pass
    return ""


def _stop(processes: list[mp.Process], conns: list[Connection]) -> None:
    """Ask each worker to leave (an empty step), then terminate any that has not within the grace period."""
    for conn in conns:
        with contextlib.suppress(OSError):  # already gone
            conn.send_bytes(b"")
    for process in processes:
        process.join(_STOP_GRACE_S)
        if process.is_alive():
            process.terminate()
            process.join(1)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()


def freeze_startup_objects() -> None:
    """For a process of our own (a worker, a replica, the server): what start-up made (torch, the model, the tokenizer:
    ~370,000 objects for SmolLM2) lives as long as the process, so it is moved out of the garbage collector's reach.
    A full collection then scans only what came since, where it would otherwise stop the process for ~0.2 s
    (docs/benchmarks.md), and a tensor-parallel worker's pause stalls every rank at the next collective. Not done in
    a user's process (`LLM`, `AsyncLLM`): their objects would be frozen too, never again collected as cycles."""
    gc.collect()
    gc.freeze()


def _worker_main(rank: int, size: int, port: int, conn: Connection, spec: ShardSpec) -> None:
    # Ctrl-C reaches the whole process group; rank 0 decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        torch.set_num_threads(spec.num_threads)
        device = spec.device(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=_STORE_TIMEOUT)
        conn.send("ok")
        tp = TensorParallelGroup.connect(store, rank, size, device)
        model = spec.build_model(tp, device)
        spec.kv_cache(tp, conn.recv(), device).bind(model)
        freeze_startup_objects()
        conn.send("ok")
        with torch.inference_mode():
            while data := conn.recv_bytes():
                run_step(model, StepInputs.from_bytes(data, device))
    except EOFError:  # rank 0 is gone; nothing to report to
        return
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
