"""vLLM (when installed; usually on a CUDA GPU), driven like liteinfer through its engine step loop.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that its timestamps are taken as
outputs arrive and the CUDA memory it allocates is counted. Like liteinfer on CUDA, vLLM reserves most of the
GPU for its KV cache up front (`gpu_memory_utilization`), which its peak memory shows.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is imported; see above

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402

from benchmarks.metrics import RequestTrace  # noqa: E402
from benchmarks.runners.base import TORCH_DTYPES, EngineRunner, run_step_loop  # noqa: E402
from benchmarks.workloads import BenchRequest  # noqa: E402
from liteinfer.models.source import resolve_model  # noqa: E402


class VLLMRunner(EngineRunner):
    timing = "each token is stamped when the LLMEngine.step that produced it returns"

    def start(self) -> None:
        if self.spec.precision not in TORCH_DTYPES:
            raise ValueError(f"the vLLM runner runs {', '.join(TORCH_DTYPES)}, not {self.spec.precision!r}")
        path = resolve_model(self.model).path  # the same weights liteinfer loads
        # The spec's options are vllm.LLM arguments (enforce_eager=true, max_num_seqs=64, quantization=fp8, ...).
        llm = vllm.LLM(model=str(path), dtype=TORCH_DTYPES[self.spec.precision], seed=0, **self.spec.options)
        self.engine = llm.llm_engine
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.details = {"vllm": vllm.__version__, "options": self.spec.options}

    def run(self, requests: list[BenchRequest]) -> list[RequestTrace]:
        return run_step_loop(self.engine, vllm.SamplingParams, RequestOutputKind.DELTA, requests)
