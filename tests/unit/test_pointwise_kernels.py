"""The pointwise kernels (liteinfer/kernels/pointwise.cpp) against the PyTorch expressions they replace in eager
steps: RMSNorm with and without the residual add (Llama's and Gemma's weight forms), rotary over q and k, the gated
activations, and the K/V cache write. They round where those expressions round, so results agree to the last bit of
the activation dtype, except where an fp32 sum or exp in a different order lands a hair on the other side of a
rounding boundary: then a step of the dtype at each rounding the expression makes (two at most), for a handful of
elements."""

import pytest
import torch
from conftest import head_major as to_head_major
from hypothesis import given, settings
from hypothesis import strategies as st

from liteinfer import kernels
from liteinfer.layers import (
    AttentionMetadata,
    GatedActivation,
    GemmaRMSNorm,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
)
from liteinfer.layers.rotary import rotate_queries_and_keys

DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


def test_kernels_build_here():
    assert kernels.load()
    assert kernels.pointwise_takes(torch.zeros(1, dtype=torch.bfloat16))
    assert not kernels.pointwise_takes(torch.zeros(1, dtype=torch.float64))


def through_kernel(op, layer_call):
    """layer_call's result, checking that the layer ran `op` (else the comparisons below would pit PyTorch
    against itself)."""
    with torch.profiler.profile() as prof:
        out = layer_call()
    assert f"liteinfer::{op}" in {event.key for event in prof.key_averages()}
    return out


def assert_near(out, expected, floor=0.0, near_ties=None):
    """bf16/fp16: equal, or for a few elements a step of the dtype apart per rounding (an fp32 difference carried
    through); fp32: within a few units in the last place. Either give or take `floor` (absolute). Given `near_ties`
    (a mask), bf16/fp16 elements may differ there only, rather than a few anywhere."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    info = torch.finfo(expected.dtype)
    step = 1e-6 if expected.dtype == torch.float32 else info.eps
    off = (out.float() - expected.float()).abs()
    assert (off <= 2 * step * expected.float().abs().clamp(min=info.tiny) + floor).all()
    if expected.dtype != torch.float32:  # (in fp32 every element may differ in its last bits)
        differ = off > floor
        if near_ties is None:
            assert differ.sum() <= max(1, 0.02 * off.numel())
        else:
            assert near_ties[differ].all()


def rounds_near_a_tie(exact, dtype, fp32_steps=4):
    """Where `exact` (float64) lies within a few fp32 steps of the midpoint between two neighbours in `dtype`: two
    fp32 computations that far apart may round it to either neighbour."""
    margin = fp32_steps * torch.finfo(torch.float32).eps * exact.abs()
    return (exact - margin).to(dtype) != (exact + margin).to(dtype)


@settings(max_examples=40, deadline=None)
@given(
    dtype=DTYPES,
    rows=st.integers(1, 40),
    size=st.sampled_from([8, 64, 576, 1000]),
    gemma=st.booleans(),
    with_residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_matches_pytorch(dtype, rows, size, gemma, with_residual, seed):
    assert kernels.load()
    torch.manual_seed(seed)
    norm = (GemmaRMSNorm if gemma else RMSNorm)(size, eps=1e-6)
    norm.weight.data = (torch.randn(size) * 0.5 + (0 if gemma else 1)).to(dtype)
    x = (torch.randn(rows, size) * 3).to(dtype)
    residual = (torch.randn(rows, size) * 3).to(dtype) if with_residual else None
    out = through_kernel("add_rms_norm" if with_residual else "rms_norm", lambda: norm(x, residual))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "pointwise_takes", lambda *args, **kwargs: False)
        expected = norm(x, residual)
    if with_residual:
        assert_near(out[0], expected[0])
        assert torch.equal(out[1], expected[1])  # the sum is one rounded add either way
    else:
        assert_near(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_activation_of_gates_far_below_zero_is_zero_not_nan(dtype, act):
    """Gates below -88 overflowed e^-g to infinity, and SiLU's 1 / (1 + e^-g) came out NaN (0 * infinity in the refined
    reciprocal; the scalar loop under -ffast-math too), where PyTorch gives -0: one such outlier poisoned the layer."""
    assert kernels.load()
    layer = GatedActivation(act)
    gate = torch.tensor([-1e4, -300.0, -100.0, -91.5, -89.0, -88.5, -88.0, -50.0] * 4)
    gate_up = torch.cat([gate, torch.linspace(-3, 3, len(gate))]).view(1, -1).to(dtype)
    out = through_kernel("gated_activation", lambda: layer(gate_up))
    gate, up = gate_up.chunk(2, dim=-1)
    expected = layer.act(gate) * up  # PyTorch's, in the dtype: -0 below -88 or so, tiny values above
    assert torch.isfinite(out).all()
    rtol = 1e-5 if dtype == torch.float32 else 1e-2  # the 16-bit dtypes: a step apart where a tie falls otherwise
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=1e-30)


@settings(max_examples=40, deadline=None)
@given(
    dtype=DTYPES,
    tokens=st.integers(1, 40),
    heads=st.integers(1, 9),
    kv_heads=st.integers(1, 3),
    dim=st.sampled_from([2, 32, 64, 128]),
    seed=st.integers(0, 2**16),
)
def test_rotary_matches_pytorch(dtype, tokens, heads, kv_heads, dim, seed):
    """q and k as the layers hand them over: views into one fused q/k/v projection's rows. bf16 and fp16 agree bit
    for bit (each product is rounded before the sum, as PyTorch's ops round it); in fp32 the compiler may fuse a
    product into the sum, one rounding fewer."""
    torch.manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    rope = RotaryEmbedding(dim, max_position=4096, theta=10000.0)
    cos, sin = rope(torch.randint(0, 4096, (tokens,)), dtype)
    outs = through_kernel("rotary", lambda: rotate_queries_and_keys(q, k, cos, sin))
    for out, expected in zip(outs, (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))):
        if dtype == torch.float32:
            torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(out, expected)


@settings(max_examples=40, deadline=None)
@given(
    dtype=DTYPES,
    rows=st.integers(1, 40),
    size=st.sampled_from([8, 64, 1536]),
    act=st.sampled_from(["silu", "gelu_pytorch_tanh"]),
    seed=st.integers(0, 2**16),
)
def test_gated_activation_matches_pytorch(dtype, rows, size, act, seed):
    torch.manual_seed(seed)
    layer = GatedActivation(act)
    gate_up = (torch.randn(rows, 2 * size) * 4).to(dtype)
    out = through_kernel("gated_activation", lambda: layer(gate_up))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "pointwise_takes", lambda *args, **kwargs: False)
        expected = layer(gate_up)
    # GELU's 1 + tanh(..) cancels for very negative gates, where two tanh implementations' last-bit differences
    # become relative errors of any size: absolutely, they stay a few fp32 steps of gate * up.
    gate, up = gate_up.float().chunk(2, dim=-1)
    # Our SiLU (a 16-lane exp, a refined reciprocal) and PyTorch's are a few fp32 steps apart: they round the
    # activation to different neighbours only where its exact value is that near a tie, and a gate value that recurs
    # (bf16 has few) recurs with it, so the differences are held to those places rather than counted.
    exact_silu = gate.double() / (1 + torch.exp(-gate.double()))
    near_ties = rounds_near_a_tie(exact_silu, dtype) if act == "silu" else None
    assert_near(out, expected, floor=8 * torch.finfo(torch.float32).eps * (gate * up).abs(), near_ties=near_ties)


@settings(max_examples=40, deadline=None)
@given(
    dtype=DTYPES,
    tokens=st.integers(1, 40),
    kv_heads=st.integers(1, 3),
    block_size=st.sampled_from([1, 4, 16]),
    head_major=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_write_kv_matches_indexed_assignment(dtype, tokens, kv_heads, block_size, head_major, seed):
    """The step's K/V written into distinct random slots of the pools (their runs block-major, or head-major as
    KVCache lays out a CPU's); v as the layers hand it over (a view into the fused projection's rows)."""
    torch.manual_seed(seed)
    dim, num_blocks = 32, 64
    attn = PagedAttention(kv_heads, kv_heads, dim, dim**-0.5)
    pools = [torch.randn(num_blocks, kv_heads, block_size, dim).to(dtype) for _ in range(2)]
    lay_out = to_head_major if head_major else torch.clone
    attn.k_cache, attn.v_cache = (lay_out(pool) for pool in pools)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    blocks, offsets = slots // block_size, slots % block_size
    # Each token a decode that sees its block up to its own slot (attention runs too; its output is not checked).
    meta = AttentionMetadata(blocks, offsets, positions=offsets, decode_block_tables=blocks[:, None], prefills=[])
    kv = torch.randn(tokens, 3 * kv_heads * dim).to(dtype)
    k, v = kv[:, kv_heads * dim :].split(kv_heads * dim, dim=-1)
    through_kernel("write_kv", lambda: attn(torch.zeros(tokens, kv_heads * dim, dtype=dtype), k, v, meta))
    for pool, new, written in zip(pools, (k, v), (attn.k_cache, attn.v_cache)):
        pool[meta.slot_blocks, :, meta.slot_offsets] = new.reshape(tokens, kv_heads, dim)
        assert torch.equal(written, pool)


def test_ops_refuse_what_they_cannot_take():
    assert kernels.load()
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.liteinfer.rms_norm(x, torch.ones(7), 1e-6, False)
    with pytest.raises(RuntimeError, match="silu or gelu_tanh"):
        torch.ops.liteinfer.gated_activation(x, "relu")
    q = torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.liteinfer.rotary(q, q, torch.randn(3, 8), torch.randn(3, 8))
    pool = torch.zeros(4, 2, 4, 8)
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.liteinfer.write_kv(q, q, pool, pool.clone(), torch.tensor([0, 0, 4, 0]), torch.zeros(4).long())
    slots = torch.zeros(4).long()
    rows_apart = torch.zeros(4, 2, 8, 4).transpose(2, 3)  # a block's rows for a head not one contiguous run
    with pytest.raises(RuntimeError, match="one KV head must be contiguous"):
        torch.ops.liteinfer.write_kv(q, q, rows_apart, rows_apart.clone(), slots, slots)
    every_other = torch.zeros(8, 2, 4, 8)[::2]  # runs neither block-major nor head-major
    with pytest.raises(RuntimeError, match="block-major .* or head-major"):
        torch.ops.liteinfer.write_kv(q, q, every_other, every_other.clone(), slots, slots)
    with pytest.raises(RuntimeError, match="lie alike"):
        torch.ops.liteinfer.write_kv(q, q, pool, to_head_major(pool), slots, slots)
