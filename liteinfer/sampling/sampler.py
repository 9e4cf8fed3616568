"""Turns one step's logits into next tokens and logprobs, with one tensor pipeline over the whole batch.

Stages run in vLLM's order: a structured output's format -> raw logprobs -> allowed tokens -> bad words, min_tokens ->
logit bias -> penalties -> greedy argmax, or temperature -> min_p -> top_k/top_p -> sampling. A stage that no row
uses is skipped, and a stage that only some rows use runs on those rows alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from liteinfer import kernels
from liteinfer.outputs import Logprob
from liteinfer.sampling.params import SamplingParams
from liteinfer.sampling.structured import allowed_tokens

if TYPE_CHECKING:
    from llguidance import LLMatcher

# The token of a row whose request's own constraints (allowed tokens, a format, bad words, min_tokens) leave no token
# to sample: the engine fails that request alone.
NO_TOKEN = -1

# How many of the most likely tokens apply_top_p looks at first (see there).
_TOP_P_FIRST_CANDIDATES = 128


@dataclass
class SamplingRow:
    """One row of the logits: a sequence that samples a token this step."""

    params: SamplingParams
    token_ids: list[int]  # prompt, then the output so far (the sequence's own list: read, never copied or changed)
    num_prompt_tokens: int
    # A seeded sample's own seed (the engine derives one per sample from params.seed): its draw at each position is a
    # function of the seed and the position alone (`seeded_uniform`), so its tokens depend neither on the rest of the
    # batch nor on how its steps were cut (speculative decoding's rows included). None = the global RNG.
    seed: int | None = None
    # params.bad_words as token ids, each word in each of its forms (the engine tokenizes them once per request).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # The sequence's structured output matcher (params.structured_outputs), which the engine advances.
    grammar: LLMatcher | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def below_min_tokens(self) -> bool:
        """EOS and the stop token ids may not be sampled yet."""
        return len(self.token_ids) - self.num_prompt_tokens < self.params.min_tokens


@dataclass
class SamplerOutput:
    """What one step sampled, row by row in the order of the logits."""

    token_ids: list[int]  # one per row (NO_TOKEN where the request's constraints exclude every token)
    logprobs: list[float | None]  # sampled token's logprob per row; None where params.logprobs is None
    # Per row: the sampled token plus the top params.logprobs tokens; None where not requested.
    top_logprobs: list[dict[int, Logprob] | None]


class Sampler:
    """Stateless apart from the EOS ids: everything a row needs comes in with its SamplingRow."""

    def __init__(self, eos_token_ids: set[int]) -> None:
        self.eos_token_ids = sorted(eos_token_ids)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """The caller's logits are left untouched."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        params = [row.params for row in rows]
        formatted = [i for i, row in enumerate(rows) if row.grammar is not None]
        if formatted:
            # As vLLM masks them before its sampler: a structured output's logprobs describe the format's
            # distribution (a token it forces has logprob 0), its other edits' the model's.
            logits = logits.to(torch.float32, copy=True)
            keeps_format = allowed_tokens([rows[i].grammar for i in formatted], logits.shape[1]).to(logits.device)
            logits = _update_rows(logits, formatted, lambda x: x.masked_fill_(~keeps_format, -float("inf")))

        # Logprobs describe the model's own distribution (a structured output's: the format's), so they come from the
        # logits before any other edit.
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            raw_logprobs = _take_rows(logits, logprob_rows).log_softmax(-1, dtype=torch.float32)

        # Greedy rows without penalties or edits take the argmax of the raw logits, with no copy. Rows that a stage
        # edits in place (the request's edits, penalties) get a float copy of their own; sampling's stages are the
        # draw's, uncopied.
        edited = [i for i, row in enumerate(rows) if not _plain_greedy(row)]
        plain = [i for i, row in enumerate(rows) if _plain_greedy(row)]
        if not edited:
            tokens = argmax_rows(logits)
        else:
            tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            if plain:
                tokens[plain] = argmax_rows(_take_rows(logits, plain))
            tokens[edited] = self._edited_tokens(_take_rows(logits, edited), [rows[i] for i in edited],
                                                 owned=len(edited) < len(rows) or bool(formatted))
        token_ids = tokens.tolist()
        # Below min_tokens, a raw argmax stands unless it is a token the row may not sample yet (then a row masked
        # as `_edited_tokens` masks it decides): the masked argmax is the same token in every other case.
        for i in plain:
            row = rows[i]
            if self._may_not_sample(row, token_ids[i]):
                masked = logits[i].to(torch.float32, copy=True)
                masked[self._stop_ids(row)] = -float("inf")
                token_ids[i] = int(argmax_rows(masked[None]))
                tokens[i] = token_ids[i]

        logprobs: list[float | None] = [None] * len(rows)
        top_logprobs: list[dict[int, Logprob] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            num_top = [params[i].logprobs for i in logprob_rows]
            # A row left with NO_TOKEN fails, so what its clamped id gathers is never read.
            row_logprobs, row_tops = gather_logprobs(raw_logprobs, tokens[logprob_rows].clamp(min=0), num_top)
            for i, logprob, top in zip(logprob_rows, row_logprobs, row_tops, strict=True):
                logprobs[i], top_logprobs[i] = logprob, top
        return SamplerOutput(token_ids, logprobs, top_logprobs)

    @staticmethod
    def takes_argmax(rows: list[SamplingRow]) -> bool:
        """Whether each row's token is its logits' argmax (greedy, no penalties, no logprobs) but where that is a
        token the row may not sample yet: `from_argmax` then gives what a call on the logits gives."""
        return all(_plain_greedy(row) and row.params.logprobs is None for row in rows)

    def from_argmax(self, argmax: list[int], rows: list[SamplingRow],
                    logits_of: Callable[[list[int]], torch.Tensor]) -> SamplerOutput:
        """What `self(logits, rows)` gives for rows that `takes_argmax`, from their logits' argmax (a head that finds
        it without computing every logit: layers/greedy_head.py). `logits_of(indices)` computes those rows' logits,
        asked for only where the argmax is a token the row may not sample yet."""
        token_ids = list(argmax)
        held_back = [i for i, row in enumerate(rows) if self._may_not_sample(row, token_ids[i])]
        if held_back:
            redone = self(logits_of(held_back), [rows[i] for i in held_back])
            for i, token in zip(held_back, redone.token_ids, strict=True):
                token_ids[i] = token
        return SamplerOutput(token_ids, [None] * len(rows), [None] * len(rows))

    def _edited_tokens(self, logits: torch.Tensor, rows: list[SamplingRow], owned: bool) -> torch.Tensor:
        """Tokens of rows whose logits a request edits, or that sample. `owned`: `logits` is a copy, which the edits
        may change in place; otherwise it is the caller's, copied before they do."""
        allowed = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
        banned = [(i, token) for i, row in enumerate(rows) for token in self._banned_tokens(row)]
        biased = [(i, token, bias) for i, row in enumerate(rows) if row.params.logit_bias
                  for token, bias in row.params.logit_bias.items()]
        penalised = [i for i, row in enumerate(rows) if _uses_penalty(row.params)]
        if allowed or banned or biased or penalised:
            logits = logits.to(torch.float32, copy=not owned)
        if allowed:
            allowed_ids = [rows[i].params.allowed_token_ids for i in allowed]
            logits = _update_rows(logits, allowed, lambda x: keep_only(x, allowed_ids))
        if banned:
            row_idx, token_idx = zip(*banned, strict=True)
            logits[list(row_idx), list(token_idx)] = -float("inf")
        if biased:
            row_idx, token_idx, biases = zip(*biased, strict=True)
            logits[list(row_idx), list(token_idx)] += torch.tensor(biases, device=logits.device)
        if penalised:
            penalised_rows = [rows[i] for i in penalised]
            logits = _update_rows(logits, penalised, lambda x: apply_penalties(x, penalised_rows))

        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        if greedy:
            tokens[greedy] = argmax_rows(_take_rows(logits, greedy))
        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if sampled:
            tokens[sampled] = _sample(_take_rows(logits, sampled), [rows[i] for i in sampled])
        formatted = [i for i, row in enumerate(rows) if row.grammar is not None]  # masked in __call__
        constrained = sorted({*allowed, *formatted, *(i for i, _ in banned)})
        if constrained:
            left_nothing = torch.isneginf(_take_rows(logits, constrained)).all(-1).nonzero().flatten().tolist()
            tokens[[constrained[j] for j in left_nothing]] = NO_TOKEN
        return tokens

    def _banned_tokens(self, row: SamplingRow) -> list[int]:
        """The tokens a row may not sample now: below min_tokens its stop ids; the last token of each bad word whose
        other tokens end the output so far."""
        banned = self._stop_ids(row) if row.below_min_tokens else []
        if row.bad_words_token_ids:
            output = row.output_token_ids
            for *prefix, last in row.bad_words_token_ids:
                if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
                    banned.append(last)
        return banned

    def _stop_ids(self, row: SamplingRow) -> list[int]:
        """What a row below its min_tokens may not sample: EOS and its stop token ids."""
        return self.eos_token_ids + row.params.stop_token_ids

    def _may_not_sample(self, row: SamplingRow, token: int) -> bool:
        return row.below_min_tokens and token in self._stop_ids(row)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal largest values). On CPU through our kernel: PyTorch's CPU argmax compares
    one element at a time, and in bf16 ~5x slower still (docs/benchmarks.md)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and kernels.available():
        return torch.ops.liteinfer.argmax(logits)
    return logits.argmax(-1)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty on prompt and output tokens; frequency and presence penalties on output tokens.

    Edits logits in place, and only at the (row, token) pairs a row has seen: a few thousand entries
    instead of passes over the whole [rows, vocab] tensor.
    """
    vocab, device = logits.shape[1], logits.device
    output_keys, output_counts = _token_keys([row.output_token_ids for row in rows], vocab, device)
    if any(row.params.repetition_penalty != 1.0 for row in rows):
        prompt_keys, _ = _token_keys([row.prompt_token_ids for row in rows], vocab, device)
        seen = torch.unique(torch.cat([prompt_keys, output_keys]), sorted=False)
        row_idx, token_idx = seen // vocab, seen % vocab
        penalty = torch.tensor([row.params.repetition_penalty for row in rows], device=device)[row_idx]
        values = logits[row_idx, token_idx]
        # Dividing a positive logit and multiplying a negative one both make the token less likely.
        logits[row_idx, token_idx] = torch.where(values > 0, values / penalty, values * penalty)
    row_idx, token_idx = output_keys // vocab, output_keys % vocab
    frequency = torch.tensor([row.params.frequency_penalty for row in rows], device=device)[row_idx]
    presence = torch.tensor([row.params.presence_penalty for row in rows], device=device)[row_idx]
    logits[row_idx, token_idx] -= frequency * output_counts + presence
    return logits


def keep_only(logits: torch.Tensor, token_ids: list[list[int]]) -> torch.Tensor:
    """Sets every logit of row i to -inf but those of token_ids[i], in place."""
    dropped = torch.ones_like(logits, dtype=torch.bool)
    row_idx = [i for i, ids in enumerate(token_ids) for _ in ids]
    dropped[row_idx, [t for ids in token_ids for t in ids]] = False
    return logits.masked_fill_(dropped, -float("inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the top token's probability."""
    probs = logits.softmax(-1)
    threshold = probs.amax(-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill_(probs < threshold, -float("inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keeps each row's top_k largest logits (top_k per row in [1, vocab]); ties with the k-th stay too."""
    # Only the k-th largest logit matters, and torch.topk finds it far faster than sorting the vocab.
    top_values = logits.topk(int(top_k.max()), dim=-1).values
    kth = top_values.gather(-1, top_k[:, None] - 1)
    return logits.masked_fill_(logits < kth, -float("inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps each row's smallest set of most likely tokens whose probability reaches its top_p, in (0, 1).

    Tokens already at -inf (after top_k or min_p) hold no mass, so top_p applies to the renormalised
    rest. Tokens are dropped below a per-row cutoff logit, so ties with the last kept token stay too.
    """
    vocab = logits.shape[-1]
    log_total = logits.logsumexp(-1, keepdim=True)
    # A nucleus is usually a small part of the vocab: look for it among the most likely tokens first,
    # and widen the search only while some row's candidates hold less than its top_p.
    num_candidates = min(_TOP_P_FIRST_CANDIDATES, vocab)
    while True:
        if num_candidates < vocab:
            candidates = logits.topk(num_candidates, dim=-1).values
        else:
            candidates = logits.sort(dim=-1, descending=True).values
        probs = (candidates - log_total).exp()
        if num_candidates == vocab or bool((probs.sum(-1) >= top_p).all()):
            break
        num_candidates = min(num_candidates * 8, vocab)
    # A token stays while the tokens before it hold less than top_p, so the top token always stays.
    mass_before = probs.cumsum(-1) - probs
    num_kept = (mass_before < top_p[:, None]).sum(-1, keepdim=True)
    cutoff = candidates.gather(-1, num_kept - 1)
    return logits.masked_fill_(logits < cutoff, -float("inf"))


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Samples one token per row after temperature, min_p and top_k/top_p; `logits` is left untouched."""
    params = [row.params for row in rows]

    def per_row(values: list) -> torch.Tensor:
        return torch.tensor(values, device=logits.device)

    # top_k only counts when it is below the vocab size; 0 is off.
    top_k = per_row([p.top_k if 0 < p.top_k < logits.shape[1] else 0 for p in params])
    return draw_rows(logits, per_row([p.temperature for p in params]), per_row([p.min_p for p in params]), top_k,
                     per_row([p.top_p for p in params]), _uniforms(rows, logits.device))


def draw_rows(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor,
              top_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's token from softmax(logits / temperature) truncated, by inverse CDF at the row's uniform in [0, 1):
    the first token whose cumulative probability, renormalised over the tokens kept, passes it (an exact sample for a
    uniform one; -inf logits are never drawn). Kept, as `apply_min_p`, `apply_top_k` and `apply_top_p` keep them in
    that order: the tokens of at least min_p times the top token's probability, the top_k most likely (0: all), then
    the nucleus of what is left, its smallest set of most likely tokens whose probability reaches top_p; each with the
    ties of its last kept token. On CPU through our kernel (kernels/sample.cpp), which keeps no [rows, vocab]
    temporaries and sorts no row."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and kernels.available():
        return torch.ops.liteinfer.sample(logits, temperature.float(), min_p.float(), top_k.long(), top_p.float(),
                                          uniforms.float())
    return inverse_cdf(logits, temperature, min_p, top_k, top_p, uniforms)


def inverse_cdf(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`draw_rows` in PyTorch ops (any device; the kernel's reference)."""

    def truncated(x: torch.Tensor, keep: Callable, values: torch.Tensor, applies: torch.Tensor) -> torch.Tensor:
        rows = applies.nonzero().flatten().tolist()
        return _update_rows(x, rows, lambda r: keep(r, values[rows])) if rows else x

    scaled = logits.float() / temperature[:, None]
    scaled = truncated(scaled, apply_min_p, min_p, min_p > 0)
    scaled = truncated(scaled, apply_top_k, top_k, top_k > 0)
    scaled = truncated(scaled, apply_top_p, top_p, top_p < 1)
    probs = scaled.softmax(-1)
    cdf = probs.cumsum(-1)
    tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(-1)
    # Rounding can leave the target at the last cumulative value: then the last token of positive probability.
    last_positive = probs.shape[1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(tokens, last_positive)


def _uniforms(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row: from the global RNG for unseeded rows, from its seed and the position it samples
    for seeded ones."""
    uniforms = torch.rand(len(rows), device=device)
    if seeded := [i for i, row in enumerate(rows) if row.seed is not None]:
        draws = [seeded_uniform(rows[i].seed, len(rows[i].token_ids)) for i in seeded]
        uniforms[seeded] = torch.tensor(draws, dtype=uniforms.dtype, device=device)
    return uniforms


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's output function: a 64-bit mix of `x` whose outputs pass as independent uniform bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) that is a function of (seed, position) alone: a counter-based draw, where a stream would
    depend on how many draws came before. 24 bits, so that float32 holds it exactly (it can never round to 1)."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 40) * 2.0**-24


def gather_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, num_top: list[int]
) -> tuple[list[float], list[dict[int, Logprob]]]:
    """Per row: the sampled token's logprob, and a dict of it plus the row's top num_top tokens."""
    sampled = logprobs.gather(-1, tokens[:, None])
    sampled_rank = (logprobs > sampled).sum(-1) + 1
    top_values, top_ids = logprobs.topk(min(max(num_top), logprobs.shape[1]), dim=-1)
    # Every token more likely than the j-th top token is itself in the top list, ahead of it: its rank is where its
    # value first appears in the (descending) list, so tied tokens share the rank.
    top_ranks = torch.searchsorted(-top_values, -top_values, side="left") + 1

    row_logprobs = sampled.squeeze(-1).tolist()
    tops = []
    for token, logprob, rank, k, values, ids, ranks in zip(
        tokens.tolist(),
        row_logprobs,
        sampled_rank.tolist(),
        num_top,
        top_values.tolist(),
        top_ids.tolist(),
        top_ranks.tolist(),
        strict=True,
    ):
        top = {token: Logprob(logprob, rank)}
        top.update({t: Logprob(v, r) for t, v, r in zip(ids[:k], values[:k], ranks[:k], strict=True)})
        tops.append(top)
    return row_logprobs, tops


def _plain_greedy(row: SamplingRow) -> bool:
    """Whether a row's token is the argmax of its raw logits (unless min_tokens forbids that token)."""
    params = row.params
    edits = (params.allowed_token_ids is not None or params.logit_bias or row.bad_words_token_ids
             or row.grammar is not None)
    return params.is_greedy and not _uses_penalty(params) and not edits


def _uses_penalty(params: SamplingParams) -> bool:
    return (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) != (1.0, 0.0, 0.0)


def _token_keys(
    token_lists: list[list[int]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of the lists as keys row * vocab + token, and how often each occurs."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    row_idx = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
    # np.fromiter reads the Python ints about 3x faster than torch.tensor(list).
    flat_tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64)
    token_idx = torch.from_numpy(flat_tokens).to(device)
    # Callers only index with the keys, so they need not come sorted.
    return torch.unique(row_idx * vocab + token_idx, sorted=False, return_counts=True)


def _take_rows(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    # idx is ascending and unique, so covering every row means it is the identity: skip the copy.
    return x if len(idx) == x.shape[0] else x[idx]


def _update_rows(x: torch.Tensor, idx: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Applies fn to the rows idx of x, without gathering and scattering when idx is every row."""
    if len(idx) == x.shape[0]:
        return fn(x)
    x[idx] = fn(x[idx])
    return x
