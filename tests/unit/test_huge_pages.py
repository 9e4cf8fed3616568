"""liteinfer/huge_pages.py: memory on 2 MiB boundaries advised onto huge pages, and weights moved there in place."""

import re
import sys
from pathlib import Path

import pytest
import torch

from liteinfer import LLM, huge_pages
from liteinfer.engine.workers import model_tensors

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps: Linux")


def advised(tensor: torch.Tensor) -> bool:
    """Whether the tensor's first byte lies in a mapping advised MADV_HUGEPAGE (flag `hg` in /proc/self/smaps).
    Whether the kernel then found free huge pages is its business; the advice is ours."""
    address, mapping = tensor.data_ptr(), None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if found := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            mapping = (int(found[1], 16), int(found[2], 16))
        elif line.startswith("VmFlags:") and mapping[0] <= address < mapping[1]:
            return "hg" in line.split()[1:]
    return False


def test_empty_starts_on_a_huge_page():
    region = huge_pages.empty(3 * huge_pages.HUGE_PAGE + 5)
    assert region.dtype == torch.uint8 and region.numel() == 3 * huge_pages.HUGE_PAGE + 5
    assert region.data_ptr() % huge_pages.HUGE_PAGE == 0
    region.fill_(1)  # all of it is ours to write


@linux_only
def test_empty_is_advised_onto_huge_pages_from_one_page_up():
    assert advised(huge_pages.empty(huge_pages.HUGE_PAGE))
    assert huge_pages.empty(1000).numel() == 1000  # not worth a huge page: a plain tensor


@pytest.mark.parametrize("shape", [(64, 3, 16, 512), (5, 3, 16, 8)])  # 3 MiB: on huge pages; 3.75 KiB: plain
def test_zeros_has_the_shape_and_dtype_asked_for(shape):
    pool = huge_pages.zeros(shape, torch.bfloat16)
    assert pool.shape == shape and pool.dtype == torch.bfloat16 and pool.is_contiguous() and not pool.any()
    assert (pool.data_ptr() % huge_pages.HUGE_PAGE == 0) == (pool.nbytes >= huge_pages.HUGE_PAGE)


def test_move_keeps_values_objects_and_sharing():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(1024, 640), requires_grad=False)  # 2.5 MiB: worth a huge page
    rows = weight.data[8:24]  # a view: must stay one
    levels = torch.randint(-127, 128, (33, 7), dtype=torch.int8)  # an odd size: the next tensor must stay aligned
    scales = torch.randn(33, dtype=torch.bfloat16)
    before = [t.clone() for t in (weight, rows, levels, scales)]

    moved = huge_pages.move([weight, rows, levels, scales, weight])  # weight twice: a parameter two modules share

    assert moved >= weight.nbytes + levels.nbytes + scales.nbytes
    for tensor, value in zip((weight, rows, levels, scales), before):
        assert torch.equal(tensor, value)
    storage = weight.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in (rows, levels, scales))  # one region
    assert all(t.data_ptr() % 8 == 0 for t in (weight, rows, levels, scales))
    weight.data[8, 0] = 7.0  # the view still sees its base
    assert rows[0, 0] == 7.0
    small = torch.randn(8, 8)
    address = small.data_ptr()
    assert huge_pages.move([small]) == 0 and small.data_ptr() == address  # under a huge page: left alone


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN")
def test_move_leaves_opaque_tensors_where_they_are():
    opaque = torch.randn(16, 16).to_mkldnn()
    assert huge_pages.move([opaque]) == 0


@linux_only
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_engine_keeps_weights_and_kv_pool_on_huge_pages(tiny_llama_dir, quantization):
    llm = LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, quantization=quantization,
              max_model_len=64, max_num_seqs=2, num_kv_blocks=2048)  # pools of 2 MiB and more
    engine = llm.engine
    # (the eager engine's oneDNN-packed float weights, opaque, stay where oneDNN put them)
    tensors = {t.data_ptr(): t for t in model_tensors(engine.runner.model) if not t.is_mkldnn}.values()
    assert len(tensors) > 5 and len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one region
    # All on huge pages but the region's tail past its last whole huge page (advised pages only: see `empty`).
    total = sum(t.nbytes for t in tensors)
    assert sum(t.nbytes for t in tensors if advised(t)) > total - huge_pages.HUGE_PAGE
    pools = engine.kv_cache.k + engine.kv_cache.v
    assert pools[0].nbytes >= huge_pages.HUGE_PAGE and all(advised(pool) for pool in pools)
