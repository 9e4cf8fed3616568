"""Speculative decoding by prompt lookup: draft tokens for a sequence from its own tokens, and how many it keeps.

After each step a running sequence may get draft tokens (`Sequence.spec_token_ids`): what followed the latest earlier
occurrence of its last n tokens, for the largest n in [prompt_lookup_min, prompt_lookup_max] that occurs (vLLM's
`ngram` method). Its next step computes its last token and the drafts together, each as a decode that reads the keys
up to its own position, the path a plain step takes for that token, so each row's logits are those a plain step at
that position computes (to the bit where our kernels compute every row, as for a row in any other batch;
docs/architecture.md says where a batch's shape moves the last bits). Each row is sampled as its own plain step
would sample it, the drafts before it counted as the output so far (penalties, min_tokens and bad words see them),
and the sequence keeps the sampled tokens up to and including the first that differs from its draft: every kept
token is the one a plain step would have sampled there.

Greedy rows therefore give the plain path's tokens. Sampled rows keep its distribution: a draft is one fixed
token d, accepted when the row's own draw is d (probability p(d)); a row whose draw differs keeps that draw, which
is p with d left out, renormalised: speculative sampling's rule for a proposal that puts all its mass on d.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_drafts` tokens that followed the latest earlier occurrence of the last n of `token_ids`, for the
    largest n in [min_n, max_n] that occurs earlier; [] if none does."""
    length = len(token_ids)
    if num_drafts < 1 or length <= min_n:
        return []
    tokens = np.fromiter(token_ids, dtype=np.int64, count=length)
    # Where an earlier n-gram could end: positions before the last whose token is the last token (n = 1), kept
    # while they also match the tokens before it (n = 2, 3, ...).
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    best = None
    for n in range(1, max_n + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
        if ends.size == 0 or n >= length:
            break
        if n >= min_n:
            best = int(ends[-1])  # the latest occurrence of the longest n-gram so far
    if best is None:
        return []
    return token_ids[best + 1 : best + 1 + num_drafts]


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the sampled tokens confirm: `sampled[j]` is the token sampled after drafts[:j], so drafts[j]
    stands while it equals sampled[j]. The sequence keeps sampled[: num_accepted + 1]."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return accepted
