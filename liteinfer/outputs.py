"""What `generate` hands back: vLLM-compatible request and completion outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token under the model's raw distribution, with its rank (1 = most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One position's log-probabilities: the sampled token plus the top-k tokens, keyed by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    """One sample of a request (a request with `n > 1` has n of these)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended the sample; None for EOS, length and abort.
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state as of the last engine step; `finished` once every sample has ended."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = field(default=None)
    # With SamplingParams.prompt_logprobs: each prompt token's logprob and the top tokens at its position (None for
    # the first token, which nothing predicts).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
