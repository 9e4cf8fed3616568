"""The sampling kernel (kernels/sample.cpp) against its PyTorch form, `inverse_cdf`: each row's token is where its
uniform falls in the cumulative distribution of softmax(logits / temperature) over the row's nucleus (top_p), never
a -inf (masked) token nor one outside the nucleus, and many draws follow the distribution."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from liteinfer import kernels
from liteinfer.sampling.sampler import apply_min_p, apply_top_k, apply_top_p, draw_rows, inverse_cdf

pytestmark = pytest.mark.skipif(not kernels.load(), reason="liteinfer's CPU kernels could not be built here")


def sample(logits, temperature, uniforms, min_p=0.0, top_k=0, top_p=1.0):
    """The op, with each truncation the same for every row."""
    rows = len(logits)
    return torch.ops.liteinfer.sample(logits, temperature, torch.full((rows,), float(min_p)),
                                      torch.full((rows,), top_k, dtype=torch.long), torch.full((rows,), float(top_p)),
                                      uniforms)


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 12),
    vocab=st.integers(1, 300),  # tails of 1-15 past the kernel's 16-lane steps
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    scale=st.sampled_from([0.1, 3.0, 30.0]),  # flat to peaked
    masked=st.floats(0.0, 0.95),  # the share of -inf logits (top-k, top-p, min_tokens mask them)
    seed=st.integers(0, 2**16),
)
def test_each_row_draws_where_its_uniform_falls(rows, vocab, dtype, scale, masked, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator) * scale).to(dtype)
    logits[torch.rand(rows, vocab, generator=generator) < masked] = -float("inf")
    logits[torch.arange(rows), torch.randint(vocab, (rows,), generator=generator)] = 1.0  # a token left in each row
    temperature = torch.rand(rows, generator=generator) * 2 + 0.05
    uniforms = torch.rand(rows, generator=generator)
    uniforms[0] = 0.0  # the edges of [0, 1)
    uniforms[-1] = 1 - 2**-24

    tokens = sample(logits, temperature, uniforms)
    probs = (logits.float() / temperature[:, None]).softmax(-1).double()
    cdf = probs.cumsum(-1)
    for row, token in enumerate(tokens.tolist()):
        assert probs[row, token] > 0  # never a masked token
        # The uniform's target lies in the token's interval of the cumulative distribution, up to fp32 rounding.
        target = uniforms[row].item() * cdf[row, -1].item()
        assert cdf[row, token] - probs[row, token] - 1e-5 <= target <= cdf[row, token] + 1e-5


def test_many_draws_follow_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -float("inf"), 0.0, 3.0, -3.0])
    rows, temperature = 40_000, 0.7
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(0))
    tokens = sample(logits.expand(rows, -1).contiguous(), torch.full((rows,), temperature), uniforms)
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    expected = (logits / temperature).softmax(-1).double() * rows
    assert counts[4] == 0
    # Within 5 standard deviations of the binomial count for every token.
    assert ((counts - expected).abs() <= 5 * (expected * (1 - expected / rows)).sqrt() + 1).all(), (counts, expected)


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 8),
    vocab=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    scale=st.sampled_from([0.1, 3.0, 30.0]),
    levels=st.sampled_from([4, 10_000]),  # few distinct logits: ties at the truncations' edges
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
    top_k=st.sampled_from([0, 1, 3, 50]),
    top_p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**16),
)
def test_each_row_draws_among_the_tokens_its_truncations_keep(rows, vocab, dtype, scale, levels, min_p, top_k, top_p,
                                                              seed):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randint(levels, (rows, vocab), generator=generator) / levels * scale).to(dtype)
    logits[torch.rand(rows, vocab, generator=generator) < 0.3] = -float("inf")
    logits[:, 0] = logits[:, 0].clamp(min=0.0)  # a token left in each row
    temperature = torch.rand(rows, generator=generator) * 2 + 0.05
    uniforms = torch.rand(rows, generator=generator)
    uniforms[0] = 1 - 2**-24  # the far end of what is kept

    tokens = sample(logits, temperature, uniforms, min_p, top_k, top_p)
    # What apply_min_p, apply_top_k and apply_top_p keep, at a hair looser than asked (fp32 sums and exps round
    # otherwise): the token lies in it.
    kept = logits.float() / temperature[:, None]
    if min_p:
        kept = apply_min_p(kept, torch.full((rows,), min_p * (1 - 1e-5)))
    if 0 < top_k < vocab:  # the kernel's top_k past the vocabulary keeps it all
        kept = apply_top_k(kept, torch.full((rows,), top_k))
    looser_top_p = top_p * (1 + 1e-5)
    if looser_top_p < 1:  # (at 1 every token is kept: apply_top_p's fp32 running sum may reach 1 before the last)
        kept = apply_top_p(kept, torch.full((rows,), looser_top_p))
    assert kept.isfinite()[torch.arange(rows), tokens].all(), (tokens, kept)
    assert (logits[torch.arange(rows), tokens] > -float("inf")).all()


def test_many_draws_follow_the_nucleus_renormalised():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()  # top_p 0.9: the first three, 0.5 / 0.95 and so on
    rows = 40_000
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(0))
    tokens = sample(logits.expand(rows, -1).contiguous(), torch.ones(rows), uniforms, top_p=0.9)
    counts = torch.bincount(tokens, minlength=4).double()
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0], dtype=torch.float64) / 0.95 * rows
    assert counts[3] == 0
    assert ((counts - expected).abs() <= 5 * (expected * (1 - expected / rows)).sqrt() + 1).all(), (counts, expected)


def test_ties_with_the_last_token_kept_stay():
    logits = torch.tensor([[2.0, 2.0, 2.0, 2.0, 0.0, 0.0]])  # the first token would do; its ties stay
    uniforms = torch.linspace(0, 1 - 2**-24, 400)
    for truncation in ({"top_p": 0.1}, {"top_k": 1}, {"min_p": 1.0}):
        tokens = sample(logits.expand(400, -1).contiguous(), torch.ones(400), uniforms, **truncation)
        assert set(tokens.tolist()) == {0, 1, 2, 3}, truncation


def test_a_vocab_sized_batch_in_both_dtypes_equals_the_pytorch_form():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 49152, generator=generator) * 3
    temperature, uniforms = torch.full((64,), 0.8), torch.rand(64, generator=generator)
    # Rows by fours: untruncated, min_p 0.01, top_k 200, top_p 0.9.
    kind = torch.arange(64) % 4
    truncations = (torch.where(kind == 1, 0.01, 0.0), torch.where(kind == 2, 200, 0), torch.where(kind == 3, 0.9, 1.0))
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        kernel = torch.ops.liteinfer.sample(x, temperature, *truncations, uniforms)
        assert torch.equal(kernel, inverse_cdf(x, temperature, *truncations, uniforms))
    kernel = torch.ops.liteinfer.sample(logits, temperature, *truncations, uniforms)
    assert torch.equal(draw_rows(logits, temperature, *truncations, uniforms), kernel)  # on CPU the sampler draws so


def test_a_row_of_minus_infinity_only_draws_its_first_index_and_bad_inputs_are_refused():
    logits = torch.full((2, 20), -float("inf"))
    logits[1, 7] = 0.0
    for truncation in ({}, {"top_p": 0.5}, {"top_k": 3}, {"min_p": 0.5}):  # nothing to keep in the first row
        assert sample(logits, torch.ones(2), torch.tensor([0.5, 0.5]), **truncation).tolist() == [0, 7]
    with pytest.raises(RuntimeError, match="temperature must be positive"):
        sample(logits, torch.tensor([1.0, 0.0]), torch.zeros(2))
    with pytest.raises(RuntimeError, match=r"top_p must be in \(0, 1\]"):
        sample(logits, torch.ones(2), torch.zeros(2), top_p=0.0)
    with pytest.raises(RuntimeError, match=r"min_p must be in \[0, 1\] and its top_k at least 0"):
        sample(logits, torch.ones(2), torch.zeros(2), top_k=-1)
    with pytest.raises(RuntimeError, match="uniform and an int64 top_k per row"):
        sample(logits, torch.ones(2), torch.zeros(3))
