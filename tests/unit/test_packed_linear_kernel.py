"""The packed linear (liteinfer/kernels/packed_linear.cpp) against the exact product (float64), within what fp32
summation may err, over row counts that take every tile size, the passes and the M-blocking, output counts that end
a tile's three blocks early, odd input lengths and the AMX tiles' multiples of 32; its gated form against the packed
linear then the gated activation, to the bit; and `pack_linears` choosing them (tests/integration run whole models
through them)."""

from types import SimpleNamespace

import pytest
import torch
from conftest import torch_threads
from hypothesis import given, settings
from hypothesis import strategies as st

from liteinfer import kernels
from liteinfer.distributed import TensorParallelGroup
from liteinfer.layers.decoder import GatedMLP
from liteinfer.layers.linear import (
    Linear,
    linear,
    onednn_packs,
    pack_gate_up,
    pack_linears,
    pack_weight,
    packable,
    unpack_weight,
)

pytestmark = pytest.mark.skipif(not (kernels.load() and kernels.packed_linear_available(torch.bfloat16)),
                                reason="the packed linear is built for x86 CPUs with AVX-512 BF16 or AVX2 and FMA")
# fp32 on CPUs with AVX-512 BF16 only (on AVX2 ones fp32 stays oneDNN's).
DTYPES = [dtype for dtype in (torch.float32, torch.bfloat16) if kernels.packed_linear_available(dtype)]


@settings(max_examples=60, deadline=None)
@given(
    # every tile size; 2 to 8 tiles in passes (AVX-512) and more tiles; more than one block of 128 rows
    rows=st.one_of(st.integers(0, 20), st.integers(21, 80), st.integers(120, 300)),
    # 16 outputs each: groups of three blocks, and of one or two at the end; from 24 on, threads' shares of four
    # whole groups or more, which one row reads side by side on AVX2
    blocks=st.one_of(st.integers(1, 8), st.integers(24, 40)),
    # fp32 sums in chunks of 128 steps: one to three of them; on CPUs with AMX, bf16 inputs in multiples of 32 take
    # its tiles (the rows in passes of 16, the last from a zero-padded copy)
    steps=st.one_of(st.integers(1, 300), st.integers(1, 12).map(lambda tiles: 16 * tiles)),
    dtype=st.sampled_from(DTYPES),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_packed_linear_is_within_fp32_summation_error_of_the_exact_product(rows, blocks, steps, dtype, with_bias,
                                                                          seed):
    generator = torch.Generator().manual_seed(seed)
    in_features = steps * (2 if dtype == torch.bfloat16 else 1)
    x, weight, bias = (torch.randn(*shape, generator=generator).to(dtype)
                       for shape in ((rows, in_features), (16 * blocks, in_features), (16 * blocks,)))
    bias = bias if with_bias else None
    out = torch.ops.liteinfer.packed_linear(x, pack_weight(weight), bias)
    assert out.dtype == dtype and out.shape == (rows, 16 * blocks)
    assert_within_summation_error(out, x, weight, bias)


@settings(max_examples=60, deadline=None)
@given(
    # passes of 2 to 8 tiles from 9 rows; 700 on two threads: rows shared
    rows=st.one_of(st.integers(1, 20), st.integers(21, 80), st.integers(120, 300), st.just(700)),
    blocks=st.one_of(st.integers(1, 8), st.integers(24, 40)),  # of each half: the last group of one or two blocks
    steps=st.one_of(st.integers(1, 100), st.integers(1, 12).map(lambda tiles: 16 * tiles)),  # AMX: multiples of 32
    dtype=st.sampled_from(DTYPES),
    act=st.sampled_from(["silu", "gelu_tanh"]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_gated_form_gives_the_bits_of_the_linear_then_the_activation(rows, blocks, steps, dtype, act, with_bias,
                                                                       seed):
    """packed_gated_linear over W = [G; U] packed in halves gives gated_activation(packed_linear(x, W)) exactly: the
    same sums, rounded to the dtype in between, and the same activation code (kernels/gate_row.h)."""
    generator = torch.Generator().manual_seed(seed)
    in_features = steps * (2 if dtype == torch.bfloat16 else 1)
    x, weight, bias = (torch.randn(*shape, generator=generator).to(dtype)
                       for shape in ((rows, in_features), (32 * blocks, in_features), (32 * blocks,)))
    bias = bias if with_bias else None
    with torch_threads(2):
        out = torch.ops.liteinfer.packed_gated_linear(x, pack_gate_up(weight), bias, act)
        expected = torch.ops.liteinfer.gated_activation(torch.ops.liteinfer.packed_linear(x, pack_weight(weight), bias),
                                                        act)
    assert out.dtype == dtype and out.shape == (rows, 16 * blocks)
    assert torch.equal(out, expected)


def test_the_gated_form_refuses_a_weight_not_packed_in_halves():
    x, weight = torch.zeros(2, 8, dtype=torch.bfloat16), torch.randn(64, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="gate's half, then up's"):
        torch.ops.liteinfer.packed_gated_linear(x, pack_weight(weight), None, "silu")
    with pytest.raises(RuntimeError, match="silu or gelu_tanh"):
        torch.ops.liteinfer.packed_gated_linear(x, pack_gate_up(weight), None, "relu")
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.liteinfer.packed_gated_linear(x, pack_gate_up(weight), torch.zeros(32, dtype=torch.bfloat16), "silu")


def assert_within_summation_error(out, x, weight, bias):
    as_double = [None if t is None else t.double() for t in (x, weight, bias)]
    exact = torch.nn.functional.linear(*as_double)
    # Summed in fp32 in any order, n terms err by at most about n * 2^-24 of their absolute sum (n: the inputs and
    # the bias); a bf16 output then rounds once more, by at most 2^-8 of its value.
    magnitude = torch.nn.functional.linear(*[None if t is None else t.abs() for t in as_double])
    bound = (x.shape[1] + 2) * 2**-24 * magnitude
    if out.dtype == torch.bfloat16:
        bound = bound * (1 + 2**-8) + 2**-8 * exact.abs()
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_rows_over_a_wide_weight_give_each_row_the_bits_it_gets_alone_in_its_block(dtype):
    """Past 128 rows (an M block) the AMX loop walks a thread's groups of W in chunks that stay in L2, every M block
    over one chunk before the next; from 256 rows a thread on the threads share the rows, each over all of W. 384
    inputs make a group of 48 outputs 36 KB, so a 512 KB chunk holds 14 groups and 2,080 outputs (43 groups, the
    last of one block) several chunks a thread; 700 rows on two threads, rows shared from row 352 on (the 16-row
    tiles split in two), six M blocks, the last a part one. Every output is the same pass over the same inputs
    whatever order the passes run in and whichever thread runs them, so the rows' bits equal those of each M
    block's rows multiplied alone (the threads then share the groups)."""
    generator = torch.Generator().manual_seed(0)
    rows = 700
    shapes = ((rows, 384), (2080, 384), (2080,))
    x, weight, bias = (torch.randn(*shape, generator=generator).to(dtype) for shape in shapes)
    packed = pack_weight(weight)
    with torch_threads(2):
        out = torch.ops.liteinfer.packed_linear(x, packed, bias)
        by_block = torch.cat([torch.ops.liteinfer.packed_linear(x[r:r + 128], packed, bias)
                              for r in range(0, rows, 128)])
    assert_within_summation_error(out, x, weight, bias)
    assert torch.equal(out, by_block)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_are_the_same_alone_and_among_rows_taken_in_passes(dtype):
    """On AVX-512, 9 to 64 rows take each group of W in passes of 64 steps through every tile of 8 rows, carrying
    each tile's sums from pass to pass; one row, and more than 64, take every step in one range. A row's sums are
    the same operations in the same order either way, so its bits alone equal its bits among 9, 40, 64, 65 or 200
    rows. 300 fp32 inputs: passes that end inside and on the 128-step chunks of the two-level sums; bf16 300 inputs
    too (150 pairs, not a multiple of 32, so the AVX-512 tiles serve where AMX is). 7 blocks: groups of 3, 3 and 1,
    each thread's last pass requesting the next group's lines, the gated form's its other half's."""
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=generator).to(dtype) for shape in ((200, 300), (112, 300), (112,)))
    packed, gate_up = pack_weight(weight), pack_gate_up(torch.cat([weight, weight.flip(0)]))
    with torch_threads(2):
        alone = torch.cat([torch.ops.liteinfer.packed_linear(x[r:r + 1], packed, bias) for r in range(200)])
        gated_alone = torch.cat([torch.ops.liteinfer.packed_gated_linear(x[r:r + 1], gate_up, None, "silu")
                                 for r in range(200)])
        for rows in (9, 40, 64, 65, 200):
            assert torch.equal(torch.ops.liteinfer.packed_linear(x[:rows], packed, bias), alone[:rows])
            assert torch.equal(torch.ops.liteinfer.packed_gated_linear(x[:rows], gate_up, None, "silu"),
                               gated_alone[:rows])
    assert_within_summation_error(alone, x, weight, bias)


def test_amx_serves_bf16_where_the_cpu_has_it():
    """The AMX tiles are built and permitted wherever the CPU reports AMX-BF16 (Linux grants the tile state on
    request), so that the test above covers them on such a CPU."""
    with open("/proc/cpuinfo") as cpuinfo:
        has_amx = any(line.startswith("flags") and " amx_bf16" in line for line in cpuinfo)
    assert torch.ops.liteinfer.packed_linear_amx() == has_amx


def test_one_row_gives_each_output_the_same_result_whichever_groups_are_read_beside_it():
    """On AVX2 one row of x reads a thread's whole groups of 48 outputs four at a time (one from each quarter of its
    share), the rest one at a time: an output's sum must be the same to the bit in either, whatever W's rows before
    it (W cut by whole groups, so that the groups' contents stay and their places in the shares move)."""
    torch.manual_seed(0)
    # 20 whole groups and one of a block. Outputs near zero (the bias cancels most of each sum), so that rounding
    # to bf16 keeps the fp32 sums' order visible: PyTorch's order differs from the kernel's in ~13% of them, where
    # random rows of 2,048 or 150 inputs with a random bias showed none.
    weight = torch.randn(16 * 61, 2 * 1024).bfloat16()
    x = torch.randn(1, 2 * 1024).bfloat16()
    bias = -(x.float() @ weight.float().T)[0].bfloat16()
    whole = torch.ops.liteinfer.packed_linear(x, pack_weight(weight), bias)
    for first in range(48, 48 * 7, 48):
        rest = torch.ops.liteinfer.packed_linear(x, pack_weight(weight[first:]), bias[first:])
        assert torch.equal(whole[:, first:], rest)
    for first in range(0, 16 * 61, 48):
        alone = torch.ops.liteinfer.packed_linear(x, pack_weight(weight[first:first + 48]), bias[first:first + 48])
        assert torch.equal(whole[:, first:first + 48], alone)


@pytest.mark.skipif(torch.float32 not in DTYPES, reason="fp32 stays oneDNN's on this CPU")
def test_fp32_sums_over_long_rows_err_no_more_than_pytorchs():
    """Against float64: the kernel's two-level sums stay as close as PyTorch's fp32 matmul over 2,048 inputs (one
    running sum erred ~5x more, which moved Gemma 3's fp32 logits past the parity test's bound)."""
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(64, 2048, generator=generator) * 3, torch.randn(96, 2048, generator=generator) * 0.05
    exact = x.double() @ weight.double().t()
    ours = torch.ops.liteinfer.packed_linear(x, pack_weight(weight), None).double()
    torchs = torch.nn.functional.linear(x, weight).double()
    assert (ours - exact).abs().max() <= 2 * (torchs - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 5, 7])
def test_unpack_weight_inverts_pack_weight(blocks, dtype):
    weight = torch.randn(16 * blocks, 10).to(dtype)
    assert torch.equal(unpack_weight(pack_weight(weight)), weight)
    assert torch.equal(unpack_weight(pack_gate_up(torch.cat([weight, -weight]))), torch.cat([weight, -weight]))


def test_packed_linear_refuses_mismatched_inputs():
    packed_linear = torch.ops.liteinfer.packed_linear
    x, weight = torch.zeros(2, 8, dtype=torch.bfloat16), pack_weight(torch.randn(32, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="expected x"):
        packed_linear(x[:, :6], weight, None)  # inputs
    with pytest.raises(RuntimeError, match="expected x"):
        packed_linear(x, torch.randn(32, 8, dtype=torch.bfloat16), None)  # not packed
    with pytest.raises(RuntimeError, match="expected x"):
        packed_linear(x, pack_weight(torch.randn(32, 8)).bfloat16(), None)  # bf16 takes pairs
    with pytest.raises(RuntimeError, match="x's dtype"):
        packed_linear(x, pack_weight(torch.randn(32, 8)).view(2, 4, 16, 2), None)
    with pytest.raises(RuntimeError, match="packed_linear takes"):
        packed_linear(x.half(), weight.half(), None)
    if torch.float32 not in DTYPES:
        with pytest.raises(RuntimeError, match="fp32 stays oneDNN's"):
            packed_linear(x.float(), pack_weight(torch.randn(32, 8)), None)
    with pytest.raises(RuntimeError, match="bias"):
        packed_linear(x, weight, torch.zeros(16, dtype=torch.bfloat16))
    for dtype in DTYPES:  # no inputs: refused (on AMX CPUs bf16 once died of a division by zero)
        with pytest.raises(RuntimeError, match="at least one input"):
            packed_linear(torch.zeros(2, 0, dtype=dtype), pack_weight(torch.zeros(32, 0, dtype=dtype)), None)


def test_pack_linears_takes_what_the_kernel_takes_and_leaves_the_rest_plain_or_to_onednn():
    model = torch.nn.Module()
    model.packed = torch.nn.Linear(8, 32, dtype=torch.bfloat16)
    model.odd_outputs = torch.nn.Linear(8, 24, dtype=torch.bfloat16)  # not a multiple of 16
    model.odd_inputs = torch.nn.Linear(7, 32, dtype=torch.bfloat16)  # bf16 steps take input pairs
    model.requires_grad_(False)
    x = {7: torch.randn(3, 7, dtype=torch.bfloat16), 8: torch.randn(3, 8, dtype=torch.bfloat16)}
    expected = {name: linear(x[m.in_features], m.weight, m.bias) for name, m in model.named_children()}
    assert [packable(m.weight) for m in model.children()] == [True, False, False]
    # Before compiling: ours only, the rest plain for the tracer (engine/compiled.py); then oneDNN takes the rest.
    pack_linears(model, (torch.nn.Linear,), onednn=False)
    assert model.packed.weight.shape == (2, 4, 16, 2)
    assert model.odd_outputs.weight.dim() == model.odd_inputs.weight.dim() == 2
    assert not (model.odd_outputs.weight.is_mkldnn or model.odd_inputs.weight.is_mkldnn)
    pack_linears(model, (torch.nn.Linear,))
    assert model.packed.weight.shape == (2, 4, 16, 2)
    # oneDNN prepacks bf16 only where the CPU has what its bf16 path needs (AVX-512 BW/VL/DQ or AVX-NE-CONVERT);
    # elsewhere it would refuse, and W stays as loaded.
    takes_bf16 = onednn_packs(torch.bfloat16)
    assert model.odd_outputs.weight.is_mkldnn == model.odd_inputs.weight.is_mkldnn == takes_bf16
    for name, m in model.named_children():
        torch.testing.assert_close(linear(x[m.in_features], m.weight, m.bias), expected[name], atol=1e-2, rtol=1e-2)
    # Three-dimensional inputs keep their leading dimensions.
    assert linear(torch.randn(2, 3, 8, dtype=torch.bfloat16), model.packed.weight).shape == (2, 3, 32)


def test_pack_linears_packs_a_silu_mlps_gate_up_in_halves_and_its_forward_makes_the_activation():
    """A gated MLP with SiLU packs gate/up for the gated form and gives the bits of gate/up packed whole (the packed
    linear, then the activation); GELU (Gemma) keeps the two ops (inductor's GELU is the faster in compiled graphs),
    as does a W whose halves our kernel does not take (8 outputs each)."""
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    cases = (("silu", 96, True), ("gelu_pytorch_tanh", 96, False), ("silu", 8, False))
    for hidden_act, intermediate, in_halves in cases:
        spec = SimpleNamespace(hidden_size=64, intermediate_size=intermediate, mlp_bias=False, hidden_act=hidden_act)
        mlp = GatedMLP(spec, TensorParallelGroup()).to(torch.bfloat16)
        for param in mlp.parameters():
            param.data.normal_()
        pack_linears(mlp, (Linear,))
        assert mlp.gate_up_proj.makes_activation == (mlp.gate_up_proj.weight.dim() == 5) == in_halves
        if in_halves:  # against gate/up packed whole, then the activation, beside the same packed down_proj
            gate_up = linear(x, pack_weight(unpack_weight(mlp.gate_up_proj.weight)))
            assert torch.equal(mlp(x), mlp.down_proj(mlp.act(gate_up)))
