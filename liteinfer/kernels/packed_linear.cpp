// y = x W^T (+ b) for any number of rows x, with W packed for it by layers/linear.py: pack_weight. W's outputs go
// in groups of three blocks of 16 (48 outputs; the last group one or two blocks when the blocks do not divide by
// three), each group stored step by step: for each input pair (bf16: the two inputs one vdpbf16ps multiplies) or
// input (fp32), its outputs' weights side by side. Registered (CPU: AVX-512 with BF16, or AVX2 with FMA) as
// torch.ops.liteinfer.packed_linear; liteinfer/kernels/__init__.py builds it and gives its contract.
//
// A step of a block is one 64-byte load holding 16 outputs' weights for one input (pair): multiplied by that input
// of every row, broadcast, it adds into 16 outputs at once, with no sum across a register at the end. A tile keeps
// ROWS rows by one group (up to 48 outputs) of fp32 sums in registers and reads the group front to back, one
// sequential stream; every tile of rows re-reads the group from L2, while the thread's next group is prefetched
// into L2 over the tiles before the last, so that W comes from DRAM once per call, overlapped with the arithmetic.
// On SmolLM2's linears this ran about 1.5x oneDNN's prepacked matmul at 32 rows, level with our one-row GEMV at
// one row, and level with oneDNN from 256 rows up (docs/benchmarks.md).
//
// On CPUs with AVX2 and FMA but not AVX-512 BF16 the same layout is read by a tile of their own (further below):
// a block of 16 outputs is two 8-lane vectors, and bf16 weights are widened in registers. On CPUs with AMX, bf16 goes
// through its tiles instead (amx_rows): on an Intel Xeon with AMX that ran SmolLM2's linears 3.1x faster than the
// AVX-512 tile at 32 rows and 1.2-1.3x oneDNN's prepacked matmul, 0.8-0.9x it at 256 rows, level at 1,024.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define LITEINFER_PACKED_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define LITEINFER_PACKED_AVX2
#endif

#if defined(LITEINFER_PACKED_AVX512) || defined(LITEINFER_PACKED_AVX2)
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "amx.h"

namespace {

constexpr int ROWS = 8;         // rows of x per tile: 8 x 3 sums + 3 weights + 1 broadcast of 32 registers
constexpr int64_t BLOCKS = 3;   // blocks of 16 outputs per group
constexpr int64_t M_BLOCK = 128;  // rows per pass over W: their x stays in L2 (128 x 1536 bf16: 384 KB)
constexpr int64_t LINE = 64;

// Where a tile prefetches: `lines` cache lines from `next`, one after each step's loads.
struct Prefetch {
  const char* next;
  int64_t lines;
};

#if defined(LITEINFER_PACKED_AVX512)
// One dtype's load, multiply-add and store of 16 outputs; `pair` inputs per step.
template <typename T>
struct Arith;

template <>
struct Arith<float> {
  static constexpr int64_t pair = 1;
  static constexpr int64_t chunk = 128;  // steps summed in registers before they add into a tile's totals
  static __m512 load(const float* w) { return _mm512_loadu_ps(w); }
  static __m512 broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 fma(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
  static __m512 widen(const float* v) { return _mm512_loadu_ps(v); }
  static void store(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
};

template <>
struct Arith<c10::BFloat16> {
  static constexpr int64_t pair = 2;
  // One chunk: the output's rounding to bf16 (2^-9) dwarfs the sums' own, and chunks cost 2-3% here.
  static constexpr int64_t chunk = INT64_MAX / 2;
  static __m512 load(const c10::BFloat16* w) { return _mm512_castsi512_ps(_mm512_loadu_si512(w)); }
  static __m512 broadcast(const c10::BFloat16* x) {  // the pair x[i], x[i + 1] as one 32-bit lane
    return _mm512_castsi512_ps(_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x)));
  }
  static __m512 fma(__m512 acc, __m512 w, __m512 x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
  static __m512 widen(const c10::BFloat16* v) {  // 16 bf16 to fp32: the bits shifted into the high half
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static void store(c10::BFloat16* y, __m512 v) {  // rounded to nearest even, as oneDNN's bf16 output is
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
  }
};

// 16 outputs at y: their fp32 sums (+ their bias), in T.
template <typename T>
void store_outputs(T* y, __m512 sum, const T* bias) {
  Arith<T>::store(y, bias ? _mm512_add_ps(sum, Arith<T>::widen(bias)) : sum);
}

// y[MT rows, 16 * NB outputs] = x[MT rows] . the group of NB blocks at `w` (+ b).
template <typename T, int MT, int NB>
void tile(const T* x, int64_t k, const T* w, const T* bias, T* y, int64_t n, Prefetch prefetch) {
  using A = Arith<T>;
  const int64_t steps = k / A::pair;
  // The sums run over `chunk` steps in registers, then add into `total`: two levels, so that rounding grows with
  // chunk + steps / chunk rather than with every step (one running fp32 sum over 2,048 inputs erred ~5x more than
  // PyTorch's fp32 matmul, enough to move Gemma 3's fp32 logits past 1e-3 of transformers').
  alignas(64) float total[MT][NB][16] = {};  // in L1, out of the registers the chunk's sums need
  for (int64_t s0 = 0; s0 < steps; s0 += A::chunk) {
    __m512 acc[MT][NB];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
    for (int64_t s = s0; s < std::min(steps, s0 + A::chunk); ++s) {
      __m512 wv[NB];
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) wv[b] = A::load(w + (s * NB + b) * 16 * A::pair);
      if (s < prefetch.lines) _mm_prefetch(prefetch.next + s * LINE, _MM_HINT_T1);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const __m512 xv = A::broadcast(x + m * k + s * A::pair);
#pragma GCC unroll 3
        for (int b = 0; b < NB; ++b) acc[m][b] = A::fma(acc[m][b], wv[b], xv);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) _mm512_store_ps(total[m][b], _mm512_add_ps(_mm512_load_ps(total[m][b]), acc[m][b]));
  }
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 3
    for (int b = 0; b < NB; ++b)
      store_outputs(y + m * n + b * 16, _mm512_load_ps(total[m][b]), bias ? bias + b * 16 : nullptr);
}

#else  // LITEINFER_PACKED_AVX2
// bf16 only: there fp32 W stays oneDNN's, whose fp32 matmul ran SmolLM2's linears faster than a kernel of this shape
// (32 rows: 101 vs 129 ms; 128 rows: 262 vs 484), while PyTorch's bf16 matmul ran ~6x slower than this one
// (docs/benchmarks.md). With no bf16 products, pairs are widened in registers: a 32-bit lane holds one output's
// weights for the step's two inputs (or the two inputs of x), the first in the low half; shifted up, the low half
// is the first in fp32, and masked, the high half is the second. (x widened to fp32 once per call instead ran 8%
// slower at 32 rows and 48% at 128: twice the bytes per row in L2, and two broadcasts per pair.)

// 16 registers of 8 lanes: a block of 16 outputs is two vectors, so a tile of several rows takes them four at a time
// (4 x 2 sums, the block's weights for both inputs, a row's two inputs), each block of the group in its own pass;
// the group, ~20-150 KB, stays in L2 between passes.
constexpr int PASS_ROWS = 4;

inline __m256 first_of_pairs(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 second_of_pairs(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// y[R rows, 16 * NBP outputs] = x[R rows] . NBP consecutive blocks of a group whose steps are `stride` elements
// (the group's blocks interleave step by step).
template <int R, int NBP>
void pass(const c10::BFloat16* x, int64_t k, const c10::BFloat16* w, int64_t stride, const c10::BFloat16* bias,
          c10::BFloat16* y, int64_t n, Prefetch prefetch) {
  __m256 acc[R][NBP][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int b = 0; b < NBP; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < k / 2; ++s) {
    if (s < prefetch.lines) _mm_prefetch(prefetch.next + s * LINE, _MM_HINT_T1);
#pragma GCC unroll 3
    for (int b = 0; b < NBP; ++b) {
      const c10::BFloat16* step = w + s * stride + b * 32;
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step));  // outputs 0-7
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 16));  // 8-15
      const __m256 lo_first = first_of_pairs(lo), lo_second = second_of_pairs(lo);
      const __m256 hi_first = first_of_pairs(hi), hi_second = second_of_pairs(hi);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i pair = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * k + 2 * s));
        const __m256 x_first = first_of_pairs(pair), x_second = second_of_pairs(pair);
        acc[r][b][0] = _mm256_fmadd_ps(lo_second, x_second, _mm256_fmadd_ps(lo_first, x_first, acc[r][b][0]));
        acc[r][b][1] = _mm256_fmadd_ps(hi_second, x_second, _mm256_fmadd_ps(hi_first, x_first, acc[r][b][1]));
      }
    }
  }
  alignas(32) float sums[16];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NBP; ++b) {
      _mm256_store_ps(sums, acc[r][b][0]);
      _mm256_store_ps(sums + 8, acc[r][b][1]);
      for (int j = 0; j < 16; ++j) {  // rounded to nearest even, as the AVX-512 tile's store
        const float v = bias ? sums[j] + static_cast<float>(bias[b * 16 + j]) : sums[j];
        y[r * n + b * 16 + j] = static_cast<c10::BFloat16>(v);
      }
    }
}

// The AVX-512 tile's contract (y[MT rows, 16 * NB outputs] = x[MT rows] . the group of NB blocks at `w`). One row
// takes the whole group in one pass, front to back (6 sums), as a stream from DRAM; more rows go PASS_ROWS at a
// time over one block each, the group in L2 after the first pass. The first pass prefetches.
template <typename T, int MT, int NB>
void tile(const T* x, int64_t k, const T* w, const T* bias, T* y, int64_t n, Prefetch prefetch) {
  constexpr int64_t stride = NB * 32;  // a step of the group: NB blocks of 16 outputs' pairs
  if constexpr (MT == 1) {
    pass<1, NB>(x, k, w, stride, bias, y, n, prefetch);
  } else {
    constexpr int first_rows = std::min(MT, PASS_ROWS);
    for (int b = 0; b < NB; ++b) {
      const T* block_bias = bias ? bias + b * 16 : nullptr;
      pass<first_rows, 1>(x, k, w + b * 32, stride, block_bias, y + b * 16, n,
                          b == 0 ? prefetch : Prefetch{nullptr, 0});
      if constexpr (MT > PASS_ROWS) {
        pass<MT - PASS_ROWS, 1>(x + PASS_ROWS * k, k, w + b * 32, stride, block_bias, y + PASS_ROWS * n + b * 16, n,
                                Prefetch{nullptr, 0});
      }
    }
  }
}
#endif

#if defined(LITEINFER_AMX)
// CPUs with AMX (Intel Xeon since Sapphire Rapids) multiply bf16 in tiles: one tdpbf16ps adds a 16 x 32 tile of x
// times 32 inputs' weights for 16 outputs into 16 x 16 fp32 sums, 16x the work of a vdpbf16ps. The packed layout is
// already what a tile of W wants: 16 consecutive steps of a block, one 64-byte row each, NB * 64 bytes apart. A
// pass of 16 rows keeps one group's sums in tiles 0..NB-1, x's 16 x 32 slice in tile 3 and the blocks' slices in
// tiles 4..3+NB; every 16 rows re-read the group from L2. Rows are taken 16 at a time, the last 16 from a
// zero-padded copy of x; inputs must come in multiples of 32 (else the AVX-512 tiles serve).

using liteinfer::amx_permitted, liteinfer::TileConfig;

constexpr int64_t AMX_ROWS = 16, AMX_INPUTS = 32;

// y[rows valid of 16 padded, 16 * NB outputs] = x[16 rows] . the group of NB blocks at `w` (+ b), through `sums`
// (16 x 16 * NB fp32).
template <int NB>
void amx_pass(const c10::BFloat16* x, int64_t k, const c10::BFloat16* w, const c10::BFloat16* bias,
              c10::BFloat16* y, int64_t n, int64_t rows, float* sums) {
  constexpr int64_t step_bytes = NB * 64;  // a step of the group: NB blocks of 16 outputs' pairs
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  for (int64_t i = 0; i < k; i += AMX_INPUTS) {
    const c10::BFloat16* steps = w + i / 2 * NB * 32;
    _tile_loadd(3, x + i, k * 2);
    _tile_loadd(4, steps, step_bytes);
    _tile_dpbf16ps(0, 3, 4);
    if constexpr (NB > 1) {
      _tile_loadd(5, steps + 32, step_bytes);
      _tile_dpbf16ps(1, 3, 5);
    }
    if constexpr (NB > 2) {
      _tile_loadd(6, steps + 64, step_bytes);
      _tile_dpbf16ps(2, 3, 6);
    }
  }
  _tile_stored(0, sums, step_bytes);
  if constexpr (NB > 1) _tile_stored(1, sums + 16, step_bytes);
  if constexpr (NB > 2) _tile_stored(2, sums + 32, step_bytes);
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < NB; ++b)
      store_outputs(y + r * n + b * 16, _mm512_loadu_ps(sums + r * NB * 16 + b * 16), bias ? bias + b * 16 : nullptr);
}

void amx_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y,
              int64_t m, int64_t n, int64_t k) {
  using Pass = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*,
                        int64_t, int64_t, float*);
  static constexpr std::array<Pass, BLOCKS + 1> by_blocks = {nullptr, &amx_pass<1>, &amx_pass<2>, &amx_pass<3>};
  // The last 16 rows from a zero-padded copy, so that every tile load reads 16 whole rows.
  const int64_t full = m / AMX_ROWS * AMX_ROWS;
  std::vector<c10::BFloat16> tail(m > full ? AMX_ROWS * k : 0);
  std::copy(x + full * k, x + m * k, tail.begin());
  const int64_t blocks = n / 16, block_size = k * 16, groups = (blocks + BLOCKS - 1) / BLOCKS;
  for (int64_t m0 = 0; m0 < m; m0 += M_BLOCK) {
    const int64_t m_end = std::min(m, m0 + M_BLOCK);
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      const TileConfig config(4 + BLOCKS);
      _tile_loadconfig(&config);
      alignas(64) float sums[AMX_ROWS * BLOCKS * 16];
      for (int64_t g = begin; g < end; ++g) {
        const int64_t b0 = g * BLOCKS, nb = std::min(BLOCKS, blocks - b0);
        for (int64_t r0 = m0; r0 < m_end; r0 += AMX_ROWS) {
          const c10::BFloat16* rows_x = r0 < full ? x + r0 * k : tail.data();
          by_blocks[nb](rows_x, k, w + b0 * block_size, bias ? bias + b0 * 16 : nullptr, y + r0 * n + b0 * 16, n,
                        std::min(AMX_ROWS, m_end - r0), sums);
        }
      }
      _tile_release();
    });
  }
}
#endif

template <typename T>
using TileFn = void (*)(const T*, int64_t, const T*, const T*, T*, int64_t, Prefetch);

// The tiles of NB blocks for 1..ROWS rows, indexed by the row count (entry 0 unused).
template <typename T, int NB, int... R>
constexpr std::array<TileFn<T>, ROWS + 1> tiles(std::integer_sequence<int, R...>) {
  return {nullptr, &tile<T, R + 1, NB>...};
}

template <typename T>
void packed_linear_rows(const T* x, const T* w, const T* bias, T* y, int64_t m, int64_t n, int64_t k) {
  static constexpr auto rows = std::make_integer_sequence<int, ROWS>{};
  static constexpr std::array<std::array<TileFn<T>, ROWS + 1>, BLOCKS + 1> by_blocks = {
      {{}, tiles<T, 1>(rows), tiles<T, 2>(rows), tiles<T, 3>(rows)}};
  const int64_t blocks = n / 16, block_size = k * 16;  // elements per block
  const int64_t lines_per_block = block_size * static_cast<int64_t>(sizeof(T)) / LINE;
  const int64_t groups = (blocks + BLOCKS - 1) / BLOCKS;
  for (int64_t m0 = 0; m0 < m; m0 += M_BLOCK) {
    const int64_t m_end = std::min(m, m0 + M_BLOCK), num_tiles = (m_end - m0 + ROWS - 1) / ROWS;
    // Each thread takes a contiguous share of the groups of blocks: one stream through its part of W.
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t b0 = g * BLOCKS, nb = std::min(BLOCKS, blocks - b0);
        const T* group = w + b0 * block_size;
        // The thread's next group, a line per step of every tile but the last: the tiles before it prefetch a
        // block each, enough for the whole group from four tiles (32 rows) up; a lone tile prefetches one block,
        // as far as the hardware's own prefetcher does not already run ahead.
        const int64_t next_lines = g + 1 < end ? std::min(BLOCKS, blocks - b0 - nb) * lines_per_block : 0;
        for (int64_t t = 0; t < num_tiles; ++t) {
          const int64_t r0 = m0 + t * ROWS, first = t * lines_per_block;
          const bool last = num_tiles > 1 && t == num_tiles - 1;
          const Prefetch prefetch{reinterpret_cast<const char*>(group + nb * block_size) + first * LINE,
                                  last ? 0 : std::max<int64_t>(0, next_lines - first)};
          by_blocks[nb][std::min<int64_t>(ROWS, m_end - r0)](x + r0 * k, k, group, bias ? bias + b0 * 16 : nullptr,
                                                             y + r0 * n + b0 * 16, n, prefetch);
        }
      }
    });
  }
}

bool packed_linear_takes(at::ScalarType dtype) {
#if defined(LITEINFER_PACKED_AVX512)
  return dtype == at::kFloat || dtype == at::kBFloat16;
#else
  return dtype == at::kBFloat16;
#endif
}

// Whether bf16 takes the AMX tiles here (built for them, and the kernel grants their state).
bool packed_linear_amx() {
#if defined(LITEINFER_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed_linear_takes(x.scalar_type()), "packed_linear takes ",
              packed_linear_takes(at::kFloat) ? "fp32 or bf16" : "bf16 (fp32 stays oneDNN's on this CPU)", " x");
  const int64_t pair = x.scalar_type() == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 4 && weight.size(2) == 16 && weight.size(3) == pair &&
                  weight.size(1) * pair == x.size(1),
              "expected x [rows, in] and weight [out / 16, in / pair, 16, pair] (pair: 2 for bf16, 1 for fp32)");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "the weight must be contiguous, in x's dtype");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0) * 16;
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == x.scalar_type()),
              "the bias must be [out], in x's dtype");
  const at::Tensor x_ = x.contiguous(), b = bias ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({m, n}, x.options());
#if defined(LITEINFER_AMX)
  if (pair == 2 && k % AMX_INPUTS == 0 && amx_permitted()) {
    amx_rows(x_.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
             b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(), m, n, k);
    return y;
  }
#endif
  auto run = [&](auto type) {
    using T = decltype(type);
    packed_linear_rows<T>(x_.data_ptr<T>(), weight.data_ptr<T>(), b.defined() ? b.data_ptr<T>() : nullptr,
                          y.data_ptr<T>(), m, n, k);
  };
#if defined(LITEINFER_PACKED_AVX512)
  pair == 2 ? run(c10::BFloat16{}) : run(float{});
#else
  run(c10::BFloat16{});
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(liteinfer, m) {
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("packed_linear_takes(ScalarType dtype) -> bool", &packed_linear_takes);  // no tensor: no dispatch key
  m.def("packed_linear_amx() -> bool", &packed_linear_amx);
}

TORCH_LIBRARY_IMPL(liteinfer, CPU, m) { m.impl("packed_linear", &packed_linear); }
#endif
