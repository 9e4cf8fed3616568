"""The one-row matmul kernel (liteinfer/kernels/gemv.cpp; int8 and int4 weights at any number of rows) against the
same arithmetic in fp32, and `linear` / the int8 and int4 weights taking it on CPU."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import profile

from liteinfer import kernels
from liteinfer.layers.linear import linear
from liteinfer.layers.quantization import (
    INT8_GROUP_SIZE,
    Int4Weight,
    Int8Weight,
    gemv_int4_layout,
    gemv_int4_levels,
)

# The kernel sums a row in interleaved parts: sums in a different order differ by ~1e-6 in fp32 (up to 300 products
# here); rounded to bf16 they can then land one step apart, a relative 2^-8 to 2^-7 of the value.
FP32_REORDERED = {"atol": 1e-5, "rtol": 1e-5}
BF16_ONE_STEP = {"atol": 1e-5, "rtol": 2**-7}
# Row lengths that take every path of a float row's dot product: two vectors at a time (AVX-512: 32 fp32 or 64 bf16
# values; AVX2: 16 fp32), then one more, then a tail shorter than a vector.
IN_FEATURES = st.integers(1, 300)
# Quantized weights' output counts: any (the integer form), and whole blocks of 16 in groups of one to three blocks
# and past them (the packed tiles', where batches of five rows or more take them).
QUANTIZED_OUT_FEATURES = st.one_of(st.integers(1, 40), st.sampled_from([16, 32, 48, 64, 112]))
# One row, tiles of four rows of x with a remainder, and dequantized batches: from five rows on AVX-512 BF16, from
# sixteen on AVX2 (kernels/gemv.cpp: kDequantizedMinRows).
QUANTIZED_ROWS = st.one_of(st.integers(1, 9), st.integers(16, 18))


@settings(max_examples=60, deadline=None)
@given(
    out_features=st.integers(1, 40),  # one row to several per thread
    in_features=IN_FEATURES,
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gemv_matches_fp32_linear(out_features, in_features, dtype, with_bias, seed):
    assert kernels.load()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, in_features, generator=gen).to(dtype)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None

    out = torch.ops.liteinfer.gemv(x, weight, None, bias)

    # The same inputs, multiplied and summed in fp32, then rounded once to the output dtype, as the kernel does.
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(dtype)
    assert out.dtype == dtype and out.shape == (1, out_features)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, **FP32_REORDERED)
    else:  # the fp32 sums differ in order only; rounded to bf16 they can land one step apart (up to 2^-7)
        torch.testing.assert_close(out.float(), expected.float(), **BF16_ONE_STEP)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [8, 300])
def test_gemv_gives_a_float_weight_row_the_same_result_beside_any_rows(dtype, in_features):
    """Each thread reads its share of W's rows as four parts side by side, and the rows that cutting it in four
    leaves over one at a time: a row of W must give the same result, to the bit, in any part and alone, whatever W's
    rows before it."""
    assert kernels.load()
    torch.manual_seed(0)
    weight = torch.randn(83, in_features).to(dtype)  # two shares of ~41 rows: four parts of ten, one or two left
    x = torch.randn(1, in_features).to(dtype)
    whole = torch.ops.liteinfer.gemv(x, weight, None, None)
    for first in range(1, 12):
        assert torch.equal(whole[:, first:], torch.ops.liteinfer.gemv(x, weight[first:], None, None))
    for row in range(0, 83, 7):
        assert torch.equal(whole[:, row:row + 1], torch.ops.liteinfer.gemv(x, weight[row:row + 1], None, None))


def int16_rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The most that rounding x to 16-bit levels per group of 64 inputs (the int8 and int4 paths on x86 CPUs) can
    move each output of x weight^T: half a level, the group's largest |x| / 32767 / 2, per input, times |weight|."""
    half_level = torch.cat([group.abs().amax().expand(group.shape[1]) for group in x.float().split(64, dim=1)])
    return weight.float().abs() @ (half_level / 32767 / 2)


def bf16_weight_rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The most that rounding the weights to bf16 (bf16 batches that meet them dequantized) can move each output of
    x weight^T: half a bf16 step, 2^-9 of |weight|, per input, times |x|."""
    return x.float().abs() @ (weight.float().abs() * 2**-9).T


def fp32_sum_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What summing x weight^T in fp32 in another order (and rounding q s + z once, in one multiply-add) can move each
    output: a few fp32 steps (2^-21) of the sum of |x| |weight|, for outputs near zero that sum large terms."""
    return x.float().abs() @ weight.float().abs().T * 2**-21


def fp32_level_sum_bound(x: torch.Tensor, weight: Int8Weight | Int4Weight) -> torch.Tensor:
    """fp32_sum_bound for fp32 x in AMX tiles, which sum level * scale and zero apart (level * scale per group in the
    tiles, then zero * the group's sum of x): of the sum of |x| (|level * scale| + |zero|)."""
    dequantized = weight.dequantized(torch.float32)
    zeros = weight.scales_and_zeros[:, 1].float().repeat_interleave(INT8_GROUP_SIZE, dim=1)
    return fp32_sum_bound(x, (dequantized - zeros).abs() + zeros.abs())


def quantized_form(x: torch.Tensor, out_features: int) -> str:
    """The form in which quantized weights with `out_features` outputs meet x on this CPU (kernels/gemv.cpp:
    quantized_form): "integer" (x rounded to 16-bit levels), "amx" or "dequantized" (the weights in x's dtype)."""
    return torch.ops.liteinfer.gemv_quantized_form(x.dtype, x.shape[0], out_features)


def assert_quantized_gemv_close(out: torch.Tensor, x: torch.Tensor, weight: Int8Weight | Int4Weight,
                                bias: torch.Tensor | None, fp32_tolerance: dict) -> None:
    """The kernel's output against x dequantized^T (+ bias) in fp32: within `fp32_tolerance` (the sums' order) or one
    bf16 step of the output, plus what rounding x to 16-bit levels (int16_rounding_bound), the weights to bf16 (bf16
    x, dequantized or in AMX tiles: bf16_weight_rounding_bound) or the sums' order (fp32 x: fp32_sum_bound, in AMX
    tiles fp32_level_sum_bound) can move it."""
    # (PyTorch's own int8 kernel is no reference here: on some small bf16 shapes it returns NaN or crashes.)
    dequantized = weight.dequantized(torch.float32)
    expected = F.linear(x.float(), dequantized, None if bias is None else bias.float())
    assert out.dtype == x.dtype and out.shape == expected.shape
    tolerance = fp32_tolerance if x.dtype == torch.float32 else BF16_ONE_STEP
    form = quantized_form(x, dequantized.shape[0])
    if form == "integer":
        rounding = int16_rounding_bound(x, dequantized)
    elif x.dtype == torch.bfloat16:
        rounding = bf16_weight_rounding_bound(x, dequantized)
    else:
        rounding = fp32_level_sum_bound(x, weight) if form == "amx" else fp32_sum_bound(x, dequantized)
    allowed = rounding + tolerance["atol"] + tolerance["rtol"] * expected.abs()
    error = (out.float() - expected).abs()
    assert (error <= allowed).all(), f"largest excess {(error - allowed).max().item()}"


def assert_int8_gemv_close(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> None:
    out = torch.ops.liteinfer.gemv(x, weight.q, weight.scales_and_zeros, bias)
    assert_quantized_gemv_close(out, x, weight, bias, FP32_REORDERED)


@settings(max_examples=40, deadline=None)
@given(
    rows=QUANTIZED_ROWS,
    out_features=QUANTIZED_OUT_FEATURES,
    groups=st.integers(1, 10),  # to five groups of 64 x levels, the last one whole or half
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gemv_on_int8_weights_matches_fp32_arithmetic(rows, out_features, groups, dtype, with_bias, seed):
    assert kernels.load()
    gen = torch.Generator().manual_seed(seed)
    in_features = groups * INT8_GROUP_SIZE
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    weight = Int8Weight.from_float(torch.randn(out_features, in_features, generator=gen).to(dtype))
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    assert_int8_gemv_close(x, weight, bias)


@pytest.mark.parametrize("weight_cls", [Int8Weight, Int4Weight])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [4, 18])
def test_gemv_on_quantized_weights_gives_a_row_the_same_result_beside_any_rows(weight_cls, dtype, rows):
    """Rows of x go through in tiles (of four; dequantized, of eight or 16): a row's result must not depend on the
    tile it lands in nor on the rows beside it, so that a sequence's tokens do not depend on the batch. A batch
    takes one form by its size (four rows: the integer form; 18: the dequantized one where this CPU has it), so
    that a row alone and in a batch agree where both take the same form."""
    assert kernels.load()
    torch.manual_seed(0)
    weight = weight_cls.from_float(torch.randn(48, 128).to(dtype))
    x, others = torch.randn(rows, 128).to(dtype), torch.randn(rows, 128).to(dtype)
    def gemv(rows):
        return torch.ops.liteinfer.gemv(rows, weight.q, weight.scales_and_zeros, None)

    together = gemv(x)
    for r in range(rows):
        moved = (r + 3) % rows  # the row elsewhere in a batch of others
        batch = torch.cat([others[:moved], x[r:r + 1], others[moved + 1:]])
        assert torch.equal(together[r], gemv(batch)[moved])
        if quantized_form(x[r:r + 1], 48) == quantized_form(x, 48):
            assert torch.equal(together[r], gemv(x[r:r + 1])[0])


@pytest.mark.parametrize("weight_cls", [Int8Weight, Int4Weight])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_on_quantized_weights_gives_a_weight_row_the_same_result_beside_any_rows(weight_cls, dtype, rows):
    """Against one row of x at a time (the integer form's passes over fewer rows than its tile of four), W's rows are
    summed up four at a time from where a thread's share starts: a row of W must give the same result, to the bit,
    in any of the four places and alone among a share's last rows, whatever W's rows before it."""
    assert kernels.load()
    torch.manual_seed(0)
    weight = weight_cls.from_float(torch.randn(23, 7 * 64).to(dtype))  # 23 rows: 5 fours and 3 alone, or shifted
    x = torch.randn(rows, 7 * 64).to(dtype)
    whole = torch.ops.liteinfer.gemv(x, weight.q, weight.scales_and_zeros, None)
    for first in range(1, 4):
        rest = torch.ops.liteinfer.gemv(x, weight.q[first:], weight.scales_and_zeros[first:], None)
        assert torch.equal(whole[:, first:], rest)


@pytest.mark.parametrize("weight_cls", [Int8Weight, Int4Weight])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "out_features", "blocks"), [(5, 40, 2), (16, 49, 24), (17, 32, 1), (33, 96, 9),
                                                              (130, 20, 3), (300, 2000, 9)])
def test_gemv_on_quantized_weights_in_amx_tiles(weight_cls, dtype, rows, out_features, blocks):
    """On AMX CPUs, batches meet the weights in AMX tiles (shapes: one tile of x rows and a pair of them, a row past
    them, passes of 128 rows; W's rows in pairs of 16 and past them; blocks of 64 inputs; past 128 rows, 2,000
    outputs of 576 inputs: 63 pairs of blocks of W, converted 14 at a time, so a thread's share in several chunks).
    bf16: exactly x . bf16(W) summed in fp32. fp32: to fp32's accuracy, x split exactly into three bf16 parts against
    W's levels, each group's sums then scaled and offset in fp32: against float64, within a few fp32 steps of the sum
    of |x| times |level * scale| + |zero|, the terms the kernel adds."""
    assert kernels.load()
    torch.manual_seed(0)
    x = torch.randn(rows, blocks * 64).to(dtype)
    if quantized_form(x, out_features) != "amx":
        pytest.skip("this CPU has no AMX")
    weight = weight_cls.from_float(torch.randn(out_features, x.shape[1]).to(dtype))
    bias = torch.randn(out_features).to(dtype)
    out = torch.ops.liteinfer.gemv(x, weight.q, weight.scales_and_zeros, bias)
    dequantized = weight.dequantized(torch.float32)
    if dtype == torch.bfloat16:
        expected = F.linear(x.float(), dequantized.bfloat16().float(), bias.float())
        torch.testing.assert_close(out.float(), expected, **BF16_ONE_STEP)
        return
    expected = F.linear(x.double(), dequantized.double(), bias.double())
    assert ((out.double() - expected).abs() <= fp32_level_sum_bound(x, weight).double() + 1e-6).all()


@pytest.mark.parametrize("weight_cls", [Int8Weight, Int4Weight])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "out_features", "blocks"), [(5, 16, 1), (8, 48, 2), (9, 64, 3), (12, 96, 9),
                                                              (16, 16, 1), (17, 48, 9), (33, 160, 4), (130, 32, 2)])
def test_gemv_on_quantized_weights_in_packed_tiles_sums_the_dequantized_weights(weight_cls, dtype, rows,
                                                                                out_features, blocks):
    """Batches of five rows or more on CPUs with AVX-512 BF16 (where AMX does not take them), and bf16 batches
    of sixteen or more on CPUs with AVX2, meet the weights dequantized to x's dtype in the packed linears' tiles:
    x . W summed in fp32, W exact in fp32 and rounded to bf16 (nearest even) for bf16 (shapes: each build's least
    rows, tiles of eight rows and past them, groups of one to three blocks of 16 outputs and more than one group,
    more rows than one pass of the integer form's 128)."""
    assert kernels.load()
    torch.manual_seed(0)
    x = torch.randn(rows, blocks * 64).to(dtype)
    if quantized_form(x, out_features) != "dequantized":
        pytest.skip("this CPU takes this shape in another form (too few rows, fp32 without AVX-512 BF16, AMX tiles)")
    weight = weight_cls.from_float(torch.randn(out_features, x.shape[1]).to(dtype))
    bias = torch.randn(out_features).to(dtype)
    out = torch.ops.liteinfer.gemv(x, weight.q, weight.scales_and_zeros, bias)
    dequantized = weight.dequantized(torch.float32).to(dtype).float()
    expected = F.linear(x.float(), dequantized, bias.float())
    if dtype == torch.float32:
        assert ((out - expected).abs() <= fp32_sum_bound(x, dequantized) + 1e-6).all()
    else:
        torch.testing.assert_close(out.float(), expected, **BF16_ONE_STEP)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_on_int8_weights_rounds_x_per_group(dtype):
    """A group of zeros (no scale to divide by), one holding a value 10^4 times the others (an activation outlier),
    and a last group of 32 inputs, half of x's group of 64. The outlier's group meets zero weights, so the outputs are
    the last two groups' sums alone: had the outlier set the levels of the whole row (half a level = 100 / 65534 per
    input, a tenth of those inputs' size), their error would exceed the bound for rounding per group many times
    over."""
    assert kernels.load()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3 * 64 + 32, generator=gen) * 1e-2
    x[:, :64] = 0
    x[:, 64 + 5] = 100.0
    weight = torch.randn(24, x.shape[1], generator=gen)
    weight[:, 64:128] = 0
    assert_int8_gemv_close(x.to(dtype), Int8Weight.from_float(weight.to(dtype)))


@settings(max_examples=40, deadline=None)
@given(
    rows=QUANTIZED_ROWS,
    out_features=QUANTIZED_OUT_FEATURES,
    blocks=st.integers(1, 12),  # of the layout's 64 inputs: two groups each (past a chunk of 16 groups)
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gemv_on_int4_weights_matches_fp32_arithmetic(rows, out_features, blocks, dtype, with_bias, seed):
    assert kernels.load()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks * 64, generator=gen).to(dtype)
    weight = Int4Weight.from_float(torch.randn(out_features, x.shape[1], generator=gen).to(dtype))
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None

    out = torch.ops.liteinfer.gemv(x, weight.q, weight.scales_and_zeros, bias)

    # The kernel sums s (q · x) + (z - 8 s) (sum of x) per group: the same value, regrouped.
    assert_quantized_gemv_close(out, x, weight, bias, {"atol": 1e-4, "rtol": 1e-5})


@pytest.mark.parametrize("weight_cls", [Int8Weight, Int4Weight])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_on_quantized_weights_reads_every_length_of_a_rows_last_chunk(weight_cls, dtype):
    """A row's scales and zeros are read a chunk of groups at a time (8 with AVX2, 16 with AVX-512) and its last
    chunk through masks: rows of 1 to 18 groups (int4: even counts, two groups a block) end in every length of it,
    odd ones included, and the last row's zeros end the tensor."""
    assert kernels.load()
    gen = torch.Generator().manual_seed(0)
    step = 2 if weight_cls is Int4Weight else 1
    for groups in range(step, 19, step):
        x = torch.randn(1, groups * INT8_GROUP_SIZE, generator=gen).to(dtype)
        weight = weight_cls.from_float(torch.randn(3, x.shape[1], generator=gen).to(dtype))
        out = torch.ops.liteinfer.gemv(x, weight.q, weight.scales_and_zeros, None)
        assert_quantized_gemv_close(out, x, weight, None, FP32_REORDERED)


def test_gemv_int4_layout_is_undone_by_gemv_int4_levels():
    q = torch.randint(0, 16, (5, 3 * 64), dtype=torch.int32)
    packed = gemv_int4_layout(q)
    assert packed.shape == (5, 3 * 32) and torch.equal(gemv_int4_levels(packed), q.to(torch.uint8))
    # byte 2 l + b of a block: inputs 32 b + l (low nibble) and 32 b + 16 + l (high)
    assert packed[0, 2 * 3 + 1] == q[0, 32 + 3] | (q[0, 32 + 16 + 3] << 4)


def test_gemv_refuses_mismatched_inputs():
    assert kernels.load()
    gemv = torch.ops.liteinfer.gemv
    weight, x = torch.zeros(4, 32), torch.zeros(1, 32)
    int8, int8_scales = torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 2, 1, dtype=torch.half)
    with pytest.raises(RuntimeError, match=r"x \[1, in\] \(quantized weights: \[rows, in\]\) and weight \[out, in\]"):
        gemv(torch.zeros(2, 32), weight, None, None)
    with pytest.raises(RuntimeError, match=r"x \[1, in\] \(quantized weights: \[rows, in\]\) and weight \[out, in\]"):
        gemv(torch.zeros(1, 31), weight, None, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        gemv(x, torch.zeros(32, 4).t(), None, None)
    with pytest.raises(RuntimeError, match="share a dtype"):
        gemv(x.bfloat16(), weight, None, None)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        gemv(x.half(), weight.half(), None, None)
    with pytest.raises(RuntimeError, match="takes no scales"):
        gemv(x, weight, int8_scales, None)
    with pytest.raises(RuntimeError, match=r"must be \[out\]"):
        gemv(x, weight, None, torch.zeros(3))
    gemv(torch.zeros(3, 32), int8, int8_scales, None)  # int8 takes several rows
    with pytest.raises(RuntimeError, match=r"x \[1, in\] \(quantized weights: \[rows, in\]\)"):
        gemv(torch.zeros(0, 32), int8, int8_scales, None)
    with pytest.raises(RuntimeError, match="groups of 32"):
        gemv(torch.zeros(1, 16), torch.zeros(4, 16, dtype=torch.int8), int8_scales, None)
    for scales in (None, torch.ones(4, 1, 2, dtype=torch.half), torch.ones(4, 2, 1)):  # missing, shape, not fp16
        with pytest.raises(RuntimeError, match=r"\[out, 2, in / 32\] scales and zeros, in fp16"):
            gemv(x, int8, scales, None)
    int4, int4_scales = torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2, 2)
    gemv(torch.zeros(3, 64), int4, int4_scales, None)  # [out, in / 2] bytes against x [rows, in]
    with pytest.raises(RuntimeError, match=r"x \[1, in\] \(quantized weights: \[rows, in\]\) and weight \[out, in\]"):
        gemv(torch.zeros(1, 32), int4, int4_scales, None)
    with pytest.raises(RuntimeError, match="blocks of 64"):
        gemv(torch.zeros(1, 32), torch.zeros(4, 16, dtype=torch.uint8), int4_scales, None)
    for scales in (None, torch.ones(4, 2, 1), torch.ones(4, 2), int4_scales.bfloat16()):  # missing, a group per
        # 64 inputs, no scales-then-zeros, not in x's dtype
        with pytest.raises(RuntimeError, match=r"\[out, 2, in / 32\] scales and zeros, in x's dtype"):
            gemv(torch.zeros(1, 64), int4, scales, None)


def ops_run(fn) -> set[str]:
    with profile() as prof:
        fn()
    return {event.name for event in prof.events()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_takes_the_kernel_for_one_row_only(dtype):
    assert kernels.load()
    weight, bias = torch.randn(16, 32).to(dtype), torch.randn(16).to(dtype)
    one_row, rows = torch.randn(1, 32).to(dtype), torch.randn(3, 32).to(dtype)

    assert "liteinfer::gemv" in ops_run(lambda: linear(one_row, weight, bias))
    assert "liteinfer::gemv" not in ops_run(lambda: linear(rows, weight, bias))
    assert "liteinfer::gemv" not in ops_run(lambda: linear(one_row.half(), weight.half(), bias.half()))
    torch.testing.assert_close(linear(one_row, weight, bias), F.linear(one_row, weight, bias),
                               **({} if dtype == torch.float32 else BF16_ONE_STEP))



@pytest.mark.parametrize("weight_cls", [Int8Weight, Int4Weight])
def test_quantized_weights_take_the_kernel_for_any_rows(weight_cls):
    assert kernels.load()
    torch.manual_seed(0)
    weight = weight_cls.from_float(torch.randn(16, 64))
    for rows in (1, 3):
        x = torch.randn(rows, 64)
        assert "liteinfer::gemv" in ops_run(lambda x=x: weight(x))
        assert_quantized_gemv_close(weight(x), x, weight, None, {"atol": 1e-4, "rtol": 1e-5})
