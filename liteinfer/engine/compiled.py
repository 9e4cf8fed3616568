"""The decode step under `torch.compile` (`enforce_eager=False`): the whole model and its LM head as one graph.

Which steps: decode-only steps, where every sequence computes one token and samples it. Prefill and mixed steps
run the eager model: their span structure changes every step (a recompile each time), and their GEMMs are large
enough that a graph gains little over eager.

What the graph does differently from eager, and why:
- Weights are folded in by inductor's freezing, which prepacks every linear for oneDNN; so the model handed to
  `CompiledDecoder` keeps plain float weights (`ShardSpec.build_model(prepack=False)`), which the eager steps then
  multiply unpacked.
- Each layer's K/V pool tensor is written in place by the graph (an `index_copy_` that inductor keeps in place on
  the graph input), never copied; tests/integration/test_compiled.py checks the pool is not copied.
- The batch size and the block-table width are dynamic, except that a batch of one gets a graph of its own (torch
  specialises sizes 0 and 1) and block tables are padded to two columns: two compiles in all, both made by
  `warm_up` when the engine starts, so no request waits for one. Inductor's on-disk cache shortens them on
  later starts.
- Guards on module attributes are skipped (they cost about 1 ms per step with quantized weights, checked every
  call): the engine never rebinds a weight or a pool tensor once it runs.
"""

from __future__ import annotations

import types
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from liteinfer.engine.step_inputs import StepInputs
from liteinfer.layers import AttentionMetadata

# A compile costs 30-60 s on 2 cores; a third graph means a shape we did not plan for, so fail rather than thrash.
_MAX_GRAPHS = 2


def _decode_logits(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
    return model.compute_logits(model(input_ids, positions, meta))


class CompiledDecoder:
    def __init__(self, model: nn.Module):
        self.model = model
        # torch.compile keeps its graphs on the code object it compiles, and with module guards skipped it would not
        # tell two models apart: a private copy of the code gives this model graphs of its own (and frees them with
        # it), so another engine in the same process never runs with this one's frozen weights.
        code = _decode_logits.__code__.replace()
        self._compiled = torch.compile(
            types.FunctionType(code, _decode_logits.__globals__, _decode_logits.__name__),
            fullgraph=True,  # a graph break would bring per-layer Python back: refuse it
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )

    @staticmethod
    def accepts(step: StepInputs) -> bool:
        """A decode-only step in which every row samples."""
        return step.meta.num_decodes == len(step.input_ids) == len(step.sample_rows)

    def __call__(self, step: StepInputs) -> torch.Tensor:
        meta = step.meta
        tables = meta.decode_block_tables
        if tables.shape[1] < 2:  # padding is block 0, masked out by position like any other padding
            tables = F.pad(tables, (0, 2 - tables.shape[1]))
        tensors = (step.input_ids, meta.positions, meta.slot_mapping, tables)
        if len(step.input_ids) > 1:
            for tensor in tensors:
                torch._dynamo.mark_dynamic(tensor, 0)
        torch._dynamo.mark_dynamic(tables, 1)
        with (
            torch._inductor.config.patch(freezing=True),
            # Without it, a batch that happens to equal the table width at the first compile would tie the two.
            torch.fx.experimental._config.patch(use_duck_shape=False),
            torch._dynamo.config.patch(recompile_limit=_MAX_GRAPHS, fail_on_recompile_limit_hit=True),
        ):
            return self._compiled(self.model, step.input_ids, meta.positions, replace(meta, decode_block_tables=tables))

    @torch.inference_mode()
    def warm_up(self, device: torch.device) -> None:
        """Compile both graphs now (batch of one and any other batch) on dummy decodes that write block 0 only,
        before any sequence holds a block."""
        for batch in (1, 2):
            ids = torch.zeros(batch, dtype=torch.long, device=device)
            meta = AttentionMetadata(
                slot_mapping=ids.clone(),
                positions=ids.clone(),
                decode_block_tables=torch.zeros(batch, 2, dtype=torch.long, device=device),
                prefills=[],
            )
            self(StepInputs(ids, meta, torch.arange(batch, device=device)))
