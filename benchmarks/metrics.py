"""What a run measures: per-request token timestamps in, throughput and latency percentiles out.

Every timestamp is `time.perf_counter()` seconds in the engine's own process. A request's TTFT runs from its
submission to its first output token, its end-to-end latency to its last; inter-token latencies are the gaps
between consecutive tokens of one request, pooled over all requests. Throughput divides by the wall time from the
first submission to the last token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import psutil

from benchmarks.workloads import Workload


@dataclass
class RequestTrace:
    """One request as an engine served it."""

    submitted: float  # when the request was handed to the engine
    token_times: list[float]  # when each output token became visible to the caller
    token_ids: list[int]


@dataclass
class Summary:
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float  # prompt + output tokens
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    # Time per output token after the first, a request at a time (vLLM's TPOT): where a step gives a sequence several
    # tokens at once (speculative decoding), its ITL gaps include zeros, but this stays the request's pace.
    tpot_p50_ms: float
    tpot_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float


class OutputLengthError(AssertionError):
    """An engine returned more or fewer tokens than the workload forces: its numbers would not be comparable."""


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), e.g. q=99 of 32 values lies between the
    31st and the 32nd."""
    return float(np.percentile(values, q))


def check_output_lengths(workload: Workload, traces: list[RequestTrace]) -> None:
    if len(traces) != len(workload.requests):
        raise OutputLengthError(f"{len(traces)} results for {len(workload.requests)} requests")
    wrong = [
        f"request {i}: {len(trace.token_ids)} tokens ({len(trace.token_times)} timestamps), expected {req.output_len}"
        for i, (req, trace) in enumerate(zip(workload.requests, traces))
        if len(trace.token_ids) != req.output_len or len(trace.token_times) != req.output_len
    ]
    if wrong:
        raise OutputLengthError(f"{len(wrong)} of {len(traces)} requests have the wrong length: " + "; ".join(wrong))


def summarize(workload: Workload, traces: list[RequestTrace]) -> Summary:
    duration = max(t.token_times[-1] for t in traces) - min(t.submitted for t in traces)
    ttfts = [t.token_times[0] - t.submitted for t in traces]
    e2es = [t.token_times[-1] - t.submitted for t in traces]
    # A request of one token has no gaps; with nothing to pool (all such), ITL is undefined and reported as 0.
    itls = [b - a for t in traces for a, b in zip(t.token_times, t.token_times[1:])] or [0.0]
    tpots = [(t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1) for t in traces
             if len(t.token_times) > 1] or [0.0]
    ms = 1000.0
    return Summary(
        duration_s=duration,
        requests_per_s=len(traces) / duration,
        output_tokens_per_s=workload.num_output_tokens / duration,
        total_tokens_per_s=(workload.num_prompt_tokens + workload.num_output_tokens) / duration,
        ttft_p50_ms=percentile(ttfts, 50) * ms,
        ttft_p99_ms=percentile(ttfts, 99) * ms,
        itl_p50_ms=percentile(itls, 50) * ms,
        itl_p99_ms=percentile(itls, 99) * ms,
        tpot_p50_ms=percentile(tpots, 50) * ms,
        tpot_p99_ms=percentile(tpots, 99) * ms,
        e2e_p50_ms=percentile(e2es, 50) * ms,
        e2e_p99_ms=percentile(e2es, 99) * ms,
    )


def ratios(row: dict[str, float], baseline: dict[str, float]) -> dict[str, float | None]:
    """Each metric of `row` divided by the baseline's (None where the baseline's is 0)."""
    return {key: (row[key] / baseline[key] if baseline[key] else None) for key in row}


class PeakMemory:
    """`with PeakMemory(device) as peak:` ... `peak.mib`: the most memory the process held inside the block.

    On CUDA, the most memory PyTorch allocated on the device (the caching allocator's reserve is not counted). On
    CPU, the resident set size (weights, KV cache, activations, the interpreter and its libraries), sampled every
    10 ms by a thread: a spike shorter than that can be missed, and the sampling itself costs little next to a
    decode step.
    """

    def __init__(self, device: str):
        self.device = device
        self.mib = 0.0
        self._peak_bytes = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @property
    def kind(self) -> str:
        return "cuda_allocated" if self.device == "cuda" else "rss"

    def __enter__(self) -> PeakMemory:
        if self.device == "cuda":
            import torch  # here, so that a process that runs llama.cpp never loads it

            torch.cuda.reset_peak_memory_stats()
        else:
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.device == "cuda":
            import torch

            self._peak_bytes = torch.cuda.max_memory_allocated()
        else:
            self._done.set()
            self._thread.join()
        self.mib = self._peak_bytes / 2**20

    def _sample(self) -> None:
        process = psutil.Process()
        while True:
            self._peak_bytes = max(self._peak_bytes, process.memory_info().rss)
            if self._done.wait(0.01):
                return
