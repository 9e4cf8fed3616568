"""The sampling kernel (kernels/sample.cpp) against its PyTorch form, `inverse_cdf`: each row's token is where its
uniform falls in the cumulative distribution of softmax(logits / temperature) over the row's nucleus (top_p), never
a -inf (masked) token nor one outside the nucleus, and many draws follow the distribution."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from liteinfer import kernels
from liteinfer.sampling.sampler import apply_top_p, draw_rows, inverse_cdf

pytestmark = pytest.mark.skipif(not kernels.load(), reason="liteinfer's CPU kernels could not be built here")


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

    tokens = torch.ops.liteinfer.sample(logits, temperature, torch.ones(rows), uniforms)
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
    tokens = torch.ops.liteinfer.sample(logits.expand(rows, -1).contiguous(), torch.full((rows,), temperature),
                                        torch.ones(rows), uniforms)
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    expected = (logits / temperature).softmax(-1).double() * rows
    assert counts[4] == 0
    # Within 5 standard deviations of the binomial count for every token.
    assert ((counts - expected).abs() <= 5 * (expected * (1 - expected / rows)).sqrt() + 1).all(), (counts, expected)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 8),
    vocab=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    scale=st.sampled_from([0.1, 3.0, 30.0]),
    levels=st.sampled_from([4, 10_000]),  # few distinct logits: ties at the nucleus' edge
    top_p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**16),
)
def test_each_row_draws_within_its_nucleus(rows, vocab, dtype, scale, levels, top_p, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randint(levels, (rows, vocab), generator=generator) / levels * scale).to(dtype)
    logits[torch.rand(rows, vocab, generator=generator) < 0.3] = -float("inf")
    logits[:, 0] = logits[:, 0].clamp(min=0.0)  # a token left in each row
    temperature = torch.rand(rows, generator=generator) * 2 + 0.05
    uniforms = torch.rand(rows, generator=generator)
    uniforms[0] = 1 - 2**-24  # the nucleus' far end

    tokens = torch.ops.liteinfer.sample(logits, temperature, torch.full((rows,), top_p), uniforms)
    scaled = logits.float() / temperature[:, None]
    # The nucleus as apply_top_p keeps it at a hair above top_p (fp32 sums round differently): the token lies in it.
    loose = apply_top_p(scaled.clone(), torch.full((rows,), min(1.0, top_p * (1 + 1e-5)))).isfinite()
    assert loose[torch.arange(rows), tokens].all(), (tokens, loose)
    assert (scaled.softmax(-1)[torch.arange(rows), tokens] > 0).all()


def test_many_draws_follow_the_nucleus_renormalised():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()  # top_p 0.9: the first three, 0.5 / 0.95 and so on
    rows = 40_000
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(0))
    tokens = torch.ops.liteinfer.sample(logits.expand(rows, -1).contiguous(), torch.ones(rows),
                                        torch.full((rows,), 0.9), uniforms)
    counts = torch.bincount(tokens, minlength=4).double()
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0], dtype=torch.float64) / 0.95 * rows
    assert counts[3] == 0
    assert ((counts - expected).abs() <= 5 * (expected * (1 - expected / rows)).sqrt() + 1).all(), (counts, expected)


def test_ties_with_the_nucleus_last_token_stay_in_it():
    logits = torch.tensor([[2.0, 2.0, 2.0, 2.0, 0.0, 0.0]])  # top_p 0.1: the first token would do, its ties stay
    uniforms = torch.linspace(0, 1 - 2**-24, 400)
    tokens = torch.ops.liteinfer.sample(logits.expand(400, -1).contiguous(), torch.ones(400), torch.full((400,), 0.1),
                                        uniforms)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


def test_a_vocab_sized_batch_in_both_dtypes_equals_the_pytorch_form():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 49152, generator=generator) * 3
    temperature, uniforms = torch.full((64,), 0.8), torch.rand(64, generator=generator)
    top_p = torch.where(torch.arange(64) % 2 == 0, 1.0, 0.9)  # every other row within its nucleus
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        kernel = torch.ops.liteinfer.sample(x, temperature, top_p, uniforms)
        assert torch.equal(kernel, inverse_cdf(x, temperature, top_p, uniforms))
    kernel = torch.ops.liteinfer.sample(logits, temperature, top_p, uniforms)
    assert torch.equal(draw_rows(logits, temperature, top_p, uniforms), kernel)  # on CPU the sampler draws so


def test_a_row_of_minus_infinity_only_draws_its_first_index_and_bad_inputs_are_refused():
    logits = torch.full((2, 20), -float("inf"))
    logits[1, 7] = 0.0
    for top_p in (1.0, 0.5):  # no nucleus to find in the first row
        tokens = torch.ops.liteinfer.sample(logits, torch.ones(2), torch.full((2,), top_p), torch.tensor([0.5, 0.5]))
        assert tokens.tolist() == [0, 7]
    with pytest.raises(RuntimeError, match="temperature must be positive"):
        torch.ops.liteinfer.sample(logits, torch.tensor([1.0, 0.0]), torch.ones(2), torch.zeros(2))
    with pytest.raises(RuntimeError, match=r"top_p must be in \(0, 1\]"):
        torch.ops.liteinfer.sample(logits, torch.ones(2), torch.tensor([1.0, 0.0]), torch.zeros(2))
    with pytest.raises(RuntimeError, match="top_p and uniform per row"):
        torch.ops.liteinfer.sample(logits, torch.ones(2), torch.ones(2), torch.zeros(3))
