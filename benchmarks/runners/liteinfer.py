"""liteinfer, driven through its engine step loop (the loop `LLM.generate` and `AsyncLLM` run)."""

from __future__ import annotations

from dataclasses import asdict

import torch

from benchmarks.metrics import RequestTrace
from benchmarks.runners.base import TORCH_DTYPES, EngineRunner, run_step_loop
from benchmarks.workloads import BenchRequest
from liteinfer import LLM, RequestOutputKind, SamplingParams


class LiteInferRunner(EngineRunner):
    timing = "each token is stamped when the LLMEngine.step that sampled it returns, as a streaming caller sees it"

    def start(self) -> None:
        torch.set_num_threads(self.threads)
        if self.spec.precision not in TORCH_DTYPES:
            raise ValueError(f"liteinfer runs {', '.join(TORCH_DTYPES)}, not {self.spec.precision!r} "
                             "(other variants are engine options: liteinfer:bf16:key=value)")
        # The spec's options are EngineConfig fields, which validates them (an unknown one fails loudly).
        self.engine = LLM(self.model, dtype=TORCH_DTYPES[self.spec.precision], **self.spec.options).engine
        self.device = self.engine.device.type
        self.details = {"engine_config": asdict(self.engine.config), "torch": torch.__version__,
                        "threads": torch.get_num_threads()}

    def run(self, requests: list[BenchRequest]) -> list[RequestTrace]:
        return run_step_loop(self.engine, SamplingParams, RequestOutputKind.DELTA, requests)
