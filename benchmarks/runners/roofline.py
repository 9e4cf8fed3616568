"""The linears-only roofline: the model's linear layers and its LM head, and nothing else, over the steps of an
ideal continuous-batching engine. No engine that multiplies by these weights on this machine can beat it, so an
engine's throughput divided by this one's says how much of the step is left to everything else.

Each step computes one token of every sequence whose prompt is done and, with what is left of the token budget,
prompt tokens of the others (chunked prefill, oldest first, as liteinfer's scheduler does); the KV cache is
unbounded (no preemption). The weights are random, of the model's shapes and in the benchmark's precision,
packed the way liteinfer holds them (`layers/linear.py: pack_linears`) and on huge pages as the engine's are
(`liteinfer/huge_pages.py`; on 4 KiB pages SmolLM2's 32-row linears streamed up to ~25% slower): a weight's values do
not change its speed. The LM head runs only on the rows that sample. Output token ids are all 0: the harness checks
only their count.

With `kv_reads=auto` (K/V in the benchmark's precision) or `kv_reads=int8` (a byte an element and an fp32 scale a
row, as `kv_cache_dtype="int8"` stores them), each step also reads the bytes that its attention must read from the
KV cache: every layer's K and V rows of each sequence's context (its keys up to the step's last token; sliding
windows are not taken off), once, as one plain fp32 sum over a buffer that holds them all (on huge pages, as the
engine's pools are; a streaming read: about the machine's memory bandwidth once the bytes outgrow its caches, and
served from its caches when they do not, as an engine's would be). That is the ceiling for an engine whose attention
reads its cache once a step and does nothing else; the linears-only roofline is not changed by it.
"""

from __future__ import annotations

import time

import torch

from benchmarks.metrics import RequestTrace
from benchmarks.runners.base import TORCH_DTYPES, EngineRunner
from benchmarks.workloads import BenchRequest
from liteinfer import huge_pages
from liteinfer.cache import KVCache
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
        unknown = set(self.spec.options) - {"max_num_batched_tokens", "max_num_seqs", "kv_reads"}
        if unknown:
            raise ValueError("roofline options are max_num_batched_tokens, max_num_seqs and kv_reads, "
                             f"not {sorted(unknown)}")
        self.budget = self.spec.options.get("max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
        self.max_running = self.spec.options.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
        kv_reads = self.spec.options.get("kv_reads")
        if kv_reads not in (None, "auto", "int8"):
            raise ValueError(f"kv_reads is auto (the benchmark's precision) or int8, not {kv_reads!r}")
        hf_config = load_config(resolve_model(self.model))
        spec = get_model_class(hf_config.architectures).spec(hf_config)
        dtype = getattr(torch, TORCH_DTYPES[self.spec.precision])
        # A key's K and V rows in every layer, or 0: no cache read.
        self.kv_bytes_per_key = 0 if kv_reads is None else KVCache.bytes_per_block(
            len(spec.layer_types), 1, spec.num_kv_heads, spec.head_dim, dtype, int8=kv_reads == "int8")
        self.kv_buffer = torch.empty(0)
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        layer = [(spec.hidden_size, q_size + 2 * kv_size), (q_size, spec.hidden_size),
                 (spec.hidden_size, 2 * spec.intermediate_size), (spec.intermediate_size, spec.hidden_size)]
        model = torch.nn.Module()
        model.linears = torch.nn.ModuleList(
            torch.nn.Linear(n_in, n_out, bias=False, dtype=dtype) for _ in spec.layer_types for n_in, n_out in layer)
        model.lm_head = torch.nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype)
        model.requires_grad_(False)
        pack_linears(model, (torch.nn.Linear,))
        huge_pages.move(model.parameters())
        self.linears, self.lm_head = list(model.linears), model.lm_head
        # One contiguous input per width, as each linear gets in the model.
        self.inputs = {n_in: torch.randn(self.budget, n_in, dtype=dtype) for n_in, _ in layer}
        self.details = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                        "max_num_batched_tokens": self.budget, "max_num_seqs": self.max_running,
                        "linears_per_step": len(self.linears) + 1, "kv_bytes_per_key": self.kv_bytes_per_key}

    @torch.inference_mode()
    def _step(self, num_tokens: int, num_sampled: int, num_keys: int) -> None:
        """A step of `num_tokens` rows, `num_sampled` of them sampled, whose attention reads `num_keys` keys."""
        for module in self.linears:
            linear(self.inputs[module.in_features][:num_tokens], module.weight)
        if num_sampled:
            linear(self.inputs[self.lm_head.in_features][:num_sampled], self.lm_head.weight)
        if self.kv_bytes_per_key:
            self.kv_buffer[: self._kv_elements(num_keys)].sum()

    def _kv_elements(self, num_keys: int) -> int:
        """The elements of the (fp32) buffer that hold `num_keys` keys' K/V bytes."""
        return num_keys * self.kv_bytes_per_key // 4

    def run(self, requests: list[BenchRequest]) -> list[RequestTrace]:
        if self.kv_bytes_per_key:
            # Room for every request's whole cache at once, its pages touched before the clock starts.
            elements = self._kv_elements(sum(len(r.prompt_token_ids) + r.output_len for r in requests))
            if self.kv_buffer.numel() < elements:
                self.kv_buffer = huge_pages.zeros((elements,), torch.float32)
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
            # A decode reads its prompt's keys and those of the tokens it has generated (the newest one's own, which
            # this step writes, included); a prompt chunk, the keys up to the chunk's end.
            num_keys = sum(prefilled[i] + len(traces[i].token_ids) for i in decodes)
            for i in running:
                remaining = len(requests[i].prompt_token_ids) - prefilled[i]
                if remaining and budget:
                    chunk = min(remaining, budget)
                    prefilled[i] += chunk
                    num_keys += prefilled[i]
                    budget -= chunk
                    if chunk == remaining:
                        sampling.append(i)
            self._step(self.budget - budget, len(sampling), num_keys)
            now = time.perf_counter()
            for i in sampling:
                traces[i].token_ids.append(0)
                traces[i].token_times.append(now)
            running = [i for i in running if len(traces[i].token_ids) < requests[i].output_len]
        return traces
