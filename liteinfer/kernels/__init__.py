"""Kernels of our own, in C++, for what PyTorch has no fast op for on CPU: decode attention that reads the paged KV pool
in place, float linears on weights packed for them, the matmul of int8 and int4 weights (at any number of rows) and the
one-row matmul of float ones, the greedy argmax of a step's logits (and the tokens that can hold it, from the head
multiplied in bytes), a sampled token per row of logits, and a decoder layer's per-token operations (RMSNorm, rotary,
gated activation, the K/V cache write) in one pass each for the steps that run eagerly (the gated activation in
compiled graphs too). Two kernels are for CUDA, in Triton: decode and prompt attention over the paged pool
(`triton_attention.py`, the contracts of `paged_decode_attention` and `paged_prefill_attention` below for plain pools,
the prompt one for blocks of 16 keys or more, with soft-capping, and the most tokens a span holds given; imported by
the attention layer where Triton is installed, not built by `load()`).

Contract: `load()` compiles the sources next to this file with the machine's C++ compiler (torch's extension
builder; the first time only, then cached under TORCH_EXTENSIONS_DIR, one build per CPU, Python and torch, since
the build targets the CPU that made it) and registers their ops under
`torch.ops.liteinfer`, each with a fake implementation so that `torch.compile` traces through it. Where they cannot
be built (no compiler), `load()` logs why and returns False, and callers keep the plain PyTorch path: the same
arithmetic, which tests/unit/test_paged_attention_kernel.py, test_gemv_kernel.py, test_packed_linear_kernel.py,
test_argmax_kernel.py, test_sample_kernel.py and test_pointwise_kernels.py hold the ops to.
`available()` only reports what `load()` did, so that a traced forward can ask without building anything.

The ops that read or write the K/V pools index them [blocks, kv_heads, ...], each block's rows for one KV head (a run)
contiguous, the runs laid out block-major (a contiguous pool) or head-major (a contiguous [kv_heads, blocks, ...]
tensor permuted to that indexing, as cache/kv_cache.py lays out the CPU's pools); a layer's pools and scales alike.

`paged_decode_attention(q [seqs, heads, dim], k_cache, v_cache [blocks, kv_heads, block_size, dim],
block_tables [seqs, width] int64, positions [seqs] int64, scale, sliding_window (0: none), softcap (0: none),
k_scales=None, v_scales=None)` -> [seqs, heads, dim]: each query attends to keys 0..its position (the last
`sliding_window` of them when set) of its sequence, read through its block table; grouped query heads share a KV
head; softmax in fp32. With bf16 pools on CPUs with AVX-512 BF16 the softmax weights are rounded to bf16 before
they multiply the values (as in the prompt kernel), the sums kept in fp32.

int8 pools (`kv_cache_dtype="int8"`, cache/kv_cache.py; both ops, on CPUs with AVX-512 VNNI:
`int8_pools_available()`; head sizes 64 and 128, blocks of a multiple of 16 keys) come with their rows' scales
`k_scales, v_scales [blocks, kv_heads, block_size]` fp32: key row r of a block is (k_cache[block, head, :, r, :] -
128) times its scale (K uint8 [blocks, kv_heads, dim / 4, block_size, 4]: four elements of a key side by side, a
block's keys after each other), and value row r is v_cache[block, head, r // 4, :, r % 4] times its scale (V int8
[blocks, kv_heads, block_size / 4, dim, 4]: four keys' elements side by side). The decode op then
also rounds each query head to int8 levels (its largest |element| / 127) and each head's softmax weights times the
keys' V scales to uint8 levels (their largest / 255), so that both passes multiply bytes.

`paged_prefill_attention(q [tokens, heads, dim], k_cache, v_cache, block_tables [spans, width] int64,
query_starts [spans + 1] int64, positions [tokens] int64, scale, sliding_window (0: none))` -> [tokens, heads, dim]:
span s is rows query_starts[s]..query_starts[s + 1] of q, each row attending to keys 0..its position of that span's
sequence (the last `sliding_window` when set), read through block_tables[s]; head sizes 64 and 128, no soft-capping;
built on AVX-512 CPUs only (`prefill_available()`); k_scales=None, v_scales=None as in the decode op (int8 pools'
rows dequantized to q's dtype). bf16 softmax weights are rounded to bf16 before they multiply the values, as in
PyTorch's flash attention; on CPUs with AMX, bf16 goes through its tiles (the same roundings, sums in fp32).

`packed_linear(x [rows, in], weight [out / 16, in / pair, 16, pair], bias [out] or None)` -> [rows, out] =
x W^T (+ bias), summed in fp32, in x's dtype (fp32: pair 1; bf16: pair 2), for W [out, in] packed by
`layers/linear.py: pack_weight` (16 outputs' weights for one input pair side by side); built on x86 CPUs with
AVX-512 BF16 (fp32 and bf16) or with AVX2 and FMA (bf16 only): `packed_linear_available(dtype)`. On CPUs with AMX
(`packed_linear_amx()`), bf16 with inputs in multiples of 32 is multiplied in AMX tiles, the sums still fp32 (the
tiles take subnormal bf16 inputs as zero). A row's result does not depend on the rows beside it. x must have at
least one input.

`packed_rows(weight [out / 16, in / pair, 16, pair], rows [n] int64)` -> [ceil(n / 16), in / pair, 16, pair]: W's
given output rows, packed as `pack_weight` packs them alone (zero rows after them to a multiple of 16). Built where
`packed_linear` is.

`packed_gated_linear(x [rows, in], weight [2, size / 16, in / pair, 16, pair], bias [2 * size] or None, act)` ->
[rows, size] = act(x G^T + b_g) * (x U^T + b_u), a gated MLP's gate/up matmul and its activation in one pass, for
W = [G; U] packed by `layers/linear.py: pack_gate_up` (each half as `pack_weight` packs it); act "silu" or
"gelu_tanh"; the same bits as `gated_activation(packed_linear(x, pack_weight(W), bias), act)`. Built where
`packed_linear` is.

`gemv(x [1, in], weight [out, in] contiguous, scales_and_zeros or None, bias [out] or None)` -> [1, out] =
x W^T (+ bias), summed in fp32, in x's dtype (fp32 or bf16): a float weight W is in x's dtype and takes no scales;
a quantized weight takes x [rows, in] (any number of rows: a row's result does not depend on the others). An int8
weight takes scales_and_zeros [out, 2, in / 32] fp16 holding each row's scales and then its zeros, one per group of
32 inputs, W being level * scale + zero (layers/quantization.py's int8); an int4 weight is [out, in / 2] uint8 in
`layers/quantization.py: gemv_int4_layout` (blocks of 64 inputs) and takes scales_and_zeros [out, 2, in / 32] in
x's dtype (a row's scales, then its zeros, one per group of 32 inputs), W being (level - 8) * scale + zero. On x86
CPUs with AVX2, int8 and int4 weights are multiplied in integers against x rounded to 16-bit levels per group of 64
inputs (each input off by at most half of its group's largest |x| / 32767). Batches of five rows or more meet them
otherwise: on CPUs with AMX in AMX tiles, bf16 x against the weights dequantized to bf16, fp32 x as three exact bf16
parts against the weights' levels, each group's sums scaled and offset in fp32 (to fp32's accuracy); on other CPUs
with AVX-512 BF16, where the output count is a multiple of 16, dequantized in the packed linears' tiles (on CPUs with
AVX2 alone: bf16 x, from sixteen rows). fp32 then meets the weights exactly and bf16 meets them rounded to bf16 (off
by at most half a bf16 step, as the bf16 model's own are), so that a row alone and the same row in such a batch can
differ by those roundings.
`gemv_quantized_form(dtype, rows, outputs)` -> "integer", "amx" or "dequantized" names the form a shape takes.

`argmax(logits [rows, vocab] fp32 or bf16)` -> [rows] int64: the first index of each row's largest value, as
`torch.argmax` gives it, except that NaN is skipped rather than taken as the largest.
`sample(logits [rows, vocab] fp32 or bf16, temperature [rows] fp32 (> 0), min_p [rows] fp32 in [0, 1], top_k [rows]
int64 (0 or the vocabulary's size or more: off), top_p [rows] fp32 in (0, 1], uniforms [rows] fp32 in [0, 1))` ->
[rows] int64: each row's token by inverse CDF of softmax(logits / temperature), truncated, at its uniform. The weights
e^((logit - max) / temperature) (under e^-87 taken as 0, so a -inf logit is never drawn); those under min_p zeroed,
then all but the top_k largest, then those outside the nucleus of what is left (its smallest set of largest weights
whose sum reaches top_p times their total), each keeping the ties of its last kept weight; then the first token
whose running sum passes uniform times their total (the last token of positive weight where rounding leaves the sum
short; index 0 for a row of -inf only): `liteinfer.sampling.sampler.draw_rows`, whose PyTorch form (`inverse_cdf`,
with `apply_min_p`, `apply_top_k`, `apply_top_p`) is the reference.
`head_screen(hidden [rows, in] fp32 or bf16, outlier_dims [D] int64 (D even), levels [tokens / 64, in / 4, 64, 4] int8,
level_scales [tokens] fp32, level_offsets [tokens] int32, outlier_weights [tokens / 64, D / 2, 64, 2] bf16, vocab_terms
[2, vocab] fp32, block_terms [2, blocks of 64 in vocab] fp32, logits [rows or more, tokens] fp32 (a workspace, 64-byte
aligned), relative, weight_rounding, largest_scale (the largest of level_scales[:vocab], > 0))` -> candidates [n] int64,
ascending, with logits[:rows] = approx [rows, tokens] (unwritten when it declines): layers/greedy_head.py's screen. Each
row x is rounded to levels l = round(x_R / s) + 128 (uint8; x_R is x with the outlier dims zeroed, s its largest
|element| / 127), and approx[r, j] = s * level_scales[j] * (sum_k l_k levels[j, k] - level_offsets[j]) + sum_d
bf16(x[outlier_dims[d]]) outlier_weights[j, d], where levels[j, k] is token j's level for input k (64 tokens' four
inputs side by side) and outlier_weights[j, d] W's value for that dim in bf16 (64 tokens' pairs of dims side by side),
off from W's own by at most weight_rounding |w_j| (0 for a bf16 W). A token j < vocab is a candidate of row r when
approx[r, j] + E(r, j) reaches max_k approx[r, k] - E(r, k), E = (1 + relative) e + relative |approx|, where e(r, j) =
alpha_r vocab_terms[0, j] + beta_r vocab_terms[1, j] + 1e-6 and alpha_r, beta_r the row's terms of greedy_head.py's
bound (from x's norms, computed in fp64); candidates is the union over the rows, empty when some value of hidden is not
finite or a row is so large that a logit could overflow (the l1 norm of its levels times its scale and of its outlier
dims, times 127 (1 + 2^-7) times largest_scale, reaching 2^126). block_terms holds each block's largest vocab_terms[0]
and vocab_terms[1] over its tokens j < vocab: the kernel reads only the blocks whose largest approx can reach a
candidate's end. Built on CPUs with AVX-512 VNNI and BF16 (`head_screen_available()`); at most 65,536 inputs.

The pointwise ops (fp32, bf16, fp16; `pointwise_takes(x)` says when the layers call them) compute in fp32 and round
to x's dtype wherever the PyTorch expressions in layers/norm.py, rotary.py and activation.py round:
`rms_norm(x [rows, size], weight [size], eps, gemma)` -> norm(x); `add_rms_norm(x, residual, weight, eps, gemma)`
-> (norm(x + residual), x + residual), where norm(v) = weight * (v / rms(v)), or v / rms(v) * (1 + weight) with
`gemma`; `rotary(q [tokens, heads, dim], k [tokens, kv_heads, dim], cos, sin [tokens, (1,) dim])` -> (q, k)
rotated "rotate half" style (each head's row contiguous, rows at any stride); `gated_activation(gate_up
[rows, 2 * size], act: "silu" or "gelu_tanh")` -> act(gate) * up, gate the first half of each row;
`write_kv(k, v [tokens, kv_heads, dim], k_cache, v_cache, slot_blocks, slot_offsets [tokens] int64)` copies each
token's K and V into row slot_offsets[t] of block slot_blocks[t] of the pools (in place; a slot outside the pool
is refused); `write_kv_int8(k, v, k_cache, v_cache, k_scales, v_scales, slot_blocks, slot_offsets)` the same
into int8 pools (the layout above), each row at its own scale, its largest |element| / 127 (levels
round(x * (127 / largest))).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_loaded: bool | None = None  # None until load() has run
_int8_pools = False  # what the build reports, kept here so that a traced forward can ask without calling an op


def load() -> bool:
    """Build (first time only) and register the ops; False, with a warning logged, where they cannot be built."""
    global _loaded, _int8_pools
    if _loaded is None:
        try:
            _build()
            _loaded = True
            _int8_pools = torch.ops.liteinfer.int8_pools_available()
        except Exception as exc:  # no compiler, or a broken tool chain: the PyTorch path still works
            logger.warning("liteinfer's CPU kernels could not be built, using the PyTorch path instead: %s", exc)
            _loaded = False
    return _loaded


def available() -> bool:
    return bool(_loaded)


def prefill_available() -> bool:
    """Prompt attention is built for AVX-512 CPUs only; elsewhere prompts keep PyTorch's SDPA."""
    return available() and hasattr(torch.ops.liteinfer, "paged_prefill_attention")


def int8_pools_available() -> bool:
    """Whether the attention ops read int8 pools (kv_cache_dtype="int8"): built for CPUs with AVX-512 VNNI."""
    return available() and _int8_pools


_POINTWISE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pointwise_takes(x: torch.Tensor, in_graphs: bool = False) -> bool:
    """Whether the pointwise ops serve a layer given x: a step on CPU, eager, or traced too where `in_graphs` (the
    gated activation, whose exp ours computes faster than inductor's kernel). Otherwise a traced graph keeps
    PyTorch's ops, which inductor fuses with their neighbours."""
    return (bool(_loaded) and x.is_cpu and x.dtype in _POINTWISE_DTYPES
            and (in_graphs or not torch.compiler.is_compiling()))


def head_screen_available() -> bool:
    """Whether the greedy head's screen is built here: CPUs with AVX-512 VNNI and BF16."""
    return available() and hasattr(torch.ops.liteinfer, "head_screen")


def packed_linear_available(dtype: torch.dtype) -> bool:
    """Whether the packed linear multiplies `dtype` here: fp32 and bf16 on CPUs with AVX-512 BF16, bf16 on CPUs with
    AVX2 and FMA (whose fp32 stays oneDNN's), nothing elsewhere (float weights stay oneDNN's or PyTorch's)."""
    return (available() and hasattr(torch.ops.liteinfer, "packed_linear")
            and torch.ops.liteinfer.packed_linear_takes(dtype))


SOURCES = ("paged_attention.cpp", "gemv.cpp", "packed_linear.cpp", "argmax.cpp", "greedy_head.cpp", "pointwise.cpp",
           "sample.cpp")


def source_files() -> list[Path]:
    """The sources and the headers they include."""
    here = Path(__file__).parent
    return [here / source for source in SOURCES] + sorted(here.glob("*.h"))

# torch's builder waits for as long as its lock file exists, and a build that was killed leaves it behind: one older
# than this is taken as such a leftover (a build takes about a minute on 2 cores).
STALE_LOCK_SECONDS = 15 * 60


def _build() -> None:
    import ninja
    from torch.utils import cpp_extension

    logger.info("loading liteinfer's CPU kernels (compiled on first use, then cached)")
    # torch's builder runs `ninja` from PATH, which need not name the environment's own (a venv used without
    # activating it).
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])
    name = f"liteinfer_cpu_kernels_{build_tag()}"
    build_directory = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
    build_directory.mkdir(parents=True, exist_ok=True)
    remove_stale_lock(build_directory)
    cpp_extension.load(
        name=name,
        sources=[str(path) for path in source_files() if path.suffix == ".cpp"],
        # -march=native: built for the CPU that runs it (hence one build per CPU). -ffast-math lets the compiler
        # vectorise exp and reassociate sums: attention and the GEMV see no infinities or NaNs; the argmax sees -inf
        # (masked logits), which its tests include.
        extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_directory),
        is_python_module=False,
    )

    @torch.library.register_fake("liteinfer::paged_decode_attention")
    def _(q, k_cache, v_cache, block_tables, positions, scale, sliding_window, softcap, k_scales=None, v_scales=None):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("liteinfer::gemv")
    def _(x, weight, scales, bias):
        return x.new_empty(x.shape[0], weight.shape[0])

    if hasattr(torch.ops.liteinfer, "packed_linear"):

        @torch.library.register_fake("liteinfer::packed_linear")
        def _(x, weight, bias):
            return x.new_empty(x.shape[0], weight.shape[0] * 16)

        @torch.library.register_fake("liteinfer::packed_gated_linear")
        def _(x, weight, bias, act):
            return x.new_empty(x.shape[0], weight.shape[1] * 16)

    if hasattr(torch.ops.liteinfer, "paged_prefill_attention"):

        @torch.library.register_fake("liteinfer::paged_prefill_attention")
        def _(q, k_cache, v_cache, block_tables, query_starts, positions, scale, sliding_window, k_scales=None,
              v_scales=None):
            return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("liteinfer::argmax")
    def _(logits):
        return logits.new_empty(logits.shape[0], dtype=torch.long)

    @torch.library.register_fake("liteinfer::rms_norm")
    def _(x, weight, eps, gemma):
        return torch.empty_like(x)

    @torch.library.register_fake("liteinfer::add_rms_norm")
    def _(x, residual, weight, eps, gemma):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake("liteinfer::rotary")
    def _(q, k, cos, sin):
        return q.new_empty(q.shape), k.new_empty(k.shape)

    @torch.library.register_fake("liteinfer::gated_activation")
    def _(gate_up, act):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake("liteinfer::write_kv")
    def _(k, v, k_cache, v_cache, slot_blocks, slot_offsets):
        return None

    @torch.library.register_fake("liteinfer::write_kv_int8")
    def _(k, v, k_cache, v_cache, k_scales, v_scales, slot_blocks, slot_offsets):
        return None


def build_tag() -> str:
    """What a build depends on beyond its sources and flags, which torch's builder checks itself: the CPU (model and
    instruction sets: a build for one CPU may crash on another with an illegal instruction), Python, torch, and the
    headers the sources include (the builder hashes the .cpp files only: a changed header alone left the old build in
    use). A cache shared between machines (a home directory on NFS) then keeps one build per kind of machine."""
    cpu = [platform.machine(), platform.processor()]
    try:  # Linux: the first CPU's model and flags (x86) or features (Arm)
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keys = ("model name", "flags", "Features")
        cpu += [next((line for line in lines if line.startswith(key)), "") for key in keys]
    except OSError:
        pass
    identity = "\n".join([*cpu, sys.version, torch.__version__])
    headers = b"".join(path.read_bytes() for path in source_files() if path.suffix == ".h")
    return hashlib.sha256(identity.encode() + headers).hexdigest()[:12]


def remove_stale_lock(build_directory: Path) -> None:
    lock = build_directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        logger.warning("removing %s, left %.0f minutes ago by a build that did not finish", lock, age / 60)
        lock.unlink(missing_ok=True)
