"""The CPU's compiled decode step (`enforce_eager=False`) as two AOTInductor packages, kept on disk between runs.

`torch.export` traces the whole model (its output each row's final hidden state: the LM head runs after it, as for
torch.compile's graphs), with each layer's K/V pool as an input the graph writes in place;
`torch._inductor.aoti_compile_and_package` turns that into a shared library in a `.pt2` file. A package holds no
weights: the model's own tensors are handed to it by name when it is loaded (`user_managed`, no copy), so the
package depends on the weights' shapes, not their values, and any model of the same shapes reuses it.

Why not `torch.compile` here (engine/compiled.py, which CUDA keeps for its CUDA graphs, and a CPU whose weights
our kernel does not all take keeps for oneDNN's prepacking, which export cannot trace): every start traced and
lowered the model again, even with inductor's cache warm (SmolLM2 on the Intel Xeon: 37 s to start against 6 s
eager; 5 s with its packages on disk), and every call went through dynamo's and AOTAutograd's Python wrappers
(a step 0.85-1.14 ms longer than the package's at one and 32 sequences; docs/benchmarks.md).

Two packages, as torch.compile makes two graphs: a batch of one (its own shapes, specialised) and every other
batch (batch size, block-table width and pool size dynamic). Tables are padded to two columns at least. Both are
made or loaded by `warm_up`, when the engine starts, so no request waits for one.

The packages' file names are a hash of all that their code depends on (`_package_key`): liteinfer's sources (the
model code and our kernels' schemas), the model's class, config and tensors' shapes, dtypes and strides, the pool's
layout, torch's version, inductor's settings, the CPU (the library is built for the CPU it compiles on) and the thread
count (inductor writes it into its parallel loops). They live in inductor's cache directory
(`TORCHINDUCTOR_CACHE_DIR`, by default under /tmp).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch.export.pt2_archive._package import AOTICompiledModel
from transformers import PretrainedConfig

import liteinfer
from liteinfer.cache import KVCache
from liteinfer.cache.kv_cache import pool_tensor
from liteinfer.engine.compiled import cpu_example_batch
from liteinfer.engine.step_inputs import StepInputs
from liteinfer.layers import AttentionMetadata

logger = logging.getLogger(__name__)

# Inductor's checks of every buffer's size and alignment in the generated code: the kernels check their own inputs.
# The weights stay out of the library: they are the model's own tensors, handed over when a package is loaded.
_INDUCTOR_CONFIG = {"size_asserts": False, "alignment_asserts": False, "aot_inductor.package_constants_in_so": False}
SOURCES = Path(liteinfer.__file__).parent  # all of them: the models' code and our kernels' schemas make the graph
_MAX_BATCH, _MAX_WIDTH, _MAX_BLOCKS = 1 << 16, 1 << 20, 1 << 30  # the dynamic sizes' bounds: far past any engine's


class _DecodeStep(nn.Module):
    """The decode step as export traces it: the step's tensors and the pool are its inputs, the hidden states its
    output."""

    def __init__(self, model: nn.Module, kv_cache: KVCache):
        super().__init__()
        self.model = model
        self.kv_cache = kv_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_blocks: torch.Tensor,
                slot_offsets: torch.Tensor, block_tables: torch.Tensor, *pool: torch.Tensor) -> torch.Tensor:
        self.kv_cache.bind(self.model, list(pool))  # the traced graph writes its inputs, whatever pool they are
        meta = AttentionMetadata(slot_blocks=slot_blocks, slot_offsets=slot_offsets, positions=positions,
                                 decode_block_tables=block_tables, prefills=[])
        return self.model(input_ids, positions, meta)


class PackagedDecoder:
    """Runs the decode-only steps through the two packages, which `warm_up` loads (making those not on disk)."""

    def __init__(self, model: nn.Module, kv_cache: KVCache, hf_config: PretrainedConfig):
        self.step = _DecodeStep(model, kv_cache)
        self.pool = kv_cache.tensors()
        self.hf_config = hf_config
        self.packages: dict[bool, AOTICompiledModel] = {}  # by "a batch of one"

    def __call__(self, step: StepInputs) -> torch.Tensor:
        meta = step.meta
        tables = meta.decode_block_tables
        if tables.shape[1] < 2:  # padding columns are block 0, masked out by position like any other padding
            tables = F.pad(tables, (0, 2 - tables.shape[1]))
        package = self.packages[len(step.input_ids) == 1]
        # The loader's own entry, with the inputs as the package lists them: the package's `__call__` would parse its
        # input and output specs again and flatten the inputs at every call.
        inputs = [step.input_ids, meta.positions, meta.slot_blocks, meta.slot_offsets, tables, *self.pool]
        return package.loader.boxed_run(inputs)[0]

    @torch.inference_mode()
    def warm_up(self, device: torch.device) -> None:
        """Load both packages, compiling the ones not on disk yet."""
        for one in (True, False):
            path = self.package_path(one)
            if not path.exists():
                self._compile(path, one)
            start = time.perf_counter()
            package = torch._inductor.aoti_load_package(str(path))
            tensors = self._weights()
            package.load_constants({name: tensors[name] for name in package.get_constant_fqns()},
                                   check_full_update=True, user_managed=True)
            self.packages[one] = package
            logger.info("loaded the decode step's package for %s in %.1f s", "one sequence" if one else "batches",
                        time.perf_counter() - start)

    def package_path(self, one: bool) -> Path:
        """Where the package for a batch of one (`one`) or for the other batches is kept."""
        return Path(cache_dir()) / "liteinfer" / f"decode-step-{self._package_key(one)}.pt2"

    def _compile(self, path: Path, one: bool) -> None:
        logger.info("compiling the decode step for %s (AOTInductor, once for these shapes)...",
                    "one sequence" if one else "batches")
        start = time.perf_counter()
        # Example sizes, told apart so that export keeps them apart; the batch's is also inductor's hint for its loops.
        batch, width = (1, 3) if one else (cpu_example_batch(), 3)
        # Four tensors, not one four times: export would take one tensor passed twice for one input.
        per_token = [torch.zeros(batch, dtype=torch.long) for _ in range(4)]
        # Export keeps a pool's block count dynamic from 2 blocks only: a pool of one (one sequence of a short context)
        # is traced through a stand-in of its layout.
        pool = [tensor if len(tensor) >= 2 else pool_tensor((2, *tensor.shape[1:]), tensor.dtype, tensor.device)
                for tensor in self.pool]
        inputs = (*per_token, torch.zeros(batch, width, dtype=torch.long), *pool)
        batch_dim = None if one else torch.export.Dim("batch", min=2, max=_MAX_BATCH)
        width_dim = torch.export.Dim("width", min=2, max=_MAX_WIDTH)
        blocks_dim = torch.export.Dim("blocks", min=2, max=_MAX_BLOCKS)
        token_dims = {0: batch_dim} if batch_dim else None
        dynamic_shapes = (token_dims, token_dims, token_dims, token_dims, {0: batch_dim, 1: width_dim} if batch_dim
                          else {1: width_dim}, tuple({0: blocks_dim} for _ in self.pool))
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written under a name of its own, then renamed: an engine starting beside this one never loads half a file.
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
        with warnings.catch_warnings():
            # That forward binds the layers' pools to its inputs is the point; torch's packaging warns of its own
            # use of a deprecated class.
            warnings.filterwarnings("ignore", message="The tensor attributes .* were assigned during export")
            warnings.filterwarnings("ignore", message=".*LeafSpec.* is deprecated", category=FutureWarning)
            try:
                program = torch.export.export(self.step, inputs, dynamic_shapes=dynamic_shapes, strict=False)
            finally:
                self.step.kv_cache.bind(self.step.model)  # tracing bound the layers to its own stand-ins
            # A copy of the settings: the call adds its own to the dict it is given, which the key hashes.
            torch._inductor.aoti_compile_and_package(program, package_path=str(partial),
                                                     inductor_configs=dict(_INDUCTOR_CONFIG))
        os.replace(partial, path)
        logger.info("decode step compiled in %.0f s", time.perf_counter() - start)

    def _weights(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers, by their names in the traced module: what a package reads."""
        return {**dict(self.step.named_parameters(remove_duplicate=False)),
                **dict(self.step.named_buffers(remove_duplicate=False))}

    def _package_key(self, one: bool) -> str:
        digest = hashlib.sha256()
        for source in sorted(p for p in SOURCES.rglob("*") if p.suffix in (".py", ".cpp", ".h")):
            digest.update(source.relative_to(SOURCES).as_posix().encode())
            digest.update(source.read_bytes())
        # Inductor's settings as this process has them: environment variables and code change them, and with them
        # the code it writes (with `cpp.enable_kernel_profile` every kernel call parses a Python stack trace). Not
        # `aot_inductor.metadata`: a compile writes the machine's description into it (the CPU is in the key).
        inductor_config = sorted((name, value) for name, value in torch._inductor.config.save_config_portable().items()
                                 if name != "aot_inductor.metadata")
        parts = [torch.__version__, _cpu_description(), torch.get_num_threads(), one, inductor_config, _INDUCTOR_CONFIG,
                 type(self.step.model).__qualname__, self.hf_config.to_json_string(),
                 [(name, t.shape, t.dtype, t.stride()) for name, t in self._weights().items()],
                 # (their layout by its order of dimensions: a head-major pool's strides hold its number of blocks)
                 [(t.shape[1:], t.dtype, t.dim_order()) for t in self.pool]]
        digest.update(repr(parts).encode())
        return digest.hexdigest()[:32]


def _cpu_description() -> str:
    """This CPU's model and flags: inductor builds a package's library for the CPU it compiles on (-march=native)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return platform.processor()
    first_cpu = cpuinfo.read_text().split("\n\n")[0]
    return "\n".join(line for line in first_cpu.splitlines() if line.startswith(("model name", "flags")))
