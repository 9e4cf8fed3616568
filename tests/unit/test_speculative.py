"""Prompt lookup's drafts and the rule that keeps them (engine/speculative.py), against plain definitions."""

from hypothesis import given
from hypothesis import strategies as st

from liteinfer.engine.speculative import num_accepted, propose_ngram


def reference_drafts(tokens: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """What followed the latest earlier occurrence of the last n tokens, for the largest n in [min_n, max_n] that
    occurs earlier: by its definition, one n and one position at a time."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 2, n - 2, -1):  # the occurrence's last token, latest first
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + num_drafts]
    return []


@given(tokens=st.lists(st.integers(0, 4), max_size=40), num_drafts=st.integers(0, 6), min_n=st.integers(1, 4),
       extra_n=st.integers(0, 3))
def test_drafts_follow_the_latest_occurrence_of_the_longest_suffix(tokens, num_drafts, min_n, extra_n):
    drafts = propose_ngram(tokens, num_drafts, min_n, min_n + extra_n)
    assert drafts == reference_drafts(tokens, num_drafts, min_n, min_n + extra_n)


def test_drafts_of_a_loop_and_of_text_that_never_repeats():
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], 3, 1, 3) == [3, 1, 2]
    assert propose_ngram([9, 1, 2, 5, 1, 2], 4, 1, 3) == [5, 1, 2]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([7, 8, 7, 8], 3, 3, 4) == []  # no earlier 3-gram matches "8 7 8"
    assert propose_ngram([5], 3, 1, 3) == []


@given(drafts=st.lists(st.integers(0, 3), max_size=6), data=st.data())
def test_drafts_stand_while_each_equals_the_token_sampled_before_it(drafts, data):
    sampled = data.draw(st.lists(st.integers(0, 3), min_size=len(drafts) + 1, max_size=len(drafts) + 1))
    accepted = num_accepted(drafts, sampled)
    assert sampled[:accepted] == drafts[:accepted]
    assert accepted == len(drafts) or sampled[accepted] != drafts[accepted]
