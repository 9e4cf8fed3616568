"""The decode step under `torch.compile` (`enforce_eager=False`): the whole model as one graph, its output each row's
final hidden state (the LM head runs after it, in engine/model_runner.py, so that a greedy step can ask the head
for its tokens without every logit: layers/greedy_head.py).

Which engines: CUDA's (its CUDA graphs), and a CPU's where some weight waits for oneDNN's prepacking, which only
freezing does inside a graph; every other CPU engine runs its decode step as AOTInductor packages
(engine/packaged.py), which start in seconds once made.

Which steps: decode-only steps, where every sequence computes one token and samples it. Prefill and mixed steps
run the eager model: their span structure changes every step (a recompile each time), and their GEMMs are large
enough that a graph gains little over eager.

What the graph does differently from eager, and why:
- The linears multiply through our packed-linear kernel (`layers/linear.py: linear`, `kernels/packed_linear.cpp`)
  in both graphs: the engine packs the float weights for it before compiling (`ShardSpec.build_model`), as plain
  tensors that the graphs take as constants (inductor's freezing). Weights the kernel cannot take (an output count
  that 16 does not divide; fp32 on a CPU without AVX-512 BF16) stay plain for the tracer: freezing then prepacks
  them for oneDNN in the batched graph, and the batch-of-one graph streams them through our GEMV
  (`kernels/gemv.cpp`).
  oneDNN's packed tensors cannot be traced, so once `warm_up` has compiled, the engine prepacks those plain
  weights for the eager steps (the graphs never read them again), and any later recompile, which could not trace
  them, is refused.
- Each layer's K/V pool tensor is written in place by the graph (an `index_put_` that inductor keeps in place on
  the graph input), never copied; tests/integration/test_compiled.py checks the pool is not copied.
- The batch size and the block-table width are dynamic, except that a batch of one gets a graph of its own (torch
  specialises sizes 0 and 1) and block tables are padded to two columns: two compiles in all, both made by
  `warm_up` when the engine starts, so no request waits for one. Graphs whose weights are all packed for our
  kernel are kept in inductor's on-disk graph cache, keyed by the weights' shapes (the model's own weights are
  bound to them when loaded): SmolLM2's two compile in 20-25 s on 2 Zen 4 cores once cached, ~75 s before (45 s
  and ~3 min on a Zen 3). Frozen oneDNN weights cannot be pickled, so a graph that holds any bypasses that cache and
  compiles at every start. Most of a cached start is dynamo's tracing and AOTAutograd, whose own cache refuses
  frozen graphs: unfrozen, the start halves but each one-row step is 2-4% slower (docs/benchmarks.md).
- Guards on module attributes are skipped (they cost about 1 ms per step with quantized weights, checked every
  call): the graphs read no weight from the module, and the pool tensors are never rebound.
- On CUDA the graph is replayed as CUDA graphs (inductor's cudagraph trees): `warm_up` captures one for each batch
  size of a ladder (powers of two up to `max_num_seqs`; a batch runs in the next size up), and every block table is
  padded to the longest a sequence can have, so those graphs serve every step and no request waits for a capture.
  On an H200 (2026-12-04) the replayed steps gave the eager engine's tokens (tests/integration/test_gpu.py), when
  graphs were still captured as shapes came up. Its start there is not measured yet: SmolLM2's had not finished
  after more than 2 minutes of a benchmark run.
"""

from __future__ import annotations

import hashlib
import logging
import time
import types
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

from liteinfer import kernels
from liteinfer.cache import KVCache
from liteinfer.engine.step_inputs import StepInputs
from liteinfer.layers import AttentionMetadata

logger = logging.getLogger(__name__)


def _decode_hidden(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
    return model(input_ids, positions, meta)


class _KeyedOnOurKernels(CustomGraphPass):
    """A pass that changes nothing: its uuid, a hash of our kernels' sources, joins the key of inductor's on-disk
    cache. The key covers the graph, not the ops it calls: after an op gained optional arguments, a graph compiled
    against its old schema was found in the cache and called it with the old argument count (a segfault)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> str:
        digest = hashlib.sha256()
        for path in kernels.source_files():
            digest.update(path.read_bytes())
        return digest.hexdigest()


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def cpu_example_batch() -> int:
    """The batch at which a CPU's batched decode graph is traced. Inductor takes the traced sizes as the hints by which
    it decides which of its loops run in parallel, for every batch the graph then runs: traced at 2 rows, its rotary
    and K/V-write kernel ran on one thread while the other waited, at every batch size (~0.6 ms of a 29 ms step of 32
    sequences on 2 threads; docs/benchmarks.md). So a batch worth splitting: 8 rows a thread, 32 at least."""
    return max(32, 8 * torch.get_num_threads())


class CompiledDecoder:
    def __init__(self, model: nn.Module, kv_cache: KVCache, max_num_seqs: int, max_blocks_per_seq: int):
        self.model = model
        self.warmed_up = False
        # On CUDA each step replays a CUDA graph (inductor's cudagraph trees), one per batch size of the ladder;
        # tables are all max_blocks_per_seq wide. The pool stays at one address, so the graphs write it in place
        # rather than copying it in and out.
        self.cuda_graphs = kv_cache.device.type == "cuda"
        self.graph_batch_sizes = [1 << i for i in range(_next_power_of_two(max_num_seqs).bit_length())]
        self.max_blocks_per_seq = max_blocks_per_seq
        if self.cuda_graphs:
            for pool in kv_cache.k + kv_cache.v:
                torch._dynamo.mark_static_address(pool)
        # torch.compile keeps its graphs on the code object it compiles, and with module guards skipped it would not
        # tell two models apart: a private copy of the code gives this model graphs of its own, so another engine in
        # the same process never runs with this one's frozen weights.
        code = _decode_hidden.__code__.replace()
        self._compiled = torch.compile(
            types.FunctionType(code, _decode_hidden.__globals__, _decode_hidden.__name__),
            fullgraph=True,  # a graph break would bring per-layer Python back: refuse it
            # Only the sizes `__call__` marks dynamic are: without it dynamo would also make dynamic any size it saw
            # change between compiles of this code, and it counts every engine's private copy as the same code (by
            # file and line), so an engine built after one of other shapes compiled its K/V pools' head size as a
            # symbol, missing inductor's cache and its kernels specialised on it.
            dynamic=False,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                     "triton.cudagraphs": self.cuda_graphs},
        )

    def __call__(self, step: StepInputs) -> torch.Tensor:
        meta = step.meta
        input_ids, positions, blocks, offsets = step.input_ids, meta.positions, meta.slot_blocks, meta.slot_offsets
        tables = meta.decode_block_tables
        batch, width = tables.shape
        if self.cuda_graphs and batch > 1:
            # Extra rows repeat the first: they write the same K/V to the same slot, and their outputs are dropped.
            rows = F.pad(torch.arange(batch, device=tables.device), (0, _next_power_of_two(batch) - batch))
            input_ids, positions, blocks, offsets, tables = (t[rows] for t in (input_ids, positions, blocks, offsets,
                                                                               tables))
        # Padding columns are block 0, masked out by position like any other padding.
        padded_width = max(2, self.max_blocks_per_seq if self.cuda_graphs else width)
        if padded_width > width:
            tables = F.pad(tables, (0, padded_width - width))
        if batch > 1:
            for tensor in (input_ids, positions, blocks, offsets, tables):
                torch._dynamo.mark_dynamic(tensor, 0)
        torch._dynamo.mark_dynamic(tables, 1)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's hidden states are consumed
        meta = replace(meta, positions=positions, slot_blocks=blocks, slot_offsets=offsets, decode_block_tables=tables)
        # After warm-up the model's weights are prepacked for eager steps, which the compiler cannot trace: an
        # unplanned shape must fail loudly rather than recompile.
        with torch.compiler.set_stance("fail_on_recompile" if self.warmed_up else "default"):
            return self._compiled(self.model, input_ids, positions, meta)[:batch]

    @torch.inference_mode()
    def warm_up(self, device: torch.device) -> None:
        """Compile both graphs now (batch of one and any other batch), and on CUDA capture the ladder's CUDA graphs,
        on dummy decodes that write block 0 only, before any sequence holds a block."""
        logger.info("compiling the decode step (torch.compile, two graphs)...")
        start = time.perf_counter()
        # Compile-time settings, so they are needed here only.
        with (
            # The generated code's checks of every buffer's size and alignment: ~200 Python calls per step, on
            # tensors that dynamo's guards and the kernels' own checks already cover.
            torch._inductor.config.patch(freezing=True, size_asserts=False, alignment_asserts=False,
                                         post_grad_custom_post_pass=_KeyedOnOurKernels()),
            # The graphs' kernels called from C++ (inductor's cpp_wrapper), not from a Python wrapper: 0.4-0.7 ms
            # less per step at 4-128 sequences (docs/benchmarks.md), cached on disk like the Python ones. CUDA
            # graphs replay the Python wrapper's kernels instead.
            torch._inductor.config.patch(cpp_wrapper=not self.cuda_graphs),
            # Without it, a batch that happens to equal the table width at the first compile would tie the two.
            torch.fx.experimental._config.patch(use_duck_shape=False),
            # A graph per batch size of the ladder is planned, not the runaway recompiles this warns of.
            torch._inductor.config.patch({"triton.cudagraph_dynamic_shape_warn_limit": None}),
        ):
            for batch in self.graph_batch_sizes if self.cuda_graphs else (1, cpu_example_batch()):
                ids = torch.zeros(batch, dtype=torch.long, device=device)
                meta = AttentionMetadata(
                    slot_blocks=ids.clone(),
                    slot_offsets=ids.clone(),
                    positions=ids.clone(),
                    decode_block_tables=torch.zeros(batch, 2, dtype=torch.long, device=device),
                    prefills=[],
                )
                # On CUDA a shape's first run is cudagraph trees' eager warm-up; its second is captured.
                for _ in range(2 if self.cuda_graphs else 1):
                    self(StepInputs(ids, meta, torch.arange(batch, device=device), batch))
        self.warmed_up = True
        logger.info("decode step compiled in %.0f s", time.perf_counter() - start)
