"""The attention kernels (liteinfer/kernels: ours in C++ on CPU, and the Triton decode kernel for CUDA, run on a GPU
where there is one, else through Triton's interpreter) against the PyTorch paths they replace: the same attention
over a gathered copy of each sequence's blocks (decodes) or through SDPA (prompts), on random pools, block tables and
positions."""

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from conftest import head_major, torch_threads
from hypothesis import given, settings
from hypothesis import strategies as st

from liteinfer import kernels
from liteinfer.cache import KVCache
from liteinfer.layers import AttentionMetadata, PagedAttention, PrefillSpan

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = st.sampled_from(list(TOLERANCE))
KV_HEADS, GROUPS = st.integers(1, 3), st.integers(1, 6)  # group: query heads per KV head (5, 6: past the 4 of
# 64-wide heads whose sums the AVX-512 decode kernel keeps in registers at once; AVX2's passes of 3 heads: 3 + 2, 3 + 3)


# Asked when a test that needs them runs, not at import: collecting this file for its Triton tests alone (as the GPU
# run does) must not build the C++ kernels.
@pytest.fixture(scope="module")
def int8_kernels():
    if not (kernels.load() and kernels.int8_pools_available()):
        pytest.skip("the kernels read int8 pools on CPUs with AVX-512 VNNI only")


@pytest.fixture(scope="module")
def prompt_kernel():
    if not (kernels.load() and kernels.prefill_available()):
        pytest.skip("the prompt kernel is built for AVX-512 CPUs only")


needs_int8_kernels = pytest.mark.usefixtures("int8_kernels")
needs_prompt_kernel = pytest.mark.usefixtures("prompt_kernel")


# The Triton decode kernel's tests run it on CUDA where there is a GPU, else through Triton's interpreter on CPU
# tensors (conftest.py switches it on).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_kernel_builds_here():
    # The suite must exercise the kernel, not pass on the fallback because the build broke.
    assert kernels.load()
    assert kernels.available()


def make_case(data, dtype, kv_heads, group, dim, block_size, window, softcap):
    attn = PagedAttention(kv_heads * group, kv_heads, dim, dim**-0.5, sliding_window=window, logit_softcap=softcap)
    num_blocks = 24
    attn.k_cache = torch.randn(num_blocks, kv_heads, block_size, dim).to(dtype)
    attn.v_cache = torch.randn(num_blocks, kv_heads, block_size, dim).to(dtype)
    num_seqs = data.draw(st.integers(1, 5), label="seqs")
    width = data.draw(st.integers(1, num_blocks // num_seqs), label="table width")
    # Each sequence owns distinct blocks, in random order across the pool; a position may fall anywhere in its table.
    tables = torch.randperm(num_blocks)[: num_seqs * width].view(num_seqs, width)
    positions = torch.tensor([data.draw(st.integers(0, width * block_size - 1)) for _ in range(num_seqs)])
    q = torch.randn(num_seqs, kv_heads * group, dim).to(dtype)
    return attn, q, tables, positions


# The decode kernels' cases (make_case's arguments). Head size 40: the C++ kernel's run-time size, with a tail shorter
# than a vector; the Triton kernel's padded to 64 lanes, the rest masked.
DECODE_CASES = dict(data=st.data(), dtype=DTYPES, kv_heads=KV_HEADS, group=GROUPS, dim=st.sampled_from([64, 128, 40]),
                    block_size=st.sampled_from([1, 4, 16, 32]), window=st.one_of(st.none(), st.integers(1, 20)),
                    softcap=st.one_of(st.none(), st.floats(5.0, 50.0)))


# threads: the C++ kernel splits its tasks into one run per thread, by their keys.
@settings(max_examples=60, deadline=None)
@given(**DECODE_CASES, threads=st.integers(1, 4))
def test_kernel_matches_attention_over_gathered_blocks(data, dtype, kv_heads, group, dim, block_size, window, softcap,
                                                       threads):
    assert kernels.load()
    attn, q, tables, positions = make_case(data, dtype, kv_heads, group, dim, block_size, window, softcap)

    with torch_threads(threads):
        out = attn._attend_decodes(q, tables, positions)  # the kernel, on CPU
    keys, values = attn._gather(tables, dtype)
    expected = attn._attend_gathered_decodes(q, keys, values, positions)

    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@settings(max_examples=30, deadline=None)
@given(**DECODE_CASES)
def test_kernels_give_the_same_bits_over_head_major_pools(data, dtype, kv_heads, group, dim, block_size, window,
                                                          softcap):
    """Both kernels (the prompt one where it is built, for its head sizes) read a pool's runs where its strides put
    them: the same pools laid out head-major give the same outputs to the bit."""
    assert kernels.load()
    attn, q, tables, positions = make_case(data, dtype, kv_heads, group, dim, block_size, window, softcap)
    runs = []
    if kernels.prefill_available() and dim in (64, 128) and softcap is None and block_size >= 4:
        # (four spans of up to 24 tokens within make_case's 24 blocks)
        meta = prompt_spans(data, block_size, num_blocks=len(attn.k_cache), max_new=8, max_context=16)
        prompt_q = torch.randn(len(meta.positions), kv_heads * group, dim).to(dtype)
        runs.append(lambda: attn._attend_prefills(prompt_q, meta))
    runs.append(lambda: attn._attend_decodes(q, tables, positions))
    outputs = []
    for lay_out in (torch.clone, head_major):
        attn.k_cache, attn.v_cache = lay_out(attn.k_cache), lay_out(attn.v_cache)
        outputs.append([run() for run in runs])
    assert not attn.k_cache.is_contiguous() or kv_heads == 1
    for block_major_out, head_major_out in zip(*outputs, strict=True):
        assert torch.equal(head_major_out, block_major_out)


def triton_paged_decode_attention(attn: PagedAttention, q, tables, positions) -> torch.Tensor:
    """The Triton kernel on the layer's pools and these queries, run on TRITON_DEVICE, the result back on CPU."""
    from liteinfer.kernels.triton_attention import paged_decode_attention

    k_cache, v_cache, q, tables, positions = (t.to(TRITON_DEVICE) for t in (attn.k_cache, attn.v_cache, q, tables,
                                                                            positions))
    return paged_decode_attention(q, k_cache, v_cache, tables, positions, attn.scale, attn.sliding_window or 0,
                                  attn.logit_softcap or 0.0).cpu()


@settings(max_examples=25, deadline=None)
@given(**DECODE_CASES)
def test_triton_kernel_matches_attention_over_gathered_blocks(data, dtype, kv_heads, group, dim, block_size, window,
                                                              softcap):
    attn, q, tables, positions = make_case(data, dtype, kv_heads, group, dim, block_size, window, softcap)

    out = triton_paged_decode_attention(attn, q, tables, positions)
    keys, values = attn._gather(tables, dtype)
    expected = attn._attend_gathered_decodes(q, keys, values, positions)

    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.flatten(1).float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# Compiles the kernels for the lent GPU (an H200: sm_90) in each dtype, in the shapes of SmolLM2 (groups of 3, heads
# of 64), an 8B Llama (groups of 4... 8, heads of 128) and a padded one (head size 96; decodes in blocks of one key).
COMPILE_FOR_HOPPER = """
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from liteinfer.kernels.triton_attention import PREFILL_TILE_ROWS, _paged_decode_kernel, _paged_prefill_kernel

def compiles(kernel, dtype, constants):
    kinds = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
             "tables_ptr": "*i64", "positions_ptr": "*i64", "starts_ptr": "*i64"}
    # Python floats reach a kernel as fp32 from Triton's launcher, as fp64 from a graph that inductor compiled.
    kinds |= dict.fromkeys(["scale", "softcap"], "fp64" if dtype == "bf16" else "fp32")
    signature = {name: "constexpr" if name in constants else kinds.get(name, "i32") for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
    return len(compiled.asm["cubin"]) > 0

shapes = [(3, 64, 16, False), (8, 128, 16, True), (1, 96, 1, True)]  # group, head size, block size, window and cap
for dtype, (group, dim, block_size, flags) in itertools.product(["fp32", "bf16", "fp16"], shapes):
    constants = dict(GROUP=group, GROUP_P2=triton.next_power_of_2(group), DIM=dim, DIM_P2=triton.next_power_of_2(dim),
                     BLOCK_SIZE=block_size, SOFTCAP=flags, WINDOW=flags)
    print("decode", dtype, group, dim, block_size, compiles(_paged_decode_kernel, dtype, constants))
    constants |= dict(BLOCK_SIZE=max(block_size, 16), TOKENS=max(1, PREFILL_TILE_ROWS // constants["GROUP_P2"]),
                      PRECISION="ieee" if dtype == "fp32" else "tf32")
    print("prompt", dtype, group, dim, constants["BLOCK_SIZE"], compiles(_paged_prefill_kernel, dtype, constants))
"""


def test_triton_kernels_compile_for_the_gpu():
    """The interpreter runs the kernels' Python, not Triton's compiler: compile them down to machine code for Hopper
    (Triton carries its own ptxas; no GPU needed), in a process of its own, since the compiler needs Triton imported
    without the interpreter."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 18 and all(line.endswith("True") for line in lines), result.stdout


def test_triton_kernel_reads_no_slot_its_queries_may_not_see():
    """Every slot a query may not see holds NaN (the padding block 0, rows past each position, rows before the
    window), so one read of them would show in the output: the kernel must skip or mask them all."""
    torch.manual_seed(0)
    attn = PagedAttention(6, 2, 64, 0.125, sliding_window=20)
    attn.k_cache = torch.full((12, 2, 8, 64), float("nan"))
    attn.v_cache = attn.k_cache.clone()
    tables = torch.tensor([[3, 7, 1, 0, 0], [5, 0, 0, 0, 0], [2, 4, 6, 8, 11]])  # 0: padding
    positions = torch.tensor([22, 3, 37])
    for table, position in zip(tables, positions):
        for key in range(max(0, position - 19), position + 1):  # the window's keys
            attn.k_cache[table[key // 8], :, key % 8] = torch.randn(2, 64)
            attn.v_cache[table[key // 8], :, key % 8] = torch.randn(2, 64)
    q = torch.randn(3, 6, 64)

    out = triton_paged_decode_attention(attn, q, tables, positions)
    keys, values = attn._gather(tables, q.dtype)
    expected = attn._attend_gathered_decodes(q, keys.nan_to_num(), values.nan_to_num(), positions)

    assert not out.isnan().any()
    torch.testing.assert_close(out.flatten(1), expected, atol=2e-5, rtol=2e-5)


def prefill_step(tables: list[list[int]], lengths, contexts) -> AttentionMetadata:
    """A step of spans, span i computing lengths[i] new tokens on top of contexts[i] cached ones, on blocks tables[i];
    the K/V are in the pools already."""
    spans, positions, row = [], [], 0
    for table, length, context in zip(tables, lengths, contexts, strict=True):
        spans.append(PrefillSpan(row, row + length, table, context + length))
        positions += range(context, context + length)
        row += length
    no_slots = torch.zeros(row, dtype=torch.long)
    return AttentionMetadata(slot_blocks=no_slots, slot_offsets=no_slots, positions=torch.tensor(positions),
                             decode_block_tables=torch.zeros(0, 1, dtype=torch.long), prefills=spans)


def prompt_spans(data, block_size: int, num_blocks: int, max_new: int = 40, max_context: int = 50) -> AttentionMetadata:
    """A step of 1-4 spans of 1-`max_new` new tokens on top of 0-`max_context` cached ones (prefix hits, chunked
    prefill), each on its own blocks drawn from the pools' `num_blocks`."""
    free = torch.randperm(num_blocks).tolist()
    tables, lengths, contexts = [], [], []
    for _ in range(data.draw(st.integers(1, 4), label="spans")):
        contexts.append(data.draw(st.integers(0, max_context), label="context"))
        lengths.append(data.draw(st.integers(1, max_new), label="new"))
        tables.append([free.pop() for _ in range(-(-(contexts[-1] + lengths[-1]) // block_size))])
    return prefill_step(tables, lengths, contexts)


@settings(max_examples=25, deadline=None)
@given(**DECODE_CASES | dict(block_size=st.sampled_from([16, 32])))
def test_triton_prompt_kernel_matches_sdpa_per_span(data, dtype, kv_heads, group, dim, block_size, window, softcap):
    """Spans of up to 80 new tokens (several tiles of rows where groups are small), every slot that no query may see
    holding NaN (past each span's keys, and the blocks no span holds): one read of them would show."""
    attn = PagedAttention(kv_heads * group, kv_heads, dim, dim**-0.5, sliding_window=window, logit_softcap=softcap)
    num_blocks = 4 * -(-130 // block_size)
    attn.k_cache = torch.randn(num_blocks, kv_heads, block_size, dim).to(dtype)
    attn.v_cache = torch.randn(num_blocks, kv_heads, block_size, dim).to(dtype)
    meta = prompt_spans(data, block_size, num_blocks, max_new=80)
    q = torch.randn(len(meta.positions), kv_heads * group, dim).to(dtype)
    with mock.patch.object(kernels, "prefill_available", return_value=False):
        expected = attn._attend_prefills(q, meta)  # SDPA, one span at a time
    seen = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for span in meta.prefills:
        keys = torch.arange(span.num_keys)
        seen[torch.tensor(span.block_table)[keys // block_size], keys % block_size] = True
    for pool in (attn.k_cache, attn.v_cache):
        pool.transpose(1, 2)[~seen] = float("nan")

    from liteinfer.kernels.triton_attention import paged_prefill_attention

    starts, tables = meta.prefill_spans
    k_cache, v_cache, q, tables, starts, positions = (
        t.to(TRITON_DEVICE) for t in (attn.k_cache, attn.v_cache, q, tables, starts, meta.positions))
    out = paged_prefill_attention(q, k_cache, v_cache, tables, starts, positions, attn.scale,
                                  meta.longest_prefill, window or 0, softcap or 0.0)

    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.cpu().flatten(1).float(), expected.float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@needs_prompt_kernel
@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    dtype=DTYPES,
    kv_heads=KV_HEADS,
    group=GROUPS,
    dim=st.sampled_from([64, 128]),
    block_size=st.sampled_from([1, 4, 16, 32]),
    window=st.one_of(st.none(), st.integers(1, 40)),
)
def test_prompt_kernel_matches_sdpa_per_span(data, dtype, kv_heads, group, dim, block_size, window):
    """Spans of 1-40 new tokens on top of 0-50 cached ones (prefix hits, chunked prefill), several per call."""
    attn = PagedAttention(kv_heads * group, kv_heads, dim, dim**-0.5, sliding_window=window)
    num_blocks = 4 * -(-90 // block_size)  # room for four spans of up to 90 tokens
    attn.k_cache = torch.randn(num_blocks, kv_heads, block_size, dim).to(dtype)
    attn.v_cache = torch.randn(num_blocks, kv_heads, block_size, dim).to(dtype)
    meta = prompt_spans(data, block_size, num_blocks)
    q = torch.randn(len(meta.positions), kv_heads * group, dim).to(dtype)

    out = attn._attend_prefills(q, meta)  # the kernel, on CPU
    with mock.patch.object(kernels, "prefill_available", return_value=False):
        expected = attn._attend_prefills(q, meta)  # SDPA, one span at a time

    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_prompt_kernel
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("window", [None, 100])
def test_prompt_kernel_matches_sdpa_over_long_spans(dim, window):
    """Spans of hundreds of keys in bf16: the online softmax over many steps (16-key panels, or 64-key steps in AMX
    tiles), the running maxima rising along them, and tasks of 16 rows past a span's first."""
    torch.manual_seed(0)
    attn = PagedAttention(9, 3, dim, dim**-0.5, sliding_window=window)
    attn.k_cache = torch.randn(64, 3, 16, dim).bfloat16()
    attn.v_cache = torch.randn(64, 3, 16, dim).bfloat16()
    attn.k_cache[..., 0] *= torch.linspace(1, 8, 64)[:, None, None]  # later keys' scores grow: maxima move late
    tables = torch.randperm(64).view(2, 32).tolist()
    meta = prefill_step(tables, lengths=(300, 37), contexts=(0, 450))  # a whole prompt; a chunk after a context
    q = torch.randn(len(meta.positions), 9, dim).bfloat16()

    out = attn._attend_prefills(q, meta)  # the kernel, on CPU
    with mock.patch.object(kernels, "prefill_available", return_value=False):
        expected = attn._attend_prefills(q, meta)  # SDPA, one span at a time

    tolerance = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_kernel_refuses_mismatched_inputs():
    assert kernels.load()
    pool = torch.zeros(4, 2, 4, 8)  # [blocks, kv_heads, block_size, dim]
    tables, positions = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    op = torch.ops.liteinfer.paged_decode_attention
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(torch.zeros(1, 2, 8, dtype=torch.bfloat16), pool, pool, tables, positions, 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="head size or head count"):
        op(torch.zeros(1, 3, 8), pool, pool, tables, positions, 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="one block table and one position per query"):
        op(torch.zeros(2, 2, 8), pool, pool, tables, positions, 1.0, 0, 0.0)


@needs_prompt_kernel
def test_prompt_kernel_refuses_mismatched_inputs():
    tables = torch.zeros(1, 1, dtype=torch.long)
    prompt = torch.ops.liteinfer.paged_prefill_attention
    pool = torch.zeros(4, 2, 4, 64)
    with pytest.raises(RuntimeError, match="cover q's rows"):
        prompt(torch.zeros(3, 2, 64), pool, pool, tables, torch.tensor([0, 2]), torch.arange(3), 1.0, 0)
    with pytest.raises(RuntimeError, match="at least one query row"):
        prompt(torch.zeros(0, 2, 64), pool, pool, tables, torch.tensor([0, 0]), torch.arange(0), 1.0, 0)
    with pytest.raises(RuntimeError, match="head sizes 64 and 128"):
        prompt(torch.zeros(2, 2, 8), torch.zeros(4, 2, 4, 8), torch.zeros(4, 2, 4, 8), tables, torch.tensor([0, 2]),
               torch.arange(2), 1.0, 0)


def test_engine_gives_the_same_tokens_on_the_fallback_path(tiny_llama_dir, monkeypatch):
    """Where the kernel cannot be built, attention takes the gathered-copy path: the engine's greedy tokens do not
    change (several sequences decoding together, contexts spanning several blocks)."""
    from liteinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + i, 100 + i + 5 * (i + 1)))} for i in range(4)]
    engine = dict(dtype="float32", num_kv_blocks=64, block_size=8, max_model_len=256)

    def generate():
        return [o.outputs[0].token_ids for o in LLM(str(tiny_llama_dir), **engine).generate(prompts, params)]

    assert kernels.load()
    with_kernel = generate()
    monkeypatch.setattr(kernels, "_loaded", False)  # as load() leaves it after a failed build
    assert not kernels.available()
    assert generate() == with_kernel


@needs_prompt_kernel
@pytest.mark.parametrize(("dtype", "context"), [(torch.float32, 1022), (torch.float32, 2500), (torch.bfloat16, 2500)])
def test_prompt_kernel_takes_spans_of_any_length(dtype, context):
    """The kernel is faster than SDPA at every length measured (up to 8,192 keys, fp32 and bf16), so long spans take
    it too, with the same result."""
    attn = PagedAttention(4, 2, 64, 0.125)
    num_blocks = (context + 2) // 16 + 1
    attn.k_cache = torch.randn(num_blocks, 2, 16, 64).to(dtype)
    attn.v_cache = torch.randn(num_blocks, 2, 16, 64).to(dtype)
    no_slots = torch.zeros(2, dtype=torch.long)  # the K/V are in the pools already
    meta = AttentionMetadata(
        slot_blocks=no_slots, slot_offsets=no_slots, positions=torch.arange(context, context + 2),
        decode_block_tables=torch.zeros(0, 1, dtype=torch.long),
        prefills=[PrefillSpan(0, 2, list(range(num_blocks)), context + 2)],
    )
    q = torch.randn(2, 4, 64).to(dtype)
    with torch.profiler.profile() as profile:
        out = attn._attend_prefills(q, meta)
    called = "liteinfer::paged_prefill_attention" in {event.key for event in profile.key_averages()}
    assert called
    with mock.patch.object(kernels, "prefill_available", return_value=False):
        expected = attn._attend_prefills(q, meta)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_prompt_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_kernel_gives_the_same_bits_on_any_number_of_threads(dtype):
    """The threads take runs of tasks of about equal work (a long span's later rows see more keys, so its tasks are
    not equal): however they are split, every task runs once and alone computes its rows."""
    torch.manual_seed(0)
    attn = PagedAttention(6, 2, 64, 0.125)
    attn.k_cache = torch.randn(80, 2, 16, 64).to(dtype)
    attn.v_cache = torch.randn(80, 2, 16, 64).to(dtype)
    tables = torch.randperm(80).view(4, 20).tolist()
    meta = prefill_step(tables, lengths=(300, 5, 70, 17), contexts=(0, 200, 40, 300))
    q = torch.randn(len(meta.positions), 6, 64).to(dtype)
    outputs = []
    for n in (1, 2, 3, 7):
        with torch_threads(n):
            outputs.append(attn._attend_prefills(q, meta))
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])
    with mock.patch.object(kernels, "prefill_available", return_value=False):
        expected = attn._attend_prefills(q, meta)
    torch.testing.assert_close(outputs[0], expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_gathering_blocks_copies_those_blocks_only():
    """The fallback paths (CUDA decodes, prompts where the prompt kernel is not built) gather a sequence's blocks:
    selecting them from the pool viewed heads-first made PyTorch copy the whole pool every call (a 37 s prefill of
    32 short prompts on an AVX2 CPU). The gather allocates what it returns and little more."""
    attn = PagedAttention(4, 2, 64, 0.125)
    attn.k_cache, attn.v_cache = torch.randn(4096, 2, 16, 64), torch.randn(4096, 2, 16, 64)  # 32 MiB each
    tables = torch.tensor([[7, 4000], [12, 3]])
    with torch.profiler.profile(profile_memory=True) as profile:
        keys, values = attn._gather(tables, torch.float32)
    allocated = sum(max(event.cpu_memory_usage, 0) for event in profile.events())
    assert allocated < attn.k_cache.nbytes / 16  # ~10x what it returns, counted op by op; the pool is 512x
    for pool, gathered in ((attn.k_cache, keys), (attn.v_cache, values)):
        assert gathered.shape == (2, 2, 32, 64)  # [kv_heads, seqs, blocks * block_size, dim]
        for s, row in enumerate(tables.tolist()):
            expected = torch.cat([pool[block] for block in row], dim=1)  # [kv_heads, 32, dim]
            assert torch.equal(gathered[:, s], expected)


def int8_layer(kv_heads, group, dim, block_size, num_blocks, window=None, softcap=None) -> PagedAttention:
    """A layer bound to int8 pools whose every row was written through the layer (random K/V, one key channel
    eight times the others, as real keys have outliers)."""
    attn = PagedAttention(kv_heads * group, kv_heads, dim, dim**-0.5, sliding_window=window, logit_softcap=softcap)
    KVCache(1, num_blocks, block_size, kv_heads, dim, torch.float32, torch.device("cpu"), int8=True).bind(attn)
    slots = torch.arange(num_blocks * block_size)
    meta = AttentionMetadata(slot_blocks=slots // block_size, slot_offsets=slots % block_size, positions=slots,
                             decode_block_tables=torch.zeros(0, 1, dtype=torch.long), prefills=[])
    k, v = torch.randn(len(slots), kv_heads, dim), torch.randn(len(slots), kv_heads, dim)
    k[..., 3] *= 8
    attn._write_int8(k, v, meta)
    return attn, k, v


def test_int8_pools_hold_each_row_within_half_a_level():
    """The write and `_gather`'s dequantization agree on the layout: every element of every row comes back within
    half of its row's step (largest |element| / 127), K and V alike."""
    attn, k, v = int8_layer(kv_heads=2, group=1, dim=64, block_size=16, num_blocks=5)
    keys, values = attn._gather(torch.arange(5)[None], torch.float32)  # [kv_heads, 1, 80, dim]
    for written, read in ((k, keys), (v, values)):
        step = written.abs().amax(-1, keepdim=True) / 127
        error = (read[:, 0].transpose(0, 1) - written).abs()
        assert (error <= step / 2 * (1 + 1e-5)).all()
        assert error.max() > 0  # the rows were rounded, not stored whole


# The decode kernel rounds each query head to int8 levels and each head's softmax weights (times the V scales) to
# uint8 levels, where the gathered path computes over the same dequantized pools in fp32. On these random rows the
# outputs lie within ~0.02 of it (measured over the examples; outputs ~0.1-1); a misread scale or layout is off by
# the outputs' own size.
INT8_DECODE_TOLERANCE = 5e-2
# What both int8 kernel tests draw: the kernels take int8 pools for heads of 64 and 128.
INT8_CASES = dict(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), kv_heads=KV_HEADS,
                  group=GROUPS, dim=st.sampled_from([64, 128]), window=st.one_of(st.none(), st.integers(1, 40)))


@needs_int8_kernels
@settings(max_examples=40, deadline=None)
@given(**INT8_CASES, block_size=st.sampled_from([16, 32, 64]), softcap=st.one_of(st.none(), st.floats(5.0, 50.0)),
       threads=st.integers(1, 4))
def test_decode_kernel_reads_int8_pools_as_the_gathered_path(data, dtype, kv_heads, group, dim, block_size, window,
                                                             softcap, threads):
    num_blocks = 12
    attn, _, _ = int8_layer(kv_heads, group, dim, block_size, num_blocks, window, softcap)
    num_seqs = data.draw(st.integers(1, 4), label="seqs")
    width = data.draw(st.integers(1, num_blocks // num_seqs), label="table width")
    tables = torch.randperm(num_blocks)[: num_seqs * width].view(num_seqs, width)
    positions = torch.tensor([data.draw(st.integers(0, width * block_size - 1)) for _ in range(num_seqs)])
    q = torch.randn(num_seqs, kv_heads * group, dim).to(dtype)

    with torch_threads(threads):
        out = attn._attend_decodes(q, tables, positions)  # the kernel
    keys, values = attn._gather(tables, torch.float32)
    expected = attn._attend_gathered_decodes(q.float(), keys, values, positions)

    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=INT8_DECODE_TOLERANCE, rtol=0)


@needs_int8_kernels
@settings(max_examples=30, deadline=None)
@given(**INT8_CASES)
def test_prompt_kernel_reads_int8_pools_as_sdpa_over_the_gathered_rows(data, dtype, kv_heads, group, dim, window):
    """The prompt kernel dequantizes the rows it lays out as `_gather` does, so only the arithmetic differs."""
    attn, _, _ = int8_layer(kv_heads, group, dim, block_size=16, num_blocks=24, window=window)
    meta = prompt_spans(data, 16, 24)
    q = torch.randn(len(meta.positions), kv_heads * group, dim).to(dtype)

    out = attn._attend_prefills(q, meta)
    with mock.patch.object(kernels, "prefill_available", return_value=False):
        expected = attn._attend_prefills(q, meta)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_int8_kernels
def test_kernels_refuse_int8_pools_laid_out_otherwise():
    attn, _, _ = int8_layer(kv_heads=2, group=2, dim=64, block_size=16, num_blocks=2)
    q, tables, positions = torch.zeros(1, 4, 64), torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    op = torch.ops.liteinfer.paged_decode_attention
    k, v, ks, vs = attn.k_cache, attn.v_cache, attn.k_scales, attn.v_scales
    with pytest.raises(RuntimeError, match="both pools' scales or neither"):
        op(q, k, v, tables, positions, 1.0, 0, 0.0, ks, None)
    with pytest.raises(RuntimeError, match=r"int8 K pool is \[blocks, kv_heads, dim / 4, block_size, 4\]"):
        op(q, k.view(2, 2, 16, 64), v, tables, positions, 1.0, 0, 0.0, ks, vs)  # K rows whole: the bf16 pools' layout
    with pytest.raises(RuntimeError, match=r"int8 V pool is \[blocks, kv_heads, block_size / 4, dim, 4\]"):
        op(q, k, v.view(2, 2, 16, 64), tables, positions, 1.0, 0, 0.0, ks, vs)
    with pytest.raises(RuntimeError, match="K as uint8 and V as int8"):
        op(q, k.view(torch.int8), v, tables, positions, 1.0, 0, 0.0, ks, vs)
    with pytest.raises(RuntimeError, match="scales must be fp32"):
        op(q, k, v, tables, positions, 1.0, 0, 0.0, ks.double(), vs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_write_op_fills_the_pools_as_the_pytorch_write(dtype):
    """Our one-pass write and the PyTorch ops it stands in for (where the kernels are not built) store the same
    scales and the same levels, an all-zero row included, but where x * (127 / largest) falls a rounding step from
    .5: PyTorch computes 127 / largest as 127 * (1 / largest), another rounding (1 of 5,120 elements here)."""
    assert kernels.load()
    torch.manual_seed(0)
    k, v = torch.randn(40, 2, 64).to(dtype), torch.randn(40, 2, 64).to(dtype)
    k[7] = 0
    slots = torch.randperm(3 * 16)[:40]
    meta = AttentionMetadata(slot_blocks=slots // 16, slot_offsets=slots % 16, positions=slots,
                             decode_block_tables=torch.zeros(0, 1, dtype=torch.long), prefills=[])
    pools = []
    for pointwise in (True, False):
        attn = PagedAttention(4, 2, 64, 0.125)
        KVCache(1, 3, 16, 2, 64, dtype, torch.device("cpu"), int8=True).bind(attn)
        with mock.patch.object(kernels, "pointwise_takes", return_value=pointwise):
            attn._write_int8(k, v, meta)
        pools.append((attn.k_cache, attn.v_cache, attn.k_scales, attn.v_scales))
    (k_ours, v_ours, *scales_ours), (k_theirs, v_theirs, *scales_theirs) = pools
    for ours, theirs in ((k_ours, k_theirs), (v_ours, v_theirs)):
        levels_apart = (ours.int() - theirs.int()).abs()
        assert levels_apart.max() <= 1 and levels_apart.sum() <= ours.numel() // 1000
    for ours, theirs in zip(scales_ours, scales_theirs):
        assert torch.equal(ours, theirs)
