"""The screened greedy head (layers/greedy_head.py) against the full head's argmax: the same token on every row, ties
and near-ties included, in fp32 and bf16; a candidate's logit the same bits as in the full head; the screen's logits
within the bound it states."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from liteinfer import kernels
from liteinfer.layers import LMHead
from liteinfer.layers.greedy_head import OUTLIER_DIMS, ScreenedArgmax
from liteinfer.layers.linear import linear, pack_weight, packed_rows, unpack_weight

pytestmark = pytest.mark.skipif(
    not (kernels.load() and kernels.head_screen_available() and kernels.packed_linear_available(torch.float32)),
    reason="the screen is built for CPUs with AVX-512 VNNI, the packed linear in fp32 for those with AVX-512 BF16")


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
@given(rows=st.sampled_from([1, 2, 7, 9, 32, 65]), picked=st.integers(1, 100), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_candidate_logit_has_its_bits_in_the_full_head(rows, picked, seed, dtype):
    """What makes the screened argmax exact: W's rows multiplied on their own give the full head's bits, at every
    batch size (the kernel takes other paths at 1, up to 8, up to 64 and more rows)."""
    generator = torch.Generator().manual_seed(seed)
    weight = pack_weight(torch.randn(480, 96, generator=generator).to(dtype))
    x = torch.randn(rows, 96, generator=generator).to(dtype)
    ids = torch.randperm(480, generator=generator)[:picked].sort().values
    assert torch.equal(linear(x, packed_rows(weight, ids))[:, :picked], linear(x, weight)[:, ids])


def random_head(generator: torch.Generator, vocab: int, rows: int, ties: str, dtype: torch.dtype,
                scale: float = 1.0, inputs: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A head W [vocab (padded to 16), inputs] and hidden states near some of its rows, so that the largest logits
    sit close together, with a few dims far above the rest as a real model's final hidden states have them. For
    ties, rows of W repeated: exactly, changed below bf16's resolution in fp32, or by one bf16 step in one element."""
    weight = torch.randn(vocab, inputs, generator=generator) * 0.1
    source = torch.randint(0, vocab, (vocab // 2,), generator=generator)
    target = torch.randint(0, vocab, (vocab // 2,), generator=generator)
    if ties != "none":
        weight[target] = weight[source]
    if ties == "below bf16":
        weight[target] *= 1 + torch.randn(len(target), inputs, generator=generator) * 2**-12
    weight = weight.to(dtype)
    if ties == "one bf16 step":
        column = torch.randint(0, inputs, (len(target),), generator=generator)
        stepped = weight[target, column].bfloat16().view(torch.int16) + 1
        weight[target, column] = stepped.view(torch.bfloat16).to(dtype)
    hidden = (weight[torch.randint(0, vocab, (rows,), generator=generator)].float() * 40
              + torch.randn(rows, inputs, generator=generator))
    hidden[:, torch.randperm(inputs, generator=generator)[:3]] *= 30  # the outlier dims
    return torch.cat([weight, weight.new_zeros(-vocab % 16, inputs)]), (hidden * scale).to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.sampled_from([1, 3, 32]),
    vocab=st.sampled_from([16, 200, 2000]),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    ties=st.sampled_from(["none", "exact", "below bf16", "one bf16 step"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_screened_argmax_is_the_full_heads_argmax(rows, vocab, scale, ties, dtype, seed):
    """Random heads, and heads built to tie: logits that only fp32 tells apart, and in bf16 logits whose roundings to
    bf16 tie (the first wins). Where more than half the vocabulary stays a candidate (a few tokens, many rows), the
    head declines and the logits are computed."""
    weight, hidden = random_head(torch.Generator().manual_seed(seed), vocab, rows, ties, dtype, scale)
    packed = pack_weight(weight)
    screened = ScreenedArgmax(packed, vocab)
    tokens = screened(hidden, packed)
    if tokens is None:
        assert len(screened.candidates(hidden, packed)) > vocab // 2
    else:
        assert torch.equal(tokens, full_argmax(hidden, packed, vocab))


def screened_logits(vocab: int, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A random head's screen: (hidden, W, the ScreenedArgmax, the kernel's candidates and logits [rows, vocab])."""
    weight, hidden = random_head(torch.Generator().manual_seed(1), vocab, rows, "none", dtype)
    packed = pack_weight(weight)
    screened = ScreenedArgmax(packed, vocab)
    screened.candidates(hidden, packed)  # the first call chooses the outlier dims
    candidates = screened.candidates(hidden, packed)
    return hidden, weight[:vocab], screened, candidates, screened.logits[:rows, :vocab].double()


def bound_terms(hidden: torch.Tensor, screened: ScreenedArgmax) -> tuple[torch.Tensor, ...]:
    """Each row's alpha and beta as layers/greedy_head.py derives them (fp64, no margin), and x's rounded levels."""
    x, dims = hidden.double(), screened.outlier_dims
    x_rest = x.clone()
    x_rest[:, dims] = 0
    x_rounded = (x_rest.abs().amax(1, keepdim=True) / 127).float().double()
    x_rounded = x_rounded * (x_rest / x_rounded).round().clamp(-127, 127)
    outliers = x[:, dims].bfloat16().double()

    def gamma(n: int) -> float:
        return n * 2**-23 / (1 - n * 2**-23)

    norm_rounded, norm_outliers = x_rounded.norm(dim=1), outliers.norm(dim=1)
    weight_rounding = 0 if hidden.dtype == torch.bfloat16 else 2**-8
    alpha = ((x_rest - x_rounded).norm(dim=1) + (x[:, dims] - outliers).norm(dim=1) + weight_rounding * norm_outliers
             + gamma(x.shape[1]) * x.norm(dim=1)
             + gamma(OUTLIER_DIMS + 4) * (norm_rounded + (1 + weight_rounding) * norm_outliers))
    beta = norm_rounded * (1 + gamma(OUTLIER_DIMS + 4))
    return alpha, beta, x_rounded, outliers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_screen_logits_lie_within_the_stated_bound(dtype):
    """The screen's logits are the arithmetic of the kernel's contract (levels times scales, plus the outlier dims in
    bf16), and lie within e(r, j) of x.w_j (fp64) as layers/greedy_head.py derives e, recomputed here from x and W."""
    hidden, weight, screened, _, approx = screened_logits(1000, 8, dtype)
    x, w, dims = hidden.double(), weight.double(), screened.outlier_dims
    assert torch.equal(dims, x.abs().sum(0).topk(OUTLIER_DIMS).indices.sort().values)
    alpha, beta, x_rounded, outliers = bound_terms(hidden, screened)
    w_scale = (w.abs().amax(1, keepdim=True) / 127).float().double()
    w_rounded = w_scale * (w / w_scale).round().clamp(-127, 127)
    outlier_weights = w[:, dims].bfloat16().double()
    torch.testing.assert_close(approx, x_rounded @ w_rounded.T + outliers @ outlier_weights.T, rtol=1e-5, atol=1e-4)
    bound = alpha[:, None] * w.norm(dim=1) + beta[:, None] * (w - w_rounded).norm(dim=1) + 1e-6
    error = (approx - x @ w.T).abs()
    assert (error <= bound).all()
    assert (error > bound / 20).any()  # not so loose a bound that a term left out could hide in it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 1024])  # a last block of 40 tokens, and whole blocks
def test_candidates_follow_the_contract(dtype, vocab):
    """The kernel's candidates, recomputed from its own logits (kernels' contract): the tokens whose upper end a + E
    reaches the row's largest lower end a - E, within a margin (1e-4) for the kernel's fp32 roundings of the ends,
    although the kernel reads only the blocks of 64 tokens whose largest logit can reach it."""
    hidden, _, screened, candidates, a = screened_logits(vocab, 12, dtype)
    alpha, beta, _, _ = bound_terms(hidden, screened)
    norms, distances = screened.vocab_terms.double()
    e = (alpha[:, None] * norms + beta[:, None] * distances) * (1 + 2**-10) + 1e-6  # the kernel's margin on alpha, beta
    half_width = (1 + screened.relative) * e + screened.relative * a.abs()
    largest_lower = (a - half_width).amax(1, keepdim=True)
    chosen = torch.zeros(vocab, dtype=torch.bool)
    chosen[candidates] = True
    assert (chosen >= (a + half_width >= largest_lower + 1e-4).any(0)).all()
    assert (chosen <= (a + half_width >= largest_lower - 1e-4).any(0)).all()
    assert 0 < chosen.sum() < vocab // 4  # a screen that keeps few


def test_screen_writes_its_logits_into_a_workspace_kept_between_calls():
    """The screen's logits go into one workspace, grown to a power of two rows and reused by smaller calls (a fresh
    one each call was mapped and faulted in anew: docs/benchmarks.md); what a call finds does not depend on it."""
    weight, hidden = random_head(torch.Generator().manual_seed(3), 1000, 12, "none", torch.bfloat16)
    packed = pack_weight(weight)
    screened = ScreenedArgmax(packed, 1000)
    screened.candidates(hidden, packed)
    assert screened.logits.shape == (16, screened.levels.shape[0] * 64)
    workspace = screened.logits.data_ptr()

    def screen(rows: torch.Tensor, logits: torch.Tensor, largest_scale: float = screened.largest_scale) -> torch.Tensor:
        return torch.ops.liteinfer.head_screen(
            rows, screened.outlier_dims, screened.levels, screened.level_scales, screened.level_offsets,
            screened.outlier_weights, screened.vocab_terms, screened.block_terms, logits, screened.relative,
            screened.weight_rounding, largest_scale)

    few = hidden[:3].contiguous()
    alone = torch.empty(3, screened.logits.shape[1])
    assert torch.equal(screened.candidates(few, packed), screen(few, alone))
    assert screened.logits.data_ptr() == workspace
    assert torch.equal(screened.logits[:3], alone)
    assert torch.equal(screened(few, packed), full_argmax(few, packed, 1000))
    with pytest.raises(RuntimeError, match="expected logits"):
        screen(hidden, alone)  # room for 3 rows, not 12
    with pytest.raises(RuntimeError, match="64-byte boundary"):
        screen(few, torch.empty(3 * alone.shape[1] + 1)[1:].view(3, -1))
    with pytest.raises(RuntimeError, match="largest_scale"):
        screen(few, alone, largest_scale=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 3e38])  # the last finite, its logits overflowing
def test_screened_argmax_declines_what_is_not_finite(dtype, value):
    weight = pack_weight(torch.randn(64, 32).to(dtype))
    hidden = torch.randn(2, 32)
    hidden[1, 3] = value
    assert ScreenedArgmax(weight, 64)(hidden.to(dtype), weight) is None


def test_screened_argmax_of_logits_far_below_zero():
    """Every logit near -1000 in a bf16 head (one input dim shared by all of W's rows, against a large x): a token
    below a block's largest logit has the larger |a| and so the larger half-width (a 2^-8 share of |a|), which the
    block's upper end must still cover. (An fp32 head declines here: its outlier columns' rounding to bf16 against
    x's 1000 widens every bound past the logits' spread.)"""
    dtype = torch.bfloat16
    generator = torch.Generator().manual_seed(3)
    plain = torch.randn(300, 64, generator=generator)  # logits ~8 apart: more than the bound's ~4 at |a| ~1000
    plain[:, 5] = -1
    hidden = torch.randn(8, 64, generator=generator)
    hidden[:, 5] = 1000
    weight, hidden = pack_weight(torch.cat([plain, plain.new_zeros(4, 64)]).to(dtype)), hidden.to(dtype)
    tokens = ScreenedArgmax(weight, 300)(hidden, weight)
    assert tokens is not None and torch.equal(tokens, full_argmax(hidden, weight, 300))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_screened_argmax_takes_large_finite_rows(dtype):
    """A row far above a model's (1e30, its logits finite) is screened, not declined: the decline is for rows whose
    logits could overflow, not for large ones."""
    plain = torch.randn(64, 32)
    weight = pack_weight(plain.to(dtype))
    hidden = torch.randn(2, 32)
    hidden[1, 3] = 1e30
    hidden = hidden.to(dtype)
    screened = ScreenedArgmax(weight, 64)
    assert len(screened.candidates(hidden, weight)) > 0
    assert torch.equal(screened(hidden, weight), full_argmax(hidden, weight, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_screened_argmax_declines_a_head_whose_logits_all_tie(dtype):
    """Every row of W the same: every token a candidate, whose rows would cost more to copy than the full head."""
    weight = pack_weight(torch.randn(1, 32).expand(64, 32).contiguous().to(dtype))
    assert ScreenedArgmax(weight, 64)(torch.randn(3, 32).to(dtype), weight) is None


def test_outlier_dims_follow_the_largest_inputs():
    """Chosen on the 1st, 2nd, 4th ... call from |x| summed over those calls' rows; W's columns for them in bf16."""
    plain = torch.randn(96, 64)
    weight = pack_weight(plain)
    screened = ScreenedArgmax(weight, 96)
    hidden = torch.randn(5, 64)
    hidden[:, 7] = 1e4
    screened(hidden, weight)
    dims = screened.outlier_dims
    assert 7 in dims.tolist() and len(dims) == OUTLIER_DIMS
    hidden[:, 7], hidden[:, 50] = 0, 1e5
    screened(hidden, weight)  # the 2nd call: dim 50 now outweighs the rest
    assert 50 in screened.outlier_dims.tolist()
    columns = screened.outlier_weights.transpose(1, 2).reshape(-1, OUTLIER_DIMS)[:96]  # [tokens, dims]
    assert torch.equal(columns, plain[:, screened.outlier_dims].bfloat16())
    assert torch.equal(unpack_weight(weight), plain)  # W itself untouched


def test_lm_head_screens_packed_heads_only():
    head = LMHead(vocab_size=100, hidden_size=32)
    head.weight.data = torch.randn(100, 32)
    head.screen_greedy()  # as loaded, not packed: the logits are computed
    assert head.screened is None and head.greedy_tokens(torch.randn(1, 32)) is None
    for dtype in (torch.float32, torch.bfloat16):
        plain = torch.randn(100, 32).to(dtype)
        head.weight = torch.nn.Parameter(pack_weight(torch.cat([plain, plain.new_zeros(12, 32)])),
                                         requires_grad=False)
        head.screened = None
        head.screen_greedy()
        hidden = torch.randn(4, 32).to(dtype)
        if ScreenedArgmax.takes(head.weight):
            assert torch.equal(head.greedy_tokens(hidden), head(hidden).argmax(-1))
        else:  # bf16 on a CPU with AMX
            assert dtype == torch.bfloat16 and head.greedy_tokens(hidden) is None
