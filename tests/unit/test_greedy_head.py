"""The screened greedy head (layers/greedy_head.py) against the full head's argmax: the same token on every row, ties
and near-ties included, and a candidate's fp32 logit the same bits as in the full head."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from liteinfer import kernels
from liteinfer.layers import LMHead
from liteinfer.layers.greedy_head import ScreenedArgmax
from liteinfer.layers.linear import linear, pack_weight, packed_rows

pytestmark = pytest.mark.skipif(not (kernels.load() and kernels.packed_linear_available(torch.float32)),
                                reason="the packed linear multiplies fp32 only on CPUs with AVX-512 BF16")


def full_argmax(hidden: torch.Tensor, packed: torch.Tensor, vocab: int) -> torch.Tensor:
    return linear(hidden, packed)[:, :vocab].argmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [16, 32, 48, 80, 144])  # last groups of 16, 32 and 48 outputs
def test_packed_rows_are_the_rows_packed_alone(dtype, out_features):
    weight = torch.randn(out_features, 64, dtype=dtype)
    rows = torch.tensor(sorted({0, 17 % out_features, out_features - 1, out_features // 2}))
    expected = weight[rows]
    padded = torch.cat([expected, expected.new_zeros(-len(rows) % 16, 64)])
    assert torch.equal(packed_rows(pack_weight(weight), rows), pack_weight(padded))


@settings(max_examples=25, deadline=None)
@given(rows=st.sampled_from([1, 2, 7, 9, 32, 65]), picked=st.integers(1, 100), seed=st.integers(0, 2**16))
def test_a_candidate_logit_has_its_bits_in_the_full_head(rows, picked, seed):
    """What makes the screened argmax exact: W's rows multiplied on their own give the full head's bits, at every
    batch size (the kernel takes other paths at 1, up to 8, up to 64 and more rows)."""
    generator = torch.Generator().manual_seed(seed)
    weight = pack_weight(torch.randn(480, 96, generator=generator))
    x = torch.randn(rows, 96, generator=generator)
    ids = torch.randperm(480, generator=generator)[:picked].sort().values
    assert torch.equal(linear(x, packed_rows(weight, ids))[:, :picked], linear(x, weight)[:, ids])


@settings(max_examples=40, deadline=None)
@given(
    rows=st.sampled_from([1, 3, 32]),
    vocab=st.sampled_from([16, 200, 2000]),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    ties=st.sampled_from(["none", "exact", "below bf16"]),
    seed=st.integers(0, 2**16),
)
def test_screened_argmax_is_the_full_heads_argmax(rows, vocab, scale, ties, seed):
    """Random heads, and heads built to tie: rows of W repeated (exact ties: the first wins), or repeated with a
    change below bf16's resolution (the bf16 logits tie, the fp32 ones decide). Where more than half the vocabulary
    stays a candidate (a few tokens, many rows), the head declines and the logits are computed."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, 64, generator=generator) * 0.1
    if ties != "none":
        source = torch.randint(0, vocab, (vocab // 2,), generator=generator)
        target = torch.randint(0, vocab, (vocab // 2,), generator=generator)
        weight[target] = weight[source]
        if ties == "below bf16":
            weight[target] *= 1 + torch.randn(len(target), 64, generator=generator) * 2**-12
    # Hidden states near some rows of W, so that the largest logits sit close together.
    hidden = (weight[torch.randint(0, vocab, (rows,), generator=generator)] * 40
              + torch.randn(rows, 64, generator=generator)) * scale
    packed = pack_weight(torch.cat([weight, weight.new_zeros(-vocab % 16, 64)]))
    screened = ScreenedArgmax(packed, vocab)
    tokens = screened(hidden, packed)
    if tokens is None:
        assert len(screened.candidates(hidden)) > vocab // 2
    else:
        assert torch.equal(tokens, full_argmax(hidden, packed, vocab))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 3e38])  # the last finite, its logits overflowing
def test_screened_argmax_declines_what_is_not_finite(value):
    weight = pack_weight(torch.randn(64, 32))
    hidden = torch.randn(2, 32)
    hidden[1, 3] = value
    assert ScreenedArgmax(weight, 64)(hidden, weight) is None


def test_screened_argmax_declines_a_head_whose_logits_all_tie():
    """Every row of W the same: every token a candidate, whose rows would cost more to copy than the full head."""
    weight = pack_weight(torch.randn(1, 32).expand(64, 32).contiguous())
    assert ScreenedArgmax(weight, 64)(torch.randn(3, 32), weight) is None


def test_head_candidates_is_the_bound_it_states():
    """The kernel's candidates, against the same rule in PyTorch: a token stays unless some token is surely above
    it; none at all when an approximate logit is not finite."""
    generator = torch.Generator().manual_seed(0)
    approx = torch.randn(5, 1003, generator=generator).bfloat16()  # a tail past whole vectors of 16
    row_terms = torch.rand(5, 3, generator=generator) * 0.05
    vocab_terms = torch.rand(2, 1003, generator=generator)
    ids = torch.ops.liteinfer.head_candidates(approx, row_terms, vocab_terms, 2**-8)
    a = approx.float()
    error = row_terms[:, :1] * vocab_terms[0] + row_terms[:, 1:2] * vocab_terms[1] + row_terms[:, 2:] + 2**-8 * a.abs()
    expected = (a + error >= (a - error).amax(1, keepdim=True)).any(0).nonzero().flatten()
    assert 0 < len(ids) < 1003 and torch.equal(ids, expected)
    approx[4, 1001] = float("inf")
    assert len(torch.ops.liteinfer.head_candidates(approx, row_terms, vocab_terms, 2**-8)) == 0


def test_lm_head_screens_fp32_packed_heads_only():
    head = LMHead(vocab_size=100, hidden_size=32)
    head.weight.data = torch.randn(100, 32)
    head.screen_greedy()  # as loaded, not packed: the logits are computed
    assert head.screened is None and head.greedy_tokens(torch.randn(1, 32)) is None
    plain = head.weight.data
    head.weight = torch.nn.Parameter(pack_weight(torch.cat([plain, plain.new_zeros(12, 32)])), requires_grad=False)
    head.screen_greedy()
    hidden = torch.randn(4, 32)
    assert torch.equal(head.greedy_tokens(hidden), head(hidden).argmax(-1))
    bf16 = LMHead(vocab_size=96, hidden_size=32)
    bf16.weight = torch.nn.Parameter(pack_weight(torch.randn(96, 32, dtype=torch.bfloat16)), requires_grad=False)
    bf16.screen_greedy()
    assert bf16.screened is None
