"""The argmax kernel against torch.argmax: first index of the largest value, every length (tails included), ties."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from liteinfer import kernels
from liteinfer.sampling.sampler import argmax_rows

pytestmark = pytest.mark.skipif(not kernels.load(), reason="liteinfer's CPU kernels could not be built here")


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 20),
    vocab=st.integers(1, 100),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    levels=st.sampled_from([3, 1000]),  # few distinct values: ties everywhere; many: mostly one maximum
    seed=st.integers(0, 2**16),
    masked=st.booleans(),  # -inf where the sampler masks tokens (the kernels are built with -ffast-math)
)
def test_argmax_is_torch_argmax(rows, vocab, dtype, levels, seed, masked):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(-levels, levels, (rows, vocab), generator=generator).to(dtype) / 7
    if masked:
        logits[logits < 0] = -float("inf")
    assert torch.equal(torch.ops.liteinfer.argmax(logits), logits.float().argmax(-1))


def test_argmax_of_a_vocab_sized_row_and_of_infinities():
    logits = torch.randn(3, 49152, dtype=torch.bfloat16)
    logits[1, 40000] = 100.0
    logits[2] = -float("inf")  # a row with nothing allowed answers its first index, as torch.argmax does
    expected = logits.float().argmax(-1)
    assert torch.ops.liteinfer.argmax(logits).tolist() == expected.tolist() == [expected[0].item(), 40000, 0]


def test_argmax_rows_uses_the_kernel_on_cpu():
    logits = torch.randn(2, 1000)
    with torch.profiler.profile() as profile:
        tokens = argmax_rows(logits)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert "liteinfer::argmax" in {event.key for event in profile.key_averages()}
    half = logits.half()  # a dtype the kernel does not take: torch's argmax
    assert argmax_rows(half).tolist() == half.argmax(-1).tolist()


def test_argmax_refuses_what_it_cannot_take():
    with pytest.raises(RuntimeError, match="expected logits"):
        torch.ops.liteinfer.argmax(torch.randn(5))
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        torch.ops.liteinfer.argmax(torch.randn(2, 5, dtype=torch.float64))
