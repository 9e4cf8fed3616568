"""The linears-only roofline: the model's linear layers and its LM head, and nothing else, over the steps of an
ideal continuous-batching engine. No engine that multiplies by these weights on this machine can beat it, so an
engine's throughput divided by this one's says how much of the step is left to everything else.

Each step computes one token of every sequence whose prompt is done and, with what is left of the token budget,
prompt tokens of the others (chunked prefill, oldest first, as liteinfer's scheduler does); the KV cache is
unbounded (no preemption). The weights are random, of the model's shapes and in the benchmark's precision,
packed the way liteinfer holds them (`layers/linear.py: pack_linears`): a weight's values do not change its speed. The
LM head runs only on the rows that sample. Output token ids are all 0: the harness checks only their count.
"""

from __future__ import annotations

import time

import torch

from benchmarks.metrics import RequestTrace
from benchmarks.runners.base import TORCH_DTYPES, EngineRunner
from benchmarks.workloads import BenchRequest
from liteinfer.layers.linear import linear, pack_linears
from liteinfer.models import get_model_class
from liteinfer.models.source import load_config, resolve_model

# liteinfer's defaults (EngineConfig): a step's token budget with chunked prefill, and the most running sequences.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 256


class LinearsRooflineRunner(EngineRunner):
    timing = ("a simulated step loop that runs only the model's linear layers and LM head for each step's tokens; "
              "each token is stamped when its step's matmuls return")

    def start(self) -> None:
        torch.set_num_threads(self.threads)
        unknown = set(self.spec.options) - {"max_num_batched_tokens", "max_num_seqs"}
        if unknown:
            raise ValueError(f"roofline options are max_num_batched_tokens and max_num_seqs, not {sorted(unknown)}")
        self.budget = self.spec.options.get("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
        self.max_running = self.spec.options.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
        hf_config = load_config(resolve_model(self.model))
        spec = get_model_class(hf_config.architectures).spec(hf_config)
        dtype = getattr(torch, TORCH_DTYPES[self.spec.precision])
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        layer = [(spec.hidden_size, q_size + 2 * kv_size), (q_size, spec.hidden_size),
                 (spec.hidden_size, 2 * spec.intermediate_size), (spec.intermediate_size, spec.hidden_size)]
        model = torch.nn.Module()
        model.linears = torch.nn.ModuleList(
            torch.nn.Linear(n_in, n_out, bias=False, dtype=dtype) for _ in spec.layer_types for n_in, n_out in layer)
        model.lm_head = torch.nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype)
        model.requires_grad_(False)
        pack_linears(model, (torch.nn.Linear,))
        self.linears, self.lm_head = list(model.linears), model.lm_head
        # One contiguous input per width, as each linear gets in the model.
        self.inputs = {n_in: torch.randn(self.budget, n_in, dtype=dtype) for n_in, _ in layer}
        self.details = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                        "max_num_batched_tokens": self.budget, "max_num_seqs": self.max_running,
                        "linears_per_step": len(self.linears) + 1}

    @torch.inference_mode()
    def _step(self, num_tokens: int, num_sampled: int) -> None:
        for module in self.linears:
            linear(self.inputs[module.in_features][:num_tokens], module.weight)
        if num_sampled:
            linear(self.inputs[self.lm_head.in_features][:num_sampled], self.lm_head.weight)

    def run(self, requests: list[BenchRequest]) -> list[RequestTrace]:
        submitted = time.perf_counter()
        traces = [RequestTrace(submitted, [], []) for _ in requests]
        prefilled = [0] * len(requests)  # prompt tokens computed so far, per request
        running: list[int] = []  # admitted and unfinished, oldest first
        waiting = list(range(len(requests)))
        while running or waiting:
            while waiting and len(running) < self.max_running:
                running.append(waiting.pop(0))
            decodes = [i for i in running if prefilled[i] == len(requests[i].prompt_token_ids)]
            budget = self.budget - len(decodes)
            sampling = list(decodes)
            for i in running:
                remaining = len(requests[i].prompt_token_ids) - prefilled[i]
                if remaining and budget:
                    chunk = min(remaining, budget)
                    prefilled[i] += chunk
                    budget -= chunk
                    if chunk == remaining:
                        sampling.append(i)
            self._step(self.budget - budget, len(sampling))
            now = time.perf_counter()
            for i in sampling:
                traces[i].token_ids.append(0)
                traces[i].token_times.append(now)
            running = [i for i in running if len(traces[i].token_ids) < requests[i].output_len]
        return traces
