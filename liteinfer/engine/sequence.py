"""Per-request state: a `Request` holds the prompt and its `n` sampled `Sequence`s."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from llguidance import LLMatcher

from liteinfer.engine.detokenizer import IncrementalDetokenizer
from liteinfer.outputs import CompletionOutput, FinishReason, PositionLogprobs, RequestMetrics, RequestOutput
from liteinfer.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One sample being generated.

    `token_ids` is prompt + output so far; `num_computed_tokens` of them have their K/V in the cache (in the blocks
    of `block_table`). A step computes the next tokens from there and, once it reaches the end, samples one more.
    After preemption `num_computed_tokens` drops to 0 and the whole sequence is recomputed.
    """

    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int
    detokenizer: IncrementalDetokenizer
    seed: int | None = None  # a seeded request's, this sample's own (the sampler's `SamplingRow.seed`)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words tokenized (the sampler's)
    grammar: LLMatcher | None = None  # params.structured_outputs' matcher, fed each appended token
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # Draft tokens after token_ids (speculative decoding, engine/speculative.py): proposed after a step, cut by the
    # scheduler to those the next step computes, which then samples a token after each.
    spec_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache hash of each full block, in order
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at its first admission
    cumulative_logprob: float = 0.0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    # The prompt's logprobs as far as computed (None for the first token), for a request that asks for them (its
    # first sample only; the others start from that sample's prompt); else None.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # How far the request's DELTA outputs have carried this sample: output tokens (their logprobs alike), characters.
    num_reported_tokens: int = 0
    num_reported_chars: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt positions are still to be computed for their logprobs: then none may come from the prefix
        cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def prompt_positions_to_score(self, start: int, end: int) -> range:
        """Of positions [start, end), computed this step, those whose logits give a prompt logprob not yet recorded
        (position p's logits score prompt token p + 1)."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(end, self.num_prompt_tokens - 1))

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def to_output(self, delta: bool = False) -> CompletionOutput:
        """The sample so far; with `delta`, only the tokens, text and logprobs that the previous delta output did not
        carry (this one now has)."""
        first_token = first_char = 0
        if delta:
            first_token, first_char = self.num_reported_tokens, self.num_reported_chars
            self.num_reported_tokens, self.num_reported_chars = self.num_output_tokens, self.detokenizer.num_sent
        wants_logprobs = self.params.logprobs is not None
        return CompletionOutput(
            index=self.index,
            # What a stream may show: never text that a stop string completed by a later token would take back.
            text=self.detokenizer.committed_text_from(first_char),
            token_ids=self.token_ids[self.num_prompt_tokens + first_token :],
            cumulative_logprob=self.cumulative_logprob if wants_logprobs else None,
            logprobs=self.logprobs[first_token:] if wants_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]  # all n samples, in index order
    metrics: RequestMetrics
    # Samples 1..n-1 are held here until sample 0 has computed the prompt, then start from its cached blocks.
    unforked: list[Sequence] = field(default_factory=list)
    error: str | None = None

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def to_output(self, delta: bool = False) -> RequestOutput:
        # A DELTA request's prompt logprobs come once, in its first output (by then the prompt has been computed).
        first = self.seqs[0]
        prompt_logprobs = None if delta and first.num_reported_tokens else first.prompt_logprobs
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[seq.to_output(delta) for seq in self.seqs],
            finished=self.is_finished,
            metrics=self.metrics,
            num_cached_tokens=self.seqs[0].num_cached_tokens or 0,  # (None: not admitted yet)
            error=self.error,
        )
