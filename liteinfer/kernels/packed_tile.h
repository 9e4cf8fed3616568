// The packed linears' tiles (packed_linear.cpp), shared with the quantized weights' batches (gemv.cpp), which
// dequantize their rows into the same layout: y[MT rows, 16 * NB outputs] = x[MT rows] . a group of NB blocks of
// 16 outputs, each group stored step by step (for each input pair (bf16) or input (fp32), its outputs' weights
// side by side). Built for AVX-512 with BF16 (fp32 and bf16) or AVX2 with FMA (bf16); elsewhere defines nothing.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define LITEINFER_PACKED_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define LITEINFER_PACKED_AVX2
#endif

#if defined(LITEINFER_PACKED_AVX512) || defined(LITEINFER_PACKED_AVX2)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "lanes16.h"

namespace liteinfer::packed {

constexpr int ROWS = 8;         // rows of x per tile: 8 x 3 sums + 3 weights + 1 broadcast of 32 registers
constexpr int64_t BLOCKS = 3;   // blocks of 16 outputs per group
constexpr int64_t LINE = 64;
#if defined(LITEINFER_PACKED_AVX512)
constexpr bool FLOAT_TILES = true;  // whether fp32 has tiles here (bf16 always does)
#else
constexpr bool FLOAT_TILES = false;
#endif
template <typename T>
constexpr int64_t PAIR = std::is_same_v<T, float> ? 1 : 2;  // inputs per step of the layout: fp32 one, bf16 a pair

// Where a tile prefetches: `lines` cache lines from `next`, one after each step's loads.
struct Prefetch {
  const char* next;
  int64_t lines;
};

#if defined(LITEINFER_PACKED_AVX512)
// One dtype's weights' load and multiply-add; `pair` inputs per step (its outputs are stored through lanes16.h).
template <typename T>
struct Arith;

template <>
struct Arith<float> {
  static constexpr int64_t pair = PAIR<float>;
  static constexpr int64_t chunk = 128;  // steps summed in registers before they add into a tile's totals
  static __m512 load(const float* w) { return _mm512_loadu_ps(w); }
  static __m512 broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 fma(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
};

template <>
struct Arith<c10::BFloat16> {
  static constexpr int64_t pair = PAIR<c10::BFloat16>;
  // One chunk: the output's rounding to bf16 (2^-9) dwarfs the sums' own, and chunks cost 2-3% here.
  static constexpr int64_t chunk = INT64_MAX / 2;
  static __m512 load(const c10::BFloat16* w) { return _mm512_castsi512_ps(_mm512_loadu_si512(w)); }
  static __m512 broadcast(const c10::BFloat16* x) {  // the pair x[i], x[i + 1] as one 32-bit lane
    return _mm512_castsi512_ps(_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x)));
  }
  static __m512 fma(__m512 acc, __m512 w, __m512 x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
};

// 16 outputs at y: their fp32 sums (+ their bias), in T (bf16 rounded to nearest even, as oneDNN's bf16 output is).
// `stream` (fp32, whose 16 outputs are one line; y on a line's start): a streaming store, which writes the line to
// memory without reading it into the cache first (packed_linear.cpp says when that pays).
template <typename T>
void store_outputs(T* y, __m512 sum, const T* bias, bool stream = false) {
  const __m512 v = bias ? _mm512_add_ps(sum, load_row16(bias)) : sum;
  if constexpr (std::is_same_v<T, float>) {
    if (stream) return _mm512_stream_ps(y, v);
  }
  store_row16(y, v);
}

// A tile's sums between the ranges of steps it is run over (tile_steps), for up to ROWS rows by BLOCKS blocks: the
// running sums of the chunk a range stopped inside (raw, for the range that goes on from there) and the totals that
// each finished chunk adds into.
struct TileSums {
  alignas(64) float running[ROWS][BLOCKS][16];
  alignas(64) float total[ROWS][BLOCKS][16];
};

// Steps [s0, s1) of y[MT rows, 16 * NB outputs] = x[MT rows] . the group of NB blocks at `w`, into `sums` (s0 = 0
// starts them afresh). Ranges run in order give the bits of one range over every step: a range that stops inside a
// chunk leaves its running sums in `sums` as they are, for the next to take up.
template <typename T, int MT, int NB>
void tile_steps(const T* x, int64_t k, const T* w, int64_t s0, int64_t s1, TileSums& sums, Prefetch prefetch) {
  using A = Arith<T>;
  const int64_t steps = k / A::pair;
  // The sums run over `chunk` steps in registers, then add into the totals: two levels, so that rounding grows with
  // chunk + steps / chunk rather than with every step (one running fp32 sum over 2,048 inputs erred ~5x more than
  // PyTorch's fp32 matmul, enough to move Gemma 3's fp32 logits past 1e-3 of transformers').
  if (s0 == 0)
    for (int m = 0; m < MT; ++m)
      for (int b = 0; b < NB; ++b) _mm512_store_ps(sums.total[m][b], _mm512_setzero_ps());
  for (int64_t c0 = s0; c0 < s1;) {
    const int64_t chunk_end = (c0 / A::chunk + 1) * A::chunk, c1 = std::min(s1, chunk_end);
    const bool fresh = c0 % A::chunk == 0;
    __m512 acc[MT][NB];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) acc[m][b] = fresh ? _mm512_setzero_ps() : _mm512_load_ps(sums.running[m][b]);
    for (int64_t s = c0; s < c1; ++s) {
      __m512 wv[NB];
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) wv[b] = A::load(w + (s * NB + b) * 16 * A::pair);
      if (s - s0 < prefetch.lines) _mm_prefetch(prefetch.next + (s - s0) * LINE, _MM_HINT_T1);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const __m512 xv = A::broadcast(x + m * k + s * A::pair);
#pragma GCC unroll 3
        for (int b = 0; b < NB; ++b) acc[m][b] = A::fma(acc[m][b], wv[b], xv);
      }
    }
    const bool finished = c1 == chunk_end || c1 == steps;
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) {
        if (finished) _mm512_store_ps(sums.total[m][b], _mm512_add_ps(_mm512_load_ps(sums.total[m][b]), acc[m][b]));
        else _mm512_store_ps(sums.running[m][b], acc[m][b]);
      }
    c0 = c1;
  }
}

// The tile's outputs from its totals (+ b), once every step has been run (`stream`: as store_outputs).
template <typename T, int MT, int NB>
void tile_outputs(const TileSums& sums, const T* bias, T* y, int64_t n, bool stream = false) {
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 3
    for (int b = 0; b < NB; ++b)
      store_outputs(y + m * n + b * 16, _mm512_load_ps(sums.total[m][b]), bias ? bias + b * 16 : nullptr, stream);
}

// y[MT rows, 16 * NB outputs] = x[MT rows] . the group of NB blocks at `w` (+ b), every step in one range.
template <typename T, int MT, int NB>
void tile(const T* x, int64_t k, const T* w, const T* bias, T* y, int64_t n, Prefetch prefetch) {
  TileSums sums;
  tile_steps<T, MT, NB>(x, k, w, 0, k / Arith<T>::pair, sums, prefetch);
  tile_outputs<T, MT, NB>(sums, bias, y, n);
}

#else  // LITEINFER_PACKED_AVX2
// bf16 only: there fp32 W stays oneDNN's, whose fp32 matmul ran SmolLM2's linears faster than a kernel of this shape
// (32 rows: 101 vs 129 ms; 128 rows: 262 vs 484), while PyTorch's bf16 matmul ran ~6x slower than this one
// (docs/benchmarks.md). With no bf16 products, pairs are widened in registers: a 32-bit lane holds one output's
// weights for the step's two inputs (or the two inputs of x), the first in the low half; shifted up, the low half
// is the first in fp32, and masked, the high half is the second. (x widened to fp32 once per call instead, each input
// broadcast from memory, ran 8-18% slower at 32 rows and 18-48% at 128, and slower with everything in L1 too: two
// broadcasts a pair cost more than one and its two widenings.)

// 16 registers of 8 lanes: a block of 16 outputs is two vectors, so a tile of several rows takes them four at a time
// (4 x 2 sums, the block's weights for both inputs, a row's two inputs), each block of the group in its own pass;
// the group, ~20-150 KB, stays in L2 between passes.
constexpr int PASS_ROWS = 4;

inline __m256 first_of_pairs(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 second_of_pairs(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// y[R rows, 16 * NBP outputs] = x[R rows] . NBP consecutive blocks of a group whose steps are `stride` elements
// (the group's blocks interleave step by step), for each of G groups (w, bias and y per group). G groups are read
// step by step together, as G streams (one row of x: `row_of_groups`); each output's sum takes the same
// operations in the same order whatever G is.
template <int R, int NBP, int G = 1>
void pass(const c10::BFloat16* x, int64_t k, std::array<const c10::BFloat16*, G> w, int64_t stride,
          std::array<const c10::BFloat16*, G> bias, std::array<c10::BFloat16*, G> y, int64_t n,
          Prefetch prefetch) {
  __m256 acc[G][R][NBP][2];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
      for (int b = 0; b < NBP; ++b) acc[g][r][b][0] = acc[g][r][b][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < k / 2; ++s) {
    if (s < prefetch.lines) _mm_prefetch(prefetch.next + s * LINE, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 3
      for (int b = 0; b < NBP; ++b) {
        const c10::BFloat16* step = w[g] + s * stride + b * 32;
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step));  // outputs 0-7
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 16));  // 8-15
        const __m256 lo_first = first_of_pairs(lo), lo_second = second_of_pairs(lo);
        const __m256 hi_first = first_of_pairs(hi), hi_second = second_of_pairs(hi);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i pair = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * k + 2 * s));
          const __m256 x_first = first_of_pairs(pair), x_second = second_of_pairs(pair);
          acc[g][r][b][0] = _mm256_fmadd_ps(lo_second, x_second, _mm256_fmadd_ps(lo_first, x_first, acc[g][r][b][0]));
          acc[g][r][b][1] = _mm256_fmadd_ps(hi_second, x_second, _mm256_fmadd_ps(hi_first, x_first, acc[g][r][b][1]));
        }
      }
  }
  alignas(32) float sums[16];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NBP; ++b) {
        _mm256_store_ps(sums, acc[g][r][b][0]);
        _mm256_store_ps(sums + 8, acc[g][r][b][1]);
        for (int j = 0; j < 16; ++j) {  // rounded to nearest even, as the AVX-512 tile's store
          const float v = bias[g] ? sums[j] + static_cast<float>(bias[g][b * 16 + j]) : sums[j];
          y[g][r * n + b * 16 + j] = static_cast<c10::BFloat16>(v);
        }
      }
}

// One row of x against GROUPS whole groups (BLOCKS blocks each) at once, read side by side: a stream each through
// W. A thread reading one stream (the one-row tile below) is held by the hardware prefetcher, which follows a single
// stream too slowly when each call starts it afresh: on the AMD Zen 3 SmolLM2's one-row bf16 linears took ~10% less
// time read as four streams a thread, 6-8% as two (docs/benchmarks.md). Four groups' sums (24 vectors) do not fit
// AVX2's 16 registers; the spilled ones cost less than the time a step's weights take to arrive from DRAM.
constexpr int GROUPS = 4;
inline void row_of_groups(const c10::BFloat16* x, int64_t k, const std::array<const c10::BFloat16*, GROUPS>& w,
                          const std::array<const c10::BFloat16*, GROUPS>& bias,
                          const std::array<c10::BFloat16*, GROUPS>& y) {
  pass<1, BLOCKS, GROUPS>(x, k, w, BLOCKS * 32, bias, y, 0, Prefetch{nullptr, 0});
}

// The AVX-512 tile's contract (y[MT rows, 16 * NB outputs] = x[MT rows] . the group of NB blocks at `w`). One row
// takes the whole group in one pass, front to back (6 sums), as a stream from DRAM; more rows go PASS_ROWS at a
// time over one block each, the group in L2 after the first pass. Each block's first pass prefetches a line a step,
// from where the block before it stopped: a lone tile (2-8 rows) asks for up to three blocks' worth, the thread's
// whole next group, where asking for one block's worth left the rest to the hardware prefetcher (on the AMD Zen 3
// SmolLM2's linears at 2-8 rows took 0.71-0.80x the time, 16 rows 0.88x, 32 rows level; docs/benchmarks.md).
template <typename T, int MT, int NB>
void tile(const T* x, int64_t k, const T* w, const T* bias, T* y, int64_t n, Prefetch prefetch) {
  constexpr int64_t stride = NB * 32;  // a step of the group: NB blocks of 16 outputs' pairs
  if constexpr (MT == 1) {
    pass<1, NB>(x, k, {w}, stride, {bias}, {y}, n, prefetch);
  } else {
    constexpr int first_rows = std::min(MT, PASS_ROWS);
    for (int b = 0; b < NB; ++b) {
      const T* block_bias = bias ? bias + b * 16 : nullptr;
      const int64_t asked = b * (k / 2);  // the lines the blocks' first passes before this one asked for
      pass<first_rows, 1>(x, k, {w + b * 32}, stride, {block_bias}, {y + b * 16}, n,
                          prefetch.lines > asked ? Prefetch{prefetch.next + asked * LINE, prefetch.lines - asked}
                                                 : Prefetch{nullptr, 0});
      if constexpr (MT > PASS_ROWS) {
        pass<MT - PASS_ROWS, 1>(x + PASS_ROWS * k, k, {w + b * 32}, stride, {block_bias}, {y + PASS_ROWS * n + b * 16},
                                n, Prefetch{nullptr, 0});
      }
    }
  }
}
#endif

template <typename T>
using TileFn = void (*)(const T*, int64_t, const T*, const T*, T*, int64_t, Prefetch);

// A tile's functions by shape, Kind::fn<T, MT, NB> for MT rows of x against NB blocks: the whole tile, and on
// AVX-512 its ranges of steps and its outputs.
struct WholeTile {
  template <typename T, int MT, int NB>
  static constexpr TileFn<T> fn = &tile<T, MT, NB>;
};
#if defined(LITEINFER_PACKED_AVX512)
struct TileRange {
  template <typename T, int MT, int NB>
  static constexpr auto fn = &tile_steps<T, MT, NB>;
};
struct TileOutputs {
  template <typename T, int MT, int NB>
  static constexpr auto fn = &tile_outputs<T, MT, NB>;
};
#endif

// Kind's functions of NB blocks for 1..ROWS rows, indexed by the row count (entry 0 unused).
template <typename Kind, typename T, int NB, int... R>
constexpr auto by_rows(std::integer_sequence<int, R...>) {
  return std::array<decltype(Kind::template fn<T, 1, NB>), ROWS + 1>{nullptr, Kind::template fn<T, R + 1, NB>...};
}

// Kind's function for `rows` rows (1..ROWS) of x against a group of `blocks` blocks (1..BLOCKS).
template <typename Kind, typename T>
auto tile_fn(int64_t blocks, int64_t rows) {
  static constexpr auto row_counts = std::make_integer_sequence<int, ROWS>{};
  static constexpr std::array by_blocks = {by_rows<Kind, T, 1>(row_counts), by_rows<Kind, T, 2>(row_counts),
                                           by_rows<Kind, T, 3>(row_counts)};
  return by_blocks[blocks - 1][rows];
}

template <typename T>
TileFn<T> tile_for(int64_t blocks, int64_t rows) {
  return tile_fn<WholeTile, T>(blocks, rows);
}

}  // namespace liteinfer::packed
#endif
