"""Prometheus metrics of the server: engine load (read when scraped), token counts and latencies (observed as
events reach the client)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from liteinfer.engine.async_llm import AsyncLLM, StreamEvent

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """One registry per server, so that several servers (tests) can live in one process."""

    def __init__(self, llm: AsyncLLM):
        self.registry = CollectorRegistry()
        gauges = {
            "liteinfer_num_seqs_running": ("Sequences in the running batch", "num_running_seqs"),
            "liteinfer_num_seqs_waiting": ("Sequences queued for the running batch", "num_waiting_seqs"),
            "liteinfer_kv_cache_usage_ratio": ("Share of KV-cache blocks in use (0..1)", "kv_cache_usage"),
            "liteinfer_prefix_cache_queried_tokens": ("Prompt tokens looked up in the prefix cache",
                                                      "prefix_cache_queried_tokens"),
            "liteinfer_prefix_cache_hit_tokens": ("Prompt tokens found in the prefix cache", "prefix_cache_hit_tokens"),
            "liteinfer_prefix_cache_hit_ratio": ("Share of looked-up prompt tokens found in the prefix cache (0..1)",
                                                 "prefix_cache_hit_rate"),
            "liteinfer_spec_decode_draft_tokens": ("Draft tokens computed by speculative decoding",
                                                   "spec_draft_tokens"),
            "liteinfer_spec_decode_accepted_tokens": ("Draft tokens kept by speculative decoding",
                                                      "spec_accepted_tokens"),
        }
        for name, (help_text, stat) in gauges.items():
            Gauge(name, help_text, registry=self.registry).set_function(lambda stat=stat: getattr(llm.stats, stat))
        self.prompt_tokens = Counter("liteinfer_prompt_tokens", "Prompt tokens of started requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("liteinfer_generation_tokens", "Generated tokens", registry=self.registry)
        self.time_to_first_token = Histogram(
            "liteinfer_time_to_first_token_seconds", "Time from a request's arrival to its first token",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "liteinfer_inter_token_latency_seconds", "Time between consecutive tokens of a sample",
            buckets=ITL_BUCKETS, registry=self.registry,
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def track(
        self, events: AsyncGenerator[StreamEvent, None], arrival: float
    ) -> AsyncGenerator[StreamEvent, None]:
        """Pass `events` through, counting tokens and timing them; `arrival` is the request's time.monotonic()."""
        started: set[str] = set()
        last_token_time: dict[tuple[str, int], float] = {}  # (request, sample) -> when its last token came
        async with aclosing(events):
            async for event in events:
                if event.new_token_ids:
                    now, key = time.monotonic(), (event.request_id, event.index)
                    if event.request_id not in started:
                        started.add(event.request_id)
                        self.prompt_tokens.inc(event.num_prompt_tokens)
                        self.time_to_first_token.observe(now - arrival)
                    elif key in last_token_time:
                        self.inter_token_latency.observe((now - last_token_time[key]) / len(event.new_token_ids))
                    self.generation_tokens.inc(len(event.new_token_ids))
                    last_token_time[key] = now
                yield event
