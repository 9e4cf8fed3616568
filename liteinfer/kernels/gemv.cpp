// y = x W^T (+ b) for a single row x: the only product a decode step of one sequence has. W is float (fp32 or
// bf16, as x), or int8 or int4 with a scale and a zero per group of inputs (layers/quantization.py's int8 and int4).
// Quantized weights take any number of rows, as their only kernel for batches too (below). Registered (CPU) as
// torch.ops.liteinfer.gemv; liteinfer/kernels/__init__.py builds it and gives its contract.
//
// At one row a linear layer is a stream through W, bound by memory bandwidth. oneDNN's prepacked matmul reached
// ~35-42 GB/s on SmolLM2's layers here; streaming W's rows in their checkpoint layout, each thread through its
// share of rows in address order, a few streams at once, reads as fast as a plain read of the same bytes
// (docs/benchmarks.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "amx.h"
#include "packed_tile.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

#if defined(__AVX2__)
// The first `count` (0..8) of eight 32-bit lanes set: the mask of AVX2's masked loads, which read nothing under a
// clear lane (so nothing past an array's end), where a copy into a zeroed array read back as one vector waits on the
// copy's narrow stores (failed store forwarding).
inline __m256i first_lanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // (BW: bf16's masked tail)
// One multiply-add step of a row's dot product, per pair of dtypes: `width` weights at w against x, summed into
// an fp32 vector; `tail` does the same for the last count < width under a mask (masking every load ran at half the
// speed, so the loop's loads are plain).
template <typename weight_t, typename x_t>
struct Step;

template <>
struct Step<float, float> {
  using Vec = __m512;
  static constexpr int64_t width = 16;
  static __m512 full(__m512 acc, const float* w, const float* x) {
    return _mm512_fmadd_ps(_mm512_loadu_ps(w), _mm512_loadu_ps(x), acc);
  }
  static __m512 tail(__m512 acc, const float* w, const float* x, int64_t count) {
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    return _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, w), _mm512_maskz_loadu_ps(mask, x), acc);
  }
};

#if defined(__AVX512BF16__)
// vdpbf16ps multiplies bf16 pairs and accumulates in fp32, as oneDNN's bf16 matmul does.
template <>
struct Step<c10::BFloat16, c10::BFloat16> {
  using Vec = __m512;
  static constexpr int64_t width = 32;
  static __m512 full(__m512 acc, const c10::BFloat16* w, const c10::BFloat16* x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), (__m512bh)_mm512_loadu_si512(x));
  }
  static __m512 tail(__m512 acc, const c10::BFloat16* w, const c10::BFloat16* x, int64_t count) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << count) - 1);
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(mask, w),
                            (__m512bh)_mm512_maskz_loadu_epi16(mask, x));
  }
};
#endif

inline __m512 zero(__m512) { return _mm512_setzero_ps(); }
inline __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }
#define LITEINFER_GEMV_VECTOR
#elif defined(__AVX2__) && defined(__FMA__)
// The same steps in 8 lanes (AVX2 CPUs; bf16 keeps the portable loop there).
template <typename weight_t, typename x_t>
struct Step;

template <>
struct Step<float, float> {
  using Vec = __m256;
  static constexpr int64_t width = 8;
  static __m256 full(__m256 acc, const float* w, const float* x) {
    return _mm256_fmadd_ps(_mm256_loadu_ps(w), _mm256_loadu_ps(x), acc);
  }
  static __m256 tail(__m256 acc, const float* w, const float* x, int64_t count) {
    const __m256i mask = first_lanes(count);
    return _mm256_fmadd_ps(_mm256_maskload_ps(w, mask), _mm256_maskload_ps(x, mask), acc);
  }
};

inline __m256 zero(__m256) { return _mm256_setzero_ps(); }
inline __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
#define LITEINFER_GEMV_VECTOR
#endif

#if defined(__AVX2__) && defined(__FMA__)  // (AVX-512 CPUs have these too: the quantized rows below use them)
inline float reduce(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}
#endif

#if defined(LITEINFER_GEMV_VECTOR)
// Each row front to back into two interleaved sums (one alone stalls on its add's latency when W is in cache), in
// the same order whatever N is: a row's result does not depend on the rows read beside it. The sums are an array
// indexed only in fully unrolled loops, so that they stay in registers.
template <int N, typename weight_t, typename x_t, typename S = Step<weight_t, x_t>>
inline void dot_rows_vector(const weight_t* w, int64_t stride, const x_t* x, int64_t k, float* out) {
  constexpr int64_t n = S::width;
  using Vec = typename S::Vec;
  Vec a[N][2];
#pragma GCC unroll 8
  for (int r = 0; r < N; ++r) a[r][0] = a[r][1] = zero(Vec{});
  int64_t i = 0;
  for (; i + 2 * n <= k; i += 2 * n) {
#pragma GCC unroll 8
    for (int r = 0; r < N; ++r) {
      a[r][0] = S::full(a[r][0], w + r * stride + i, x + i);
      a[r][1] = S::full(a[r][1], w + r * stride + i + n, x + i + n);
    }
  }
  // What the paired steps leave: one more whole step at most, then a tail shorter than a step.
  const bool one_more = i + n <= k;
  const int64_t t = one_more ? i + n : i;
#pragma GCC unroll 8
  for (int r = 0; r < N; ++r) {
    if (one_more) a[r][0] = S::full(a[r][0], w + r * stride + i, x + i);
    if (t < k) a[r][1] = S::tail(a[r][1], w + r * stride + t, x + t, k - t);
    out[r] = reduce(add(a[r][0], a[r][1]));
  }
}

// Whether this build multiplies W and x of these dtypes in vectors (a `Step`).
template <typename weight_t, typename x_t>
constexpr bool kVectorDtypes = (std::is_same_v<weight_t, float> && std::is_same_v<x_t, float>)
#if defined(__AVX512BF16__)
                               || (std::is_same_v<weight_t, c10::BFloat16> && std::is_same_v<x_t, c10::BFloat16>)
#endif
    ;
#endif

// out[r] = W[r]·x in fp32 for the N rows W[r] = w + r * stride (length k): in vectors where this build has a Step
// for the dtypes (above), else a product at a time.
template <int N, typename weight_t, typename x_t>
inline void dot_rows(const weight_t* w, int64_t stride, const x_t* x, int64_t k, float* out) {
#if defined(LITEINFER_GEMV_VECTOR)
  if constexpr (kVectorDtypes<weight_t, x_t>) return dot_rows_vector<N>(w, stride, x, k, out);
#endif
  for (int r = 0; r < N; ++r) {
    float sum = 0.f;
    for (int64_t i = 0; i < k; ++i) sum += static_cast<float>(w[r * stride + i]) * static_cast<float>(x[i]);
    out[r] = sum;
  }
}

// Quantized rows. int8: a scale and a zero per group of 32 inputs, the weight being q * scale + zero, both fp16, a
// row's scales side by side and then its zeros. int4: a scale and a zero per group of 32 inputs in x's dtype, laid
// out as int8's, the weight being (q - 8) * scale + zero; each block of 64 inputs' levels q is 32 bytes, read as
// sixteen little-endian 16-bit lanes, lane l holding the levels of inputs l, 16 + l, 32 + l, 48 + l in its nibbles
// from the lowest up (layers/quantization.py: gemv_int4_layout), so that one shift and one mask give sixteen
// consecutive inputs' levels as 16-bit integers, with no byte shuffles.
constexpr int64_t kGroup = 64;  // int4's block of inputs in its layout, and the group x is rounded in below
constexpr int64_t kInt8Group = 32, kInt4Group = 32;  // the groups that share a scale and a zero
constexpr int kRowsSummed = 4;  // the rows of W whose sums a one-row call adds up at once (`sum_rows`)

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// On x86 CPUs the products are taken in integers: x is rounded once per call to 16-bit levels per group of 64
// inputs (level = x / scale, scale = the group's largest |x| / 32767), and each group's sum of weight levels times
// x levels is exact in int32 (at most 32 * 128 * 32767 < 2^31), then scaled. Sixteen weights a multiply
// (vpmaddwd, or AVX-512 VNNI's vpdpwssd, which adds as it multiplies), where converting them to fp32 took a
// conversion per eight or sixteen. Rounding x moves each input by at most half a level: a relative 2^-16 of its
// group's largest value, below bf16's own rounding (2^-9) and far below the weights' (int8: 2^-9 of the group's
// range). On AMD Zen 3 (AVX2) this made SmolLM2's int8 linears 6-15% faster from memory and ~35% from cache; on
// AMD Zen 4 (AVX-512, whose 512-bit operations run as two 256-bit halves) int8 16-18% and int4 15-19% faster from
// memory, 19-33% from cache, against fp32 widening in 16 lanes (int4: in 8; in 16 it was no faster). On the AMD
// Zen 5 an earlier int16 prototype of int8 was no faster than fp32 widening (docs/benchmarks.md): not measured
// there since.
#define LITEINFER_GEMV_INT16_INPUTS

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// Levels in 512-bit registers: int8's groups (Int8Vectors) and int4's blocks two a step (dot_rows_int4), both through
// dot_pairs.
#define LITEINFER_GEMV_512
#endif

struct Int16Inputs {
  // x[i] ≈ levels[i] * scales[i / kGroup]; int4's order (int16_inputs' `int4_pairs`) holds each pair of blocks of
  // 64 as its four sixteens of inputs, each the first block's beside the second's.
  std::vector<int16_t> levels;
  std::vector<float> scales;
  // Per group of 32 inputs (int8's and int4's): its levels' scale (its group of 64's), and its sum of levels times
  // that scale (the sum of x as rounded); zero past the last group up to a multiple of 16, so that int8 loads them a
  // chunk at a time.
  std::vector<float> group_scales;
  std::vector<float> sums;
};

template <typename scalar_t>
inline Int16Inputs int16_inputs(const scalar_t* x, int64_t k, bool int4_pairs) {
  const int64_t groups = (k + kGroup - 1) / kGroup, padded = (k + 16 * kInt8Group - 1) / (16 * kInt8Group) * 16;
  Int16Inputs inputs{std::vector<int16_t>(k), std::vector<float>(groups), std::vector<float>(padded),
                     std::vector<float>(padded)};
  const std::vector<float> x_float(x, x + k);
  const float* xf = x_float.data();
  int16_t* levels = inputs.levels.data();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = g * kGroup, end = std::min(k, begin + kGroup);
    float largest = 0.f;
    for (int64_t i = begin; i < end; ++i) largest = std::max(largest, std::fabs(xf[i]));
    inputs.scales[g] = largest / 32767.f;
    const float inverse = largest > 0.f ? 32767.f / largest : 0.f;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {  // (the compiler leaves lrintf's loop scalar)
      const __m256i rounded = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xf + i), _mm256_set1_ps(inverse)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(levels + i),
                       _mm_packs_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
    }
    for (; i < end; ++i) levels[i] = static_cast<int16_t>(std::lrintf(xf[i] * inverse));
    for (int64_t half = begin; half < end; half += kInt8Group) {
      int32_t sum = 0;
      for (i = half; i < std::min(end, half + kInt8Group); ++i) sum += levels[i];
      inputs.group_scales[half / kInt8Group] = inputs.scales[g];
      inputs.sums[half / kInt8Group] = static_cast<float>(sum) * inputs.scales[g];
    }
  }
  if (int4_pairs) {
    for (int64_t pair = 0; pair + 2 * kGroup <= k; pair += 2 * kGroup) {
      int16_t reordered[2 * kGroup];
      for (int n = 0; n < 4; ++n)
        for (int b = 0; b < 2; ++b) std::copy_n(levels + pair + b * kGroup + 16 * n, 16, reordered + 32 * n + 16 * b);
      std::copy_n(reordered, 2 * kGroup, levels + pair);
    }
  }
  return inputs;
}

// acc + sixteen weight levels times sixteen x levels, summed in pairs: eight int32.
inline __m256i multiply_add(__m256i acc, __m256i weights, const int16_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, weights, xv);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(weights, xv));
#endif
}

#if defined(LITEINFER_GEMV_512)
// acc + 32 weight levels times 32 x levels, summed in pairs: sixteen int32.
inline __m512i dot_pairs(__m512i acc, __m512i weights, const int16_t* x) {
  const __m512i xv = _mm512_loadu_si512(x);
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, weights, xv);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(weights, xv));
#endif
}
#endif

// int8's vector operations, in the widest registers there are: a group's 32 levels as 16-bit integers, the products
// with x's levels summed in pairs into int32 lanes, then in fp32; and `chunk` groups' scales or zeros widened from
// fp16 (int4's: from x's dtype) at once, zero past `count`. (Zeroing, adding and summing a vector: the float rows'
// zero, add and reduce.)
#if defined(LITEINFER_GEMV_512)
// A group in one 512-bit register: on the Intel Xeon this ran SmolLM2's int8 linears 10-25% faster at one row and
// 5-10% at 32 than two 256-bit halves (docs/benchmarks.md).
struct Int8Vectors {
  using Float = __m512;
  using Levels = __m512i;
  static constexpr int64_t chunk = 16;
  static Levels load(const int8_t* w) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  }
  static Float dot(Levels w, const int16_t* x) { return _mm512_cvtepi32_ps(dot_pairs(_mm512_setzero_si512(), w, x)); }
  template <typename T>
  static Float widen(const T* v, int64_t count) {
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    if constexpr (std::is_same_v<T, float>) {
      return _mm512_maskz_loadu_ps(mask, v);
    } else {
      const __m256i bits = _mm256_maskz_loadu_epi16(mask, v);
      if constexpr (std::is_same_v<T, at::Half>) return _mm512_cvtph_ps(bits);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));  // bf16: fp32's top half
    }
  }
  static Float load(const float* v) { return _mm512_loadu_ps(v); }
  static void store(float* v, Float a) { _mm512_storeu_ps(v, a); }
  static Float broadcast(float v) { return _mm512_set1_ps(v); }
  static Float mul(Float a, Float b) { return _mm512_mul_ps(a, b); }
  static Float fma(Float a, Float b, Float c) { return _mm512_fmadd_ps(a, b, c); }
};
#else
struct Int8Vectors {
  using Float = __m256;
  struct Levels {
    __m256i first, second;  // inputs 0-15, 16-31
  };
  static constexpr int64_t chunk = 8;
  static Levels load(const int8_t* w) {
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))),
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)))};
  }
  static Float dot(const Levels& w, const int16_t* x) {
    return _mm256_cvtepi32_ps(multiply_add(multiply_add(_mm256_setzero_si256(), w.first, x), w.second, x + 16));
  }
  // Eight 16-bit values in fp32: fp16 converted, bf16 as fp32's top half.
  static Float widen_bits(__m128i bits, const at::Half*) { return _mm256_cvtph_ps(bits); }
  static Float widen_bits(__m128i bits, const c10::BFloat16*) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  // A row's last chunk (count < 8) is read by masked loads (`first_lanes`), an odd last 16-bit value blended in:
  // nothing past v[count - 1], which may be the tensor's end. SmolLM2's rows of 576 inputs end in a chunk of 2
  // groups; read through a copy, the wait on its stores held ~30% of a one-row int4 call's samples on the AMD Zen 3,
  // and the engine's one-request int8 and int4 steps took 4-6% less time without it (docs/benchmarks.md).
  template <typename T>
  static Float widen(const T* v, int64_t count) {
    const int32_t n = static_cast<int32_t>(count);
    if constexpr (std::is_same_v<T, float>) {
      return n == chunk ? _mm256_loadu_ps(v) : _mm256_maskload_ps(v, first_lanes(n));
    } else {
      if (n == chunk) return widen_bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)), v);
      __m128i bits = _mm_maskload_epi32(reinterpret_cast<const int*>(v), _mm256_castsi256_si128(first_lanes(n / 2)));
      if (n % 2) {
        int16_t last;
        std::memcpy(&last, v + n - 1, sizeof(last));
        const __m128i position = _mm_cmpeq_epi16(_mm_set1_epi16(static_cast<int16_t>(n - 1)),
                                                  _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
        bits = _mm_blendv_epi8(bits, _mm_set1_epi16(last), position);
      }
      return widen_bits(bits, v);
    }
  }
  static Float load(const float* v) { return _mm256_loadu_ps(v); }
  static void store(float* v, Float a) { _mm256_storeu_ps(v, a); }
  static Float broadcast(float v) { return _mm256_set1_ps(v); }
  static Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
  static Float fma(Float a, Float b, Float c) { return _mm256_fmadd_ps(a, b, c); }
};
#endif

// What the quantized rows' dot products leave per row of W and of x: a vector of partial sums. Against one row of x,
// `quantized_tile` adds up kRowsSummed rows of W's at once (`sum_rows`: one transpose, where each row's own horizontal
// sum was a chain of shuffles and adds that held its row's end: on the AMD Zen 3 SmolLM2's int4 one-row calls took
// 7-10% less time in cache and ~4% from memory; int8's, at the read ceiling, as long as before), each lane in the
// order `sum_row` adds one row's, so that a row's result does not depend on the rows summed beside it. (Against a
// tile of four rows of x, each row of W already ends in four sums; gathering four rows of W's there was 1-11% slower.)
using RowSums = Int8Vectors::Float;

inline __m256 lanes_folded(__m256 v) { return v; }
#if defined(LITEINFER_GEMV_512)
inline __m256 lanes_folded(__m512 v) {  // lane i + 8 added to lane i
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

inline float sum_row(RowSums v) { return reduce(lanes_folded(v)); }

// `reduce`'s order for four rows at once: lanes i and i + 4, then i and i + 2, then i and i + 1.
inline void sum_rows(const RowSums* rows, float* out) {
  const __m256 a = lanes_folded(rows[0]), b = lanes_folded(rows[1]), c = lanes_folded(rows[2]),
               d = lanes_folded(rows[3]);
  // [a's four lane sums, b's], [c's, d's]
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
  // [a0 + a2, c0 + c2, a1 + a3, c1 + c3, the same of b and d]
  const __m256 pairs = _mm256_add_ps(_mm256_unpacklo_ps(ab, cd), _mm256_unpackhi_ps(ab, cd));
  const __m256 sums = _mm256_add_ps(pairs, _mm256_permute_ps(pairs, 0b01001110));  // lanes 0, 1, 4, 5: a, c, b, d
  _mm_storeu_ps(out, _mm256_castps256_ps128(_mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0))));
}

// The sums of one row of int8 weights (q s + z per group) times each of R rows of x, as sum of s (q · x) + z (sum
// of x) over the groups. A chunk of groups at a time, their scales and zeros are widened in one vector each: the
// zeros times x's sums go into a vector per row of x, and the scales times x's scales are the factors of the
// groups' integer sums. The weight levels are widened once for all R rows (a tile of x's rows, where there are
// several), and each row of x gets the same operations in the same order whatever R is: a row's result does not
// depend on the rows beside it. Each chunk asks for its levels' lines kInt8PrefetchAhead bytes on: a thread's share
// of a linear is one stream of ~0.1-1 MB that the hardware prefetcher alone follows too slowly, each call starting
// it afresh (on the AMD Zen 3, SmolLM2's 121 int8 one-row calls took 16% less time with it, the engine's one-request
// step 9% less; docs/benchmarks.md).
constexpr int64_t kInt8PrefetchAhead = 2048;

template <int R>
inline void dot_rows_int8(const int8_t* w, const Int16Inputs* const* inputs, const at::Half* scales,
                          const at::Half* zeros, int64_t groups, RowSums* out) {
  using V = Int8Vectors;
  typename V::Float total[R], offsets[R];
  for (int r = 0; r < R; ++r) total[r] = offsets[r] = zero(typename V::Float{});
  for (int64_t g0 = 0; g0 < groups; g0 += V::chunk) {
    const int64_t count = std::min(V::chunk, groups - g0);
    const typename V::Float s = V::widen(scales + g0, count), z = V::widen(zeros + g0, count);
    alignas(64) float factors[R][V::chunk];
    for (int r = 0; r < R; ++r) {
      V::store(factors[r], V::mul(s, V::load(inputs[r]->group_scales.data() + g0)));
      offsets[r] = V::fma(z, V::load(inputs[r]->sums.data() + g0), offsets[r]);
    }
    // An address, not a pointer into W: in W's last rows it runs past W's end, where a prefetch does not fault.
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(w + g0 * kInt8Group) + kInt8PrefetchAhead;
    for (int64_t line = 0; line < count * kInt8Group; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
    for (int64_t j = 0; j < count; ++j) {
      const typename V::Levels levels = V::load(w + (g0 + j) * kInt8Group);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int16_t* x = inputs[r]->levels.data() + (g0 + j) * kInt8Group;
        total[r] = V::fma(V::dot(levels, x), V::broadcast(factors[r][j]), total[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = add(total[r], offsets[r]);
}

// A row of int4 weights times each of R rows of x: sum of ((q - 8) s + z) x over its groups, as sum of s (q · x) +
// (z - 8 s) (sum of x); each block of 64 inputs holds two groups (nibbles 0-1 of its lanes the first, 2-3 the
// second). As int8's rows do, a chunk of groups' scales and zeros is widened at once into the groups' factors and
// the offsets, and each row of x gets the same operations whatever R is. A block costs its levels' shifts and masks
// (once for the R rows), and per row its integer products, two conversions and two multiply-adds (one chain per
// group of the block); scalar conversions and sums per group had made int4 bound by its instructions rather than
// its bytes (docs/benchmarks.md).
template <int R, typename scale_t>
inline void dot_rows_int4(const uint8_t* w, const Int16Inputs* const* inputs, const scale_t* scales,
                          const scale_t* zeros, int64_t groups, RowSums* out) {
  using V = Int8Vectors;
  const __m256i nibble = _mm256_set1_epi16(0xF);
  __m256 first[R], second[R];  // the s (q · x) terms of each block's groups
  typename V::Float offsets[R];
  for (int r = 0; r < R; ++r) {
    first[r] = second[r] = _mm256_setzero_ps();
    offsets[r] = zero(typename V::Float{});
  }
#if defined(LITEINFER_GEMV_512)
  __m512 wide_first[R], wide_second[R];
  for (int r = 0; r < R; ++r) wide_first[r] = wide_second[r] = _mm512_setzero_ps();
#endif
  for (int64_t g0 = 0; g0 < groups; g0 += V::chunk) {
    const int64_t count = std::min(V::chunk, groups - g0);
    const typename V::Float s = V::widen(scales + g0, count);
    const typename V::Float z = V::fma(s, V::broadcast(-8.f), V::widen(zeros + g0, count));
    alignas(64) float factors[R][V::chunk];
    for (int r = 0; r < R; ++r) {
      V::store(factors[r], V::mul(s, V::load(inputs[r]->group_scales.data() + g0)));
      offsets[r] = V::fma(z, V::load(inputs[r]->sums.data() + g0), offsets[r]);
    }
    int64_t j = 0;
#if defined(LITEINFER_GEMV_512)
    // Two blocks a step (groups g0 + j .. g0 + j + 3): nibble n of 32 lanes, the first block's 16 beside the
    // second's, against x's levels in the same order; the sums of groups j and j + 2 share a register, as do j + 1
    // and j + 3, each half scaled by its own group's factor.
    const __m512i nibble512 = _mm512_set1_epi16(0xF), halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2,
                                                                                  2, 2, 2, 2);
    for (; j + 4 <= count; j += 4) {
      const __m512i lanes = _mm512_loadu_si512(w + (g0 + j) * kInt4Group / 2);
      const __m512i v0 = _mm512_and_si512(lanes, nibble512);
      const __m512i v1 = _mm512_and_si512(_mm512_srli_epi16(lanes, 4), nibble512);
      const __m512i v2 = _mm512_and_si512(_mm512_srli_epi16(lanes, 8), nibble512);
      const __m512i v3 = _mm512_srli_epi16(lanes, 12);
      const __m512i first_groups = _mm512_add_epi32(halves, _mm512_set1_epi32(static_cast<int32_t>(j)));
      const __m512i second_groups = _mm512_add_epi32(first_groups, _mm512_set1_epi32(1));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int16_t* x = inputs[r]->levels.data() + (g0 + j) * kInt4Group;
        const __m512 f = _mm512_load_ps(factors[r]);
        const __m512i sum0 = dot_pairs(dot_pairs(_mm512_setzero_si512(), v0, x), v1, x + 32);
        const __m512i sum1 = dot_pairs(dot_pairs(_mm512_setzero_si512(), v2, x + 64), v3, x + 96);
        wide_first[r] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum0), _mm512_permutexvar_ps(first_groups, f), wide_first[r]);
        wide_second[r] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum1), _mm512_permutexvar_ps(second_groups, f), wide_second[r]);
      }
    }
#endif
    for (; j < count; j += 2) {  // the block of groups g0 + j and g0 + j + 1 (with pairs: a row's last, alone)
      const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g0 + j) * kInt4Group / 2));
      const __m256i w0 = _mm256_and_si256(lanes, nibble), w1 = _mm256_and_si256(_mm256_srli_epi16(lanes, 4), nibble);
      const __m256i w2 = _mm256_and_si256(_mm256_srli_epi16(lanes, 8), nibble), w3 = _mm256_srli_epi16(lanes, 12);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int16_t* x = inputs[r]->levels.data() + (g0 + j) * kInt4Group;
        const __m256i sum0 = multiply_add(multiply_add(_mm256_setzero_si256(), w0, x), w1, x + 16);
        const __m256i sum1 = multiply_add(multiply_add(_mm256_setzero_si256(), w2, x + 32), w3, x + 48);
        first[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum0), _mm256_set1_ps(factors[r][j]), first[r]);
        second[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum1), _mm256_set1_ps(factors[r][j + 1]), second[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 blocks = _mm256_add_ps(first[r], second[r]);
#if defined(LITEINFER_GEMV_512)
    out[r] = _mm512_add_ps(_mm512_add_ps(offsets[r], _mm512_add_ps(wide_first[r], wide_second[r])),
                           _mm512_zextps256_ps512(blocks));
#else
    out[r] = _mm256_add_ps(offsets[r], blocks);
#endif
  }
}
#else
// The portable forms, in fp32 against x as given: a row's sum in one float.
using RowSums = float;
inline float sum_row(float v) { return v; }
inline void sum_rows(const float* rows, float* out) { std::copy_n(rows, kRowsSummed, out); }

template <int R>
inline void dot_rows_int8(const int8_t* w, const float* const* x, const at::Half* scales, const at::Half* zeros,
                          int64_t groups, RowSums* out) {
  for (int r = 0; r < R; ++r) {
    float sum = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = static_cast<float>(scales[g]), zero = static_cast<float>(zeros[g]);
      for (int64_t i = g * kInt8Group; i < (g + 1) * kInt8Group; ++i) sum += (w[i] * scale + zero) * x[r][i];
    }
    out[r] = sum;
  }
}

template <int R, typename scale_t>
inline void dot_rows_int4(const uint8_t* w, const float* const* x, const scale_t* scales, const scale_t* zeros,
                          int64_t groups, RowSums* out) {
  for (int r = 0; r < R; ++r) {
    float sum = 0.f;
    for (int64_t i = 0; i < groups * kInt4Group; ++i) {  // input i of its block: lane i % 16, nibble i / 16
      const int64_t g = i / kInt4Group, in_block = i % kGroup;
      const uint8_t byte = w[i / kGroup * kGroup / 2 + 2 * (in_block % 16) + in_block / 32];
      const int q = in_block / 16 % 2 ? byte >> 4 : byte & 0xF;
      sum += ((q - 8) * static_cast<float>(scales[g]) + static_cast<float>(zeros[g])) * x[r][i];
    }
    out[r] = sum;
  }
}
#endif

// A row of x as the quantized rows read it: rounded to 16-bit levels (x86), or widened to fp32 (otherwise); `row_ref`
// is what their dot products take.
#if defined(LITEINFER_GEMV_INT16_INPUTS)
using RowInputs = Int16Inputs;
template <typename scalar_t>
RowInputs row_inputs(const scalar_t* x, int64_t k, bool int4) {
#if defined(LITEINFER_GEMV_512)
  return int16_inputs(x, k, int4);
#else
  return int16_inputs(x, k, false);
#endif
}
inline const Int16Inputs* row_ref(const RowInputs& row) { return &row; }
#else
using RowInputs = std::vector<float>;
template <typename scalar_t>
RowInputs row_inputs(const scalar_t* x, int64_t k, bool) { return RowInputs(x, x + k); }
inline const float* row_ref(const RowInputs& row) { return row.data(); }
#endif
using RowRef = decltype(row_ref(std::declval<const RowInputs&>()));

template <typename out_t>
inline out_t output(float v, const out_t* bias, int64_t row) {
  return static_cast<out_t>(bias ? v + static_cast<float>(bias[row]) : v);
}

// Each thread's share of a float W is cut into this many equal parts, and row i of every part is summed at once
// (`gemv_rows`): the thread reads W as four streams. On the AMD Zen 3 one stream a thread ran at 19-22 GB/s and two
// or four at 27-30 (the hardware prefetcher, started afresh at each call, follows one stream too slowly alone):
// SmolLM2's 121 fp32 one-row linears took ~28% less time, the compiled one-request fp32 step ~19% less. Rows side by
// side in W (eight, as this kernel once read them) are one stream, and were slower (docs/benchmarks.md).
constexpr int kStreams = 4;

// y[row] = W[row]·x (+ bias[row]) for float W [n, k]: each thread takes a contiguous share of W's rows, cut into
// kStreams parts read side by side (row i of every part at once), then the rows a cut leaves over, one at a time.
template <typename scalar_t>
void gemv_rows(const scalar_t* w, const scalar_t* x, int64_t k, const scalar_t* bias, scalar_t* y, int64_t n) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    const int64_t part = (end - begin) / kStreams;
    for (int64_t row = begin; row < begin + part; ++row) {
      float sums[kStreams];
      dot_rows<kStreams>(w + row * k, part * k, x, k, sums);
      for (int s = 0; s < kStreams; ++s) y[row + s * part] = output(sums[s], bias, row + s * part);
    }
    for (int64_t row = begin + kStreams * part; row < end; ++row) {
      float sum;
      dot_rows<1>(w + row * k, 0, x, k, &sum);
      y[row] = output(sum, bias, row);
    }
  });
}

// The quantized weights as the loops below read them: a row's dot products with R rows of x (`dot`), and for the
// AMX tiles, a row's scales and zeros (in `scale_t`), the offset of its levels (a weight is (q + offset) s + z) and
// 16 of its levels as int32 (group g, inputs 16 * half on).
struct Int8Rows {
  using scale_t = at::Half;
  static constexpr float offset = 0.f;
  const int8_t* w;
  const at::Half* scales_and_zeros;  // [n, 2, groups]
  int64_t k;
  int64_t groups() const { return k / kInt8Group; }
  const at::Half* scales(int64_t row) const { return scales_and_zeros + row * groups() * 2; }
  // Where a row's levels start, and the bytes a row takes (rows lie one after another).
  const void* levels_of(int64_t row) const { return w + row * k; }
  int64_t level_bytes() const { return k; }
  template <int R>
  void dot(int64_t row, const RowRef* x, RowSums* out) const {
    dot_rows_int8<R>(w + row * k, x, scales(row), scales(row) + groups(), groups(), out);
  }
#if defined(__AVX512F__)
  __m512i levels(int64_t row, int64_t g, int half) const {
    const int8_t* q = w + row * k + g * kInt8Group + 16 * half;
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  }
#endif
#if defined(LITEINFER_PACKED_AVX2)
  __m256i levels16(int64_t row, int64_t g, int half) const {  // as `levels`, in 16-bit lanes
    const int8_t* q = w + row * k + g * kInt8Group + 16 * half;
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  }
#endif
#if defined(__AVX512BF16__)
  __m512i bf16_levels(int64_t row, int64_t g) const {  // group g's 32 levels as bf16 (exact: 8 significant bits)
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(levels(row, g, 1)), _mm512_cvtepi32_ps(levels(row, g, 0)));
  }
#endif
};

template <typename scale_type>
struct Int4Rows {
  using scale_t = scale_type;
  static constexpr float offset = -8.f;
  const uint8_t* w;  // [n, k / 2] in gemv_int4_layout
  const scale_t* scales_and_zeros;  // [n, 2, groups]
  int64_t k;
  int64_t groups() const { return k / kInt4Group; }
  const scale_t* scales(int64_t row) const { return scales_and_zeros + row * groups() * 2; }
  const void* levels_of(int64_t row) const { return w + row * k / 2; }
  int64_t level_bytes() const { return k / 2; }
  template <int R>
  void dot(int64_t row, const RowRef* x, RowSums* out) const {
    dot_rows_int4<R>(w + row * k / 2, x, scales(row), scales(row) + groups(), groups(), out);
  }
#if defined(__AVX2__)
  __m256i levels16(int64_t row, int64_t g, int half) const {  // nibble 2 (g % 2) + half of the block's lanes
    const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + row * k / 2 + g / 2 * kGroup / 2));
    return _mm256_and_si256(_mm256_srli_epi16(lanes, 4 * (2 * (g % 2) + half)), _mm256_set1_epi16(0xF));
  }
#endif
#if defined(__AVX512F__)
  __m512i levels(int64_t row, int64_t g, int half) const { return _mm512_cvtepu16_epi32(levels16(row, g, half)); }
#endif
#if defined(__AVX512BF16__)
  __m512i bf16_levels(int64_t row, int64_t g) const {  // group g's 32 levels - 8 as bf16, looked up in 16-bit lanes
    static const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(
        _mm512_setzero_ps(), _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(levels16(row, g, 0)), levels16(row, g, 1), 1);
    return _mm512_permutexvar_epi16(both, table);
  }
#endif
};

// Quantized weights against m rows of x, y [m, n]. Each thread takes a contiguous share of W's rows, kRowBlock at a
// time, and runs every row of x over a block, kTile rows of x at a time, while the block sits in L1 (16 rows of
// 1,536 int8 inputs: 24 KB); x's rows kRowsPerPass at a time, so that their levels stay in L2 (128 x 1,536 x 2
// bytes: 384 KB). With one row of x this is the GEMV's stream through W, row after row, their sums added up
// kRowsSummed rows at a time.
constexpr int64_t kRowBlock = 16, kRowsPerPass = 128;
constexpr int kTile = 4;

template <int R, typename Weights, typename out_t>
void quantized_tile(const Weights& weights, const RowRef* x, const out_t* bias, out_t* y, int64_t row_begin,
                    int64_t row_end, int64_t n) {
  int64_t row = row_begin;
  if constexpr (R == 1) {
    for (; row + kRowsSummed <= row_end; row += kRowsSummed) {
      RowSums sums[kRowsSummed];
      float totals[kRowsSummed];
      for (int i = 0; i < kRowsSummed; ++i) weights.template dot<1>(row + i, x, sums + i);
      sum_rows(sums, totals);
      for (int i = 0; i < kRowsSummed; ++i) y[row + i] = output(totals[i], bias, row + i);
    }
  }
  for (; row < row_end; ++row) {
    RowSums sums[R];
    weights.template dot<R>(row, x, sums);
    for (int r = 0; r < R; ++r) y[r * n + row] = output(sum_row(sums[r]), bias, row);
  }
}

template <typename Weights, typename out_t>
void quantized_rows(const Weights& weights, const std::vector<RowInputs>& x, const out_t* bias, out_t* y,
                    int64_t n) {
  const int64_t m = static_cast<int64_t>(x.size());
  std::vector<RowRef> refs;
  for (const RowInputs& row : x) refs.push_back(row_ref(row));
  for (int64_t m0 = 0; m0 < m; m0 += kRowsPerPass) {
    const int64_t m_end = std::min(m, m0 + kRowsPerPass);
    at::parallel_for(0, n, kRowBlock, [&](int64_t begin, int64_t end) {
      for (int64_t b0 = begin; b0 < end; b0 += kRowBlock) {
        const int64_t b_end = std::min(end, b0 + kRowBlock);
        int64_t r = m0;
        for (; r + kTile <= m_end; r += kTile)
          quantized_tile<kTile>(weights, refs.data() + r, bias, y + r * n, b0, b_end, n);
        for (; r < m_end; ++r) quantized_tile<1>(weights, refs.data() + r, bias, y + r * n, b0, b_end, n);
      }
    });
  }
}

// A buffer of at least `count` T for this thread, kept between calls (zeroing one each call cost more than the AMX
// tiles), on a cache line's boundary: each 64-byte store into it then writes one whole line, not parts of two.
template <typename T>
T* thread_buffer(size_t count) {
  thread_local std::vector<T> buffer;
  buffer.resize(std::max(buffer.size(), count + 64 / sizeof(T)));
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
}

#if (defined(LITEINFER_PACKED_AVX512) || defined(LITEINFER_PACKED_AVX2)) && defined(LITEINFER_GEMV_INT16_INPUTS)
#define LITEINFER_GEMV_DEQUANTIZED
// Batches of this many rows of x or more meet the weights dequantized (AMX's tiles or the packed ones, below), which
// fewer rows meet in the integer form. On the Intel Xeon, from five rows up both ran at or below the integer form's
// time (the packed tiles in fp32, and in bf16 with AMX left out of the build, as AMD's AVX-512 CPUs have none). On the
// AMD Zen 3 (AVX2: bf16 only), where a packed tile does less a cycle and dequantizing costs more, from sixteen: int4
// gained from twelve rows, int8 from sixteen to twenty-four (docs/benchmarks.md).
#if defined(LITEINFER_PACKED_AVX512)
constexpr int64_t kDequantizedMinRows = 5;
#else
constexpr int64_t kDequantizedMinRows = 16;
#endif

// A row's factors for up to Int8Vectors::chunk groups from g0, for the paths that dequantize W (below): the weight
// is q s + z, z being the group's zero plus the levels' offset times s (both zero past `count`).
template <typename Weights>
inline void dequantizing_factors(const Weights& weights, int64_t row, int64_t g0, int64_t count, float* s, float* z) {
  using V = Int8Vectors;
  const typename Weights::scale_t* scales = weights.scales(row);
  const V::Float scale = V::widen(scales + g0, count);
  V::store(s, scale);
  V::store(z, V::fma(scale, V::broadcast(Weights::offset), V::widen(scales + weights.groups() + g0, count)));
}
#endif

#if defined(LITEINFER_PACKED_AVX512) && defined(LITEINFER_GEMV_INT16_INPUTS)
// 16 weights of a row in fp32, from input 16 * half of group g, at the group's factors s and z.
template <typename Weights>
inline __m512 dequantized16(const Weights& weights, int64_t row, int64_t g, int half, float s, float z) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(weights.levels(row, g, half)), _mm512_set1_ps(s), _mm512_set1_ps(z));
}
#endif

#if defined(LITEINFER_AMX) && defined(LITEINFER_GEMV_INT16_INPUTS) && defined(__AVX512BF16__)
#define LITEINFER_GEMV_AMX
// Rows of x against int8 or int4 weights, on CPUs with AMX, from kDequantizedMinRows rows up, in the transposed
// product y^T = W x^T: W's rows are then the tiles' first operand as they are (a tile: 16 rows of W by one group of
// 32 inputs), and x, small, is what gets rearranged (once a call: its pairs of inputs side by side for 16 rows, the
// second operand's layout). Each thread turns 32 rows of W at a time into bf16 tiles in a buffer in L2. A row's
// result does not depend on the other rows, but differs from the integer form's, which fewer rows take.
//  - bf16 x: W dequantized to bf16 ((q + offset) * scale + zero in fp32, rounded to nearest even: 2^-9, the model's
//    own precision in bf16), summed over all inputs in the tiles; a pass keeps 2 x 2 tiles of sums, 32 rows of W by
//    32 rows of x.
//  - fp32 x, to fp32's accuracy: an fp32 value is exactly the sum of three bf16 values (its top 8 significant bits,
//    the next 8, the last 8), a level q + offset is exactly a bf16 value (int8: -128..127, int4: -8..7), and a
//    product of two bf16 values is exact in fp32. So W's tiles hold its levels, x's three parts each make a second
//    operand, and a group's three products are summed in the tiles in fp32; the group's scale and zero then meet
//    those sums in fp32, s * sum(level x) + z * sum(x), where they would have rounded each weight. It replaced the
//    packed fp32 tiles over dequantized W here: SmolLM2's int4 linears at 16 and 32 rows in ~0.75x their time
//    (docs/benchmarks.md).
constexpr int64_t kAmxBlock = 16;
constexpr int64_t kAmxTile = kAmxBlock * kInt8Group;  // elements of a tile of W: 16 rows by a group of 32 inputs

// x [m, k] bf16 as tiles of 16 rows (the last zero-padded): for each pair of inputs, the 16 rows' pairs side by side.
// Past 128 rows the threads share the tiles, and nothing is zeroed first (every element is written): done by one
// thread into a zeroed vector, int8 prompt steps of 512-2,048 tokens took 1.09-1.15x their time (docs/benchmarks.md).
std::unique_ptr<int32_t[]> amx_x_pairs(const c10::BFloat16* x, int64_t m, int64_t k) {
  const int64_t tiles = (m + kAmxBlock - 1) / kAmxBlock, pairs = k / 2;
  std::unique_ptr<int32_t[]> out(new int32_t[tiles * pairs * kAmxBlock]);
  const int32_t* x_pairs = reinterpret_cast<const int32_t*>(x);
  const __m512i row_offsets =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int32_t>(pairs)));
  at::parallel_for(0, tiles, kRowsPerPass / kAmxBlock, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const __mmask16 valid = static_cast<__mmask16>((1u << std::min(kAmxBlock, m - t * kAmxBlock)) - 1);
      const int32_t* rows = x_pairs + t * kAmxBlock * pairs;
      for (int64_t p = 0; p < pairs; ++p)
        _mm512_storeu_si512(out.get() + (t * pairs + p) * kAmxBlock,
                            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, row_offsets, rows + p, 4));
    }
  });
  return out;
}

// x as the tiles' second operand: bf16 x itself; fp32 x as its three bf16 parts, with each row's sum over each group
// of inputs (the zeros' factor).
template <typename x_t>
struct AmxInputs;

template <>
struct AmxInputs<c10::BFloat16> {
  std::unique_ptr<int32_t[]> pairs;
  AmxInputs(const c10::BFloat16* x, int64_t m, int64_t k) : pairs(amx_x_pairs(x, m, k)) {}
};

template <>
struct AmxInputs<float> {
  static constexpr int kParts = 3;
  std::unique_ptr<int32_t[]> parts[kParts];
  std::unique_ptr<float[]> group_sums;  // [tile of 16 rows][group][16 rows]: zero past m
  AmxInputs(const float* x, int64_t m, int64_t k) {
    const int64_t groups = k / kInt8Group, tiles = (m + kAmxBlock - 1) / kAmxBlock;
    // parts[p][r * k + i]: x[r, i]'s part p. Each part keeps the top half of what the parts before left (a
    // truncation, so every subtraction is exact and the rest fits the next part).
    std::unique_ptr<c10::BFloat16[]> split(new c10::BFloat16[kParts * m * k]);
    group_sums.reset(new float[tiles * groups * kAmxBlock]());
    at::parallel_for(0, m, kAmxBlock, [&](int64_t begin, int64_t end) {
      const __m512i top = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
      for (int64_t r = begin; r < end; ++r)
        for (int64_t i = 0; i < k; i += 16) {
          __m512 rest = _mm512_loadu_ps(x + r * k + i);
          for (int p = 0; p < kParts; ++p) {
            const __m512i bits = _mm512_and_si512(_mm512_castps_si512(rest), top);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(split.get() + (p * m + r) * k + i),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
            rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(bits));
          }
        }
      for (int64_t r = begin; r < end; ++r)
        for (int64_t g = 0; g < groups; ++g) {
          const float* v = x + r * k + g * kInt8Group;
          group_sums[(r / kAmxBlock * groups + g) * kAmxBlock + r % kAmxBlock] =
              _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16)));
        }
    });
    for (int p = 0; p < kParts; ++p) parts[p] = amx_x_pairs(split.get() + p * m * k, m, k);
  }
};

// Rows [row0, row0 + 32) of W (those past n as zeros) dequantized to bf16, as tiles: for each group of 32 inputs, the
// 16 rows of each block of 16 side by side ([block][group][16][32]). While a row is dequantized, the same row of the
// next 32 (below `prefetch_end`) is requested into L2, a line every line's worth of groups: without it the
// conversions waited on the levels' loads (the hardware's prefetcher alone, ~7 GB/s a core), and SmolLM2's int8
// linears at 16 and 32 rows took ~1.2x their time, int4 ~1.1x (docs/benchmarks.md).
template <typename Weights>
void amx_dequantize(const Weights& weights, int64_t row0, int64_t n, int64_t prefetch_end, c10::BFloat16* out) {
  constexpr int64_t rows = 2 * kAmxBlock;
  const int64_t groups = weights.groups(), group_bytes = weights.level_bytes() / groups;
  for (int64_t i = 0; i < rows; ++i) {
    c10::BFloat16* tile_row = out + i / kAmxBlock * groups * kAmxTile + i % kAmxBlock * kInt8Group;
    const int64_t row = row0 + i;
    if (row >= n) {
      for (int64_t g = 0; g < groups; ++g) _mm512_storeu_si512(tile_row + g * kAmxTile, _mm512_setzero_si512());
      continue;
    }
    const char* next = row + rows < prefetch_end ? static_cast<const char*>(weights.levels_of(row + rows)) : nullptr;
    for (int64_t g0 = 0; g0 < groups; g0 += Int8Vectors::chunk) {
      const int64_t count = std::min(Int8Vectors::chunk, groups - g0);
      alignas(64) float s[Int8Vectors::chunk], z[Int8Vectors::chunk];
      dequantizing_factors(weights, row, g0, count, s, z);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t offset = (g0 + j) * group_bytes;
        if (next != nullptr && offset % liteinfer::packed::LINE == 0) _mm_prefetch(next + offset, _MM_HINT_T1);
        const __m512 first = dequantized16(weights, row, g0 + j, 0, s[j], z[j]),
                     second = dequantized16(weights, row, g0 + j, 1, s[j], z[j]);
        _mm512_storeu_si512(tile_row + (g0 + j) * kAmxTile, (__m512i)_mm512_cvtne2ps_pbh(second, first));
      }
    }
  }
}

// Group g of rows [row0, row0 + 32) of W (those past n as zeros) as two tiles of their levels (block b at tiles + b *
// kAmxTile), converted just before the tiles take them (in L1); the same row of the next 32 (below `prefetch_end`)
// requested into L2 a line every line's worth of groups, as amx_dequantize does.
template <typename Weights>
void amx_level_tiles(const Weights& weights, int64_t row0, int64_t n, int64_t g, int64_t prefetch_end,
                     c10::BFloat16* tiles) {
  const int64_t offset = g * (weights.level_bytes() / weights.groups());
  const bool prefetch = offset % liteinfer::packed::LINE == 0;
  for (int64_t i = 0; i < 2 * kAmxBlock; ++i) {
    const int64_t row = row0 + i;
    __m512i levels = _mm512_setzero_si512();
    if (row < n) {
      levels = weights.bf16_levels(row, g);
      if (prefetch && row + 2 * kAmxBlock < prefetch_end)
        _mm_prefetch(static_cast<const char*>(weights.levels_of(row + 2 * kAmxBlock)) + offset, _MM_HINT_T1);
    }
    _mm512_store_si512(tiles + i * kInt8Group, levels);
  }
}

// The scales and zeros of rows [row0, row0 + 32) of W in fp32, [row][scales, then zeros][group] (zeros past n),
// for the fp32 path's sums.
template <typename Weights>
void amx_factors(const Weights& weights, int64_t row0, int64_t n, int64_t prefetch_end, float* out) {
  const int64_t groups = weights.groups();
  for (int64_t i = 0; i < 2 * kAmxBlock; ++i) {
    float* row_factors = out + i * 2 * groups;
    if (row0 + i >= n) {
      std::fill_n(row_factors, 2 * groups, 0.f);
      continue;
    }
    const typename Weights::scale_t* scales = weights.scales(row0 + i);
    if (row0 + i + 2 * kAmxBlock < prefetch_end) {  // the same row of the next 32, as amx_dequantize does its levels
      const char* next = reinterpret_cast<const char*>(weights.scales(row0 + i + 2 * kAmxBlock));
      for (int64_t b = 0; b < 2 * groups * static_cast<int64_t>(sizeof(*scales)); b += liteinfer::packed::LINE)
        _mm_prefetch(next + b, _MM_HINT_T1);
    }
    for (int64_t g0 = 0; g0 < 2 * groups; g0 += 16) {  // a row's scales and zeros lie side by side
      const int64_t count = std::min<int64_t>(16, 2 * groups - g0);
      _mm512_mask_storeu_ps(row_factors + g0, static_cast<__mmask16>((1u << count) - 1),
                            Int8Vectors::widen(scales + g0, count));
    }
  }
}

// y rows [r0, min(m, r0 + 16 XT)) at outputs [row0, row0 + 32) from sums [2 blocks of W + 2 x tile][row of W][row of
// x], plus the bias.
template <int XT, typename x_t>
void amx_store(const float (*sums)[kAmxBlock][kAmxBlock], const x_t* bias, x_t* y, int64_t row0, int64_t r0,
               int64_t m, int64_t n) {
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  for (int t = 0; t < XT; ++t)
    for (int64_t r = 0; r < std::min(kAmxBlock, m - r0 - t * kAmxBlock); ++r)
      for (int b = 0; b < 2; ++b) {
        const int64_t out0 = row0 + b * kAmxBlock;
        if (out0 >= n) continue;
        const int64_t outputs = std::min(kAmxBlock, n - out0);
        const __mmask16 valid = static_cast<__mmask16>((1u << outputs) - 1);
        __m512 v = _mm512_i32gather_ps(column, &sums[2 * t + b][0][r], 4);
        if (bias) v = _mm512_add_ps(v, Int8Vectors::widen(bias + out0, outputs));
        x_t* out = y + (r0 + t * kAmxBlock + r) * n + out0;
        if constexpr (std::is_same_v<x_t, float>)
          _mm512_mask_storeu_ps(out, valid, v);
        else
          _mm256_mask_storeu_epi16(out, valid, (__m256i)_mm512_cvtneps_pbh(v));
      }
}

// bf16: y for the 2 x XT tiles of sums, 32 rows of W (from row0) by XT tiles of 16 rows of x (from r0).
template <int XT>
void amx_pass(const c10::BFloat16* weights, const AmxInputs<c10::BFloat16>& x, int64_t groups,
              const c10::BFloat16* bias, c10::BFloat16* y, int64_t row0, int64_t r0, int64_t m, int64_t n) {
  constexpr int64_t tile_bytes = 64;
  const int32_t* x_pairs = x.pairs.get() + r0 / kAmxBlock * groups * kAmxTile / 2;
  const int64_t x_tile = groups * kAmxTile / 2;  // int32 pairs per 16 rows of x
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (XT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(4, weights + g * kAmxTile, tile_bytes);
    _tile_loadd(5, weights + (groups + g) * kAmxTile, tile_bytes);
    _tile_loadd(6, x_pairs + g * kAmxTile / 2, tile_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (XT == 2) {
      _tile_loadd(7, x_pairs + x_tile + g * kAmxTile / 2, tile_bytes);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[4][kAmxBlock][kAmxBlock];  // [W block + 2 x tile][row of W][row of x]
  _tile_stored(0, sums[0], tile_bytes);
  _tile_stored(1, sums[1], tile_bytes);
  if constexpr (XT == 2) {
    _tile_stored(2, sums[2], tile_bytes);
    _tile_stored(3, sums[3], tile_bytes);
  }
  amx_store<XT>(sums, bias, y, row0, r0, m, n);
}

// fp32: y for the 2 x XT tiles of sums, 32 rows of W (from row0, `factors` from amx_factors) by XT tiles of 16 rows
// of x (from r0). Group g's level tiles are at levels + (g % ring) * 2 kAmxTile, converted there first when
// `convert` (the first pass over these rows of W). A group's sums leave the tiles for its scales and zeros, into
// totals kept in L1; group g's are taken after g + 1's products are under way, so that the vector work and the
// tiles' overlap. x's three parts take turns in the second operand's tiles, so that each tile of sums meets a part's
// product while the others take theirs (a product waits on the one before it in the same tile).
template <int XT, typename Weights>
void amx_pass(const Weights& weights, bool convert, c10::BFloat16* levels, int64_t ring, const float* factors,
              const AmxInputs<float>& x, const float* bias, float* y, int64_t row0, int64_t r0, int64_t m, int64_t n,
              int64_t prefetch_end) {
  constexpr int64_t tile_bytes = 64;
  const int64_t groups = weights.groups();
  const int64_t x_offset = r0 / kAmxBlock * groups * kAmxTile / 2, x_tile = groups * kAmxTile / 2;
  const float* group_sums = x.group_sums.get() + r0 / kAmxBlock * groups * kAmxBlock;
  alignas(64) float totals[2 * XT][kAmxBlock][kAmxBlock] = {};  // [W block + 2 x tile][row of W][row of x]
  alignas(64) float sums[2][2 * XT][kAmxBlock][kAmxBlock];  // group g's in sums[g % 2]
  auto add_group = [&](int64_t g) {
    for (int t = 0; t < XT; ++t) {
      const __m512 x_sums = _mm512_loadu_ps(group_sums + (t * groups + g) * kAmxBlock);
      for (int b = 0; b < 2; ++b)
        for (int i = 0; i < kAmxBlock; ++i) {
          const float* f = factors + (b * kAmxBlock + i) * 2 * groups;
          __m512 total = _mm512_load_ps(totals[2 * t + b][i]);
          total = _mm512_fmadd_ps(_mm512_set1_ps(f[g]), _mm512_load_ps(sums[g % 2][2 * t + b][i]), total);
          _mm512_store_ps(totals[2 * t + b][i], _mm512_fmadd_ps(_mm512_set1_ps(f[groups + g]), x_sums, total));
        }
    }
  };
  auto tiles_of = [&](int64_t g) { return levels + g % ring * 2 * kAmxTile; };
  if (convert) amx_level_tiles(weights, row0, n, 0, prefetch_end, tiles_of(0));
  for (int64_t g = 0; g < groups; ++g) {
    c10::BFloat16* tiles = tiles_of(g);
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (XT == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    _tile_loadd(4, tiles, tile_bytes);
    _tile_loadd(5, tiles + kAmxTile, tile_bytes);
    for (int p = 0; p < AmxInputs<float>::kParts; ++p) {
      const int32_t* part = x.parts[p].get() + x_offset + g * kAmxTile / 2;
      _tile_loadd(6, part, tile_bytes);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if constexpr (XT == 2) {
        _tile_loadd(7, part + x_tile, tile_bytes);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    if (convert && g + 1 < groups) amx_level_tiles(weights, row0, n, g + 1, prefetch_end, tiles_of(g + 1));
    if (g > 0) add_group(g - 1);
    _tile_stored(0, sums[g % 2][0], tile_bytes);
    _tile_stored(1, sums[g % 2][1], tile_bytes);
    if constexpr (XT == 2) {
      _tile_stored(2, sums[g % 2][2], tile_bytes);
      _tile_stored(3, sums[g % 2][3], tile_bytes);
    }
  }
  add_group(groups - 1);
  amx_store<XT>(totals, bias, y, row0, r0, m, n);
}

template <typename Weights, typename x_t>
void amx_rows(const Weights& weights, const x_t* x, const x_t* bias, x_t* y, int64_t m, int64_t n) {
  constexpr bool fp32 = std::is_same_v<x_t, float>;
  const int64_t k = weights.k, groups = weights.groups(), row_pairs = (n + 2 * kAmxBlock - 1) / (2 * kAmxBlock);
  const int64_t pair_elements = 2 * kAmxBlock * k, pair_factors = 2 * kAmxBlock * 2 * groups;
  // Over more than kRowsPerPass rows a thread converts liteinfer::kAmxChunkBytes of its pairs at once and runs
  // every kRowsPerPass rows over them before the next: W converted once a call. fp32 converts a pair's groups as its
  // first pass takes them, into the pair's buffer, or over 32 rows of x at most (one pass a pair) into two groups'.
  const int64_t chunk =
      m > kRowsPerPass ? std::max<int64_t>(1, liteinfer::kAmxChunkBytes / (2 * pair_elements)) : 1;
  const int64_t ring = fp32 && m <= 2 * kAmxBlock ? 2 : groups;
  const AmxInputs<x_t> inputs(x, m, k);
  at::parallel_for(0, row_pairs, 1, [&](int64_t begin, int64_t end) {
    const liteinfer::TileConfig config(8);
    _tile_loadconfig(&config);
    c10::BFloat16* converted = thread_buffer<c10::BFloat16>(chunk * ring * 2 * kAmxTile);
    float* factors = fp32 ? thread_buffer<float>(chunk * pair_factors) : nullptr;
    const int64_t prefetch_end = std::min(n, end * 2 * kAmxBlock);  // the end of the thread's rows of W
    for (int64_t c0 = begin; c0 < end; c0 += chunk) {
      const int64_t c_end = std::min(end, c0 + chunk);
      for (int64_t pair = c0; pair < c_end; ++pair) {
        c10::BFloat16* w = converted + (pair - c0) * ring * 2 * kAmxTile;
        if constexpr (fp32)
          amx_factors(weights, pair * 2 * kAmxBlock, n, prefetch_end, factors + (pair - c0) * pair_factors);
        else
          amx_dequantize(weights, pair * 2 * kAmxBlock, n, prefetch_end, w);
      }
      for (int64_t m0 = 0; m0 < m; m0 += kRowsPerPass) {
        const int64_t m_end = std::min(m, m0 + kRowsPerPass);
        for (int64_t pair = c0; pair < c_end; ++pair) {
          c10::BFloat16* w = converted + (pair - c0) * ring * 2 * kAmxTile;
          const int64_t row0 = pair * 2 * kAmxBlock;
          for (int64_t r0 = m0; r0 < m_end; r0 += 2 * kAmxBlock) {
            const bool two = m_end - r0 > kAmxBlock;
            if constexpr (fp32) {
              const float* f = factors + (pair - c0) * pair_factors;
              if (two)
                amx_pass<2>(weights, r0 == 0, w, ring, f, inputs, bias, y, row0, r0, m_end, n, prefetch_end);
              else
                amx_pass<1>(weights, r0 == 0, w, ring, f, inputs, bias, y, row0, r0, m_end, n, prefetch_end);
            } else if (two) {
              amx_pass<2>(w, inputs, groups, bias, y, row0, r0, m_end, n);
            } else {
              amx_pass<1>(w, inputs, groups, bias, y, row0, r0, m_end, n);
            }
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

#if defined(LITEINFER_GEMV_DEQUANTIZED)
// Rows of x in a dtype the packed linears' tiles take (AVX-512 BF16: fp32 and bf16, where AMX does not take them;
// AVX2: bf16), against int8 or int4 weights with whole blocks of 16 outputs, from kDequantizedMinRows rows up: each
// thread dequantizes a group of 48 rows of W (three blocks of 16, kernels/packed_tile.h) at a time into the packed
// linears' layout, in x's dtype, into a buffer in L2, and runs every row of x through the packed linears' tiles over
// it. The integer form spends three operations per 32 inputs of each row of x (products, conversion, scaling); a
// packed tile one vdpbf16ps (bf16) or two FMAs (fp32), once W is dequantized, which costs a few rows' worth (AVX2:
// four FMAs and its pairs' widening per 16 outputs and 2 inputs). fp32 then meets the weights exactly as q s + z;
// bf16 rounds them to bf16 (nearest even), the model's own precision in bf16, as the AMX tiles do.
#if defined(LITEINFER_PACKED_AVX512)
// v[i]'s lane j and v[j]'s lane i swapped for all i, j: 16 rows of 16 32-bit lanes into 16 columns.
inline void transpose16(__m512 v[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows interleaved, within each 128-bit lane
    t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // fours of rows: v[i + c] holds column c of each 128-bit lane's four
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]), c = _mm512_castps_pd(t[i + 2]),
                  d = _mm512_castps_pd(t[i + 3]);
    v[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    v[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    v[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    v[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {  // column 4 L + c: 128-bit lane L of the four fours, in row order
    const __m512 low01 = _mm512_shuffle_f32x4(v[c], v[4 + c], 0x44),
                 high01 = _mm512_shuffle_f32x4(v[c], v[4 + c], 0xEE),
                 low23 = _mm512_shuffle_f32x4(v[8 + c], v[12 + c], 0x44),
                 high23 = _mm512_shuffle_f32x4(v[8 + c], v[12 + c], 0xEE);
    t[c] = _mm512_shuffle_f32x4(low01, low23, 0x88);
    t[4 + c] = _mm512_shuffle_f32x4(low01, low23, 0xDD);
    t[8 + c] = _mm512_shuffle_f32x4(high01, high23, 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(high01, high23, 0xDD);
  }
  std::copy_n(t, 16, v);
}

// Group g of the 16 rows of W from `first` in T, into the packed layout: the group's step i (fp32: its input i; bf16:
// its pair i) at steps + i * stride, the 16 rows side by side; row r's factors at s[r * Int8Vectors::chunk] and
// z[r * Int8Vectors::chunk] (dequantizing_factors'). 16 rows by 16 inputs at a time, dequantized, then transposed.
template <typename T, typename Weights>
void dequantize_group(const Weights& weights, int64_t first, int64_t g, const float* s, const float* z, T* steps,
                      int64_t stride) {
  constexpr int64_t chunk = Int8Vectors::chunk;
  auto dequantized = [&](int r, int half) {
    return dequantized16(weights, first + r, g, half, s[r * chunk], z[r * chunk]);
  };
  __m512 v[16];
  if constexpr (std::is_same_v<T, float>) {
    for (int half = 0; half < 2; ++half) {
      for (int r = 0; r < 16; ++r) v[r] = dequantized(r, half);
      transpose16(v);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(steps + (16 * half + i) * stride, v[i]);
    }
  } else {  // a row's 32 inputs as 16 pairs, a pair a 32-bit lane
    for (int r = 0; r < 16; ++r) v[r] = (__m512)_mm512_cvtne2ps_pbh(dequantized(r, 1), dequantized(r, 0));
    transpose16(v);
    for (int p = 0; p < 16; ++p) _mm512_storeu_ps(reinterpret_cast<float*>(steps + p * stride), v[p]);
  }
}

#else  // LITEINFER_PACKED_AVX2
// v[i]'s lane j and v[j]'s lane i swapped for all i, j: 8 rows of 8 32-bit lanes into 8 columns.
inline void transpose8(__m256 v[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {  // pairs of rows interleaved, within each 128-bit lane
    t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // fours of rows: v[i + c] holds column c of each 128-bit lane's four
    v[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    v[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    v[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    v[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {  // column c from the low 128-bit lanes of both fours, column 4 + c from the high
    t[c] = _mm256_permute2f128_ps(v[c], v[4 + c], 0x20);
    t[4 + c] = _mm256_permute2f128_ps(v[c], v[4 + c], 0x31);
  }
  std::copy_n(t, 8, v);
}

// fp32 values' bits rounded to bf16's at the nearest even (finite values), in the high halves of the lanes.
inline __m256i bf16_rounded(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
}

// 16 levels (16-bit lanes, of consecutive inputs) as 8 pairs of bf16 weights q s + z, a pair a 32-bit lane, the
// first input in the low half (the packed layout's pairs): the even inputs are each lane's low half sign-extended,
// the odd ones its high half.
inline __m256i dequantized_pairs(__m256i levels, float s, float z) {
  const __m256 scale = _mm256_set1_ps(s), zero = _mm256_set1_ps(z);
  const __m256i even = _mm256_srai_epi32(_mm256_slli_epi32(levels, 16), 16), odd = _mm256_srai_epi32(levels, 16);
  const __m256 first = _mm256_fmadd_ps(_mm256_cvtepi32_ps(even), scale, zero),
               second = _mm256_fmadd_ps(_mm256_cvtepi32_ps(odd), scale, zero);
  return _mm256_or_si256(_mm256_srli_epi32(bf16_rounded(first), 16),
                         _mm256_and_si256(bf16_rounded(second), _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// dequantize_group's contract (AVX-512's above), bf16 only: 8 rows by 8 pairs at a time, dequantized, then transposed.
template <typename T, typename Weights>
void dequantize_group(const Weights& weights, int64_t first, int64_t g, const float* s, const float* z, T* steps,
                      int64_t stride) {
  static_assert(std::is_same_v<T, c10::BFloat16>, "AVX2's packed tiles take bf16 only");
  constexpr int64_t chunk = Int8Vectors::chunk;
  for (int rows = 0; rows < 16; rows += 8)
    for (int half = 0; half < 2; ++half) {  // pairs 8 half .. 8 half + 7 of the group
      __m256 v[8];
      for (int r = 0; r < 8; ++r) {
        const int row = rows + r;
        v[r] = _mm256_castsi256_ps(dequantized_pairs(weights.levels16(first + row, g, half), s[row * chunk],
                                                     z[row * chunk]));
      }
      transpose8(v);
      for (int p = 0; p < 8; ++p)
        _mm256_storeu_ps(reinterpret_cast<float*>(steps + (8 * half + p) * stride + 2 * rows), v[p]);
    }
}
#endif

// Rows [row0, row0 + 16 * blocks) of W in T, in the packed layout: for each step (fp32: an input; bf16: a pair of
// inputs), each block's 16 rows side by side.
template <typename T, typename Weights>
void dequantize_packed(const Weights& weights, int64_t row0, int64_t blocks, T* out) {
  using liteinfer::packed::PAIR;
  constexpr int64_t chunk = Int8Vectors::chunk;
  const int64_t groups = weights.groups(), stride = blocks * 16 * PAIR<T>;  // a step of all the blocks, in T
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = row0 + b * 16;
    for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
      const int64_t count = std::min(chunk, groups - g0);
      alignas(64) float s[16][chunk], z[16][chunk];  // [row][group]
      for (int r = 0; r < 16; ++r) dequantizing_factors(weights, first + r, g0, count, s[r], z[r]);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t g = g0 + j;
        T* steps = out + g * kInt8Group / PAIR<T> * stride + b * 16 * PAIR<T>;  // the group's first step, block b
        dequantize_group(weights, first, g, &s[0][j], &z[0][j], steps, stride);
      }
    }
  }
}

// y [m, n]: each thread takes a contiguous share of W's groups of 48 rows, dequantizes each once, and runs every row
// of x over it, ROWS rows a tile (x from L2 or L3; the group, 48 x k in T, stays in L2).
template <typename Weights, typename T>
void dequantized_rows(const Weights& weights, const T* x, const T* bias, T* y, int64_t m, int64_t n) {
  using liteinfer::packed::BLOCKS, liteinfer::packed::LINE, liteinfer::packed::PAIR, liteinfer::packed::Prefetch,
      liteinfer::packed::ROWS, liteinfer::packed::tile_for;
  const int64_t k = weights.k, blocks = n / 16, row_groups = (blocks + BLOCKS - 1) / BLOCKS;
  at::parallel_for(0, row_groups, 1, [&](int64_t begin, int64_t end) {
    T* dequantized = thread_buffer<T>(BLOCKS * 16 * k);
    for (int64_t group = begin; group < end; ++group) {
      const int64_t b0 = group * BLOCKS, nb = std::min(BLOCKS, blocks - b0);
      dequantize_packed(weights, b0 * 16, nb, dequantized);
      // The thread's next group's levels, into L2 while the tiles run (a line a step, from the first tile on).
      const int64_t next_rows = group + 1 < end ? std::min(BLOCKS * 16, n - (b0 + nb) * 16) : 0;
      const int64_t next_lines = next_rows * weights.level_bytes() / LINE, steps = k / PAIR<T>;
      const char* next = static_cast<const char*>(weights.levels_of((b0 + nb) * 16));
      for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
        const int64_t first = r0 / ROWS * steps;  // the lines the tiles before this one asked for
        const Prefetch prefetch{next + first * LINE, std::max<int64_t>(0, next_lines - first)};
        tile_for<T>(nb, std::min<int64_t>(ROWS, m - r0))(x + r0 * k, k, dequantized, bias ? bias + b0 * 16 : nullptr,
                                                         y + r0 * n + b0 * 16, n, prefetch);
      }
    }
  });
}
#endif

// Which form multiplies quantized weights with n outputs against m rows of x in `dtype`: the integer form (any
// CPU, any shape), AMX's tiles or the packed tiles over dequantized rows (above).
enum class QuantizedForm { integer, amx, dequantized };

QuantizedForm quantized_form(at::ScalarType dtype, int64_t m, int64_t n) {
#if defined(LITEINFER_GEMV_AMX)
  if (m >= kDequantizedMinRows && liteinfer::amx_permitted()) return QuantizedForm::amx;
#endif
#if defined(LITEINFER_GEMV_DEQUANTIZED)
  const bool tiles = dtype == at::kBFloat16 || liteinfer::packed::FLOAT_TILES;
  if (tiles && n % 16 == 0 && m >= kDequantizedMinRows) return QuantizedForm::dequantized;
#endif
  return QuantizedForm::integer;
}

// The form's name, for the tests: which arithmetic a shape meets.
std::string gemv_quantized_form(at::ScalarType dtype, int64_t rows, int64_t outputs) {
  static constexpr const char* names[] = {"integer", "amx", "dequantized"};
  return names[static_cast<int>(quantized_form(dtype, rows, outputs))];
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scales,
                const c10::optional<at::Tensor>& bias) {
  const bool int8 = weight.scalar_type() == at::kChar, int4 = weight.scalar_type() == at::kByte;
  TORCH_CHECK(x.dim() == 2 && (int8 || int4 ? x.size(0) >= 1 : x.size(0) == 1) && weight.dim() == 2 &&
                  x.size(1) == weight.size(1) * (int4 ? 2 : 1),
              "expected x [1, in] (quantized weights: [rows, in]) and weight [out, in] (int4: [out, in / 2] bytes)");
  TORCH_CHECK(weight.is_contiguous(), "the weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "gemv takes fp32 or bf16 x");
  TORCH_CHECK(int8 || int4 || x.scalar_type() == weight.scalar_type(), "x and a float weight must share a dtype");
  const int64_t m = x.size(0), n = weight.size(0), k = x.size(1);
  if (int4) {
    TORCH_CHECK(k % kGroup == 0, "int4 weights come in blocks of 64 inputs");
    TORCH_CHECK(scales && scales->dim() == 3 && scales->size(0) == n && scales->size(1) == 2 &&
                    scales->size(2) == k / kInt4Group && scales->scalar_type() == x.scalar_type(),
                "an int4 weight takes [out, 2, in / 32] scales and zeros, in x's dtype");
  } else if (int8) {
    TORCH_CHECK(k % kInt8Group == 0, "int8 weights come in groups of 32 inputs");
    TORCH_CHECK(scales && scales->dim() == 3 && scales->size(0) == n && scales->size(1) == 2 &&
                    scales->size(2) == k / kInt8Group && scales->scalar_type() == at::kHalf,
                "an int8 weight takes [out, 2, in / 32] scales and zeros, in fp16");
  } else {
    TORCH_CHECK(!scales, "a float weight takes no scales");
  }
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == x.scalar_type()),
              "the bias must be [out], in x's dtype");
  const at::Tensor x_ = x.contiguous(), s = scales ? scales->contiguous() : at::Tensor(),
                   b = bias ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({m, n}, x.options());
  auto run = [&](auto x_type) {  // for x in fp32 or bf16, the two dtypes checked above
    using scalar_t = decltype(x_type);
    const scalar_t* b_data = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
    scalar_t* y_data = y.data_ptr<scalar_t>();
    const scalar_t* xs = x_.data_ptr<scalar_t>();
    if (int8 || int4) {
      auto multiply = [&](const auto& weights) {
        const QuantizedForm form = quantized_form(x.scalar_type(), m, n);
#if defined(LITEINFER_GEMV_AMX)
        if (form == QuantizedForm::amx) return amx_rows(weights, xs, b_data, y_data, m, n);
#endif
#if defined(LITEINFER_GEMV_DEQUANTIZED)
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || liteinfer::packed::FLOAT_TILES) {
          if (form == QuantizedForm::dequantized) return dequantized_rows(weights, xs, b_data, y_data, m, n);
        }
#endif
        std::vector<RowInputs> rows;  // each row of x prepared once: every row of W reads it
        for (int64_t r = 0; r < m; ++r) rows.push_back(row_inputs(xs + r * k, k, int4));
        quantized_rows(weights, rows, b_data, y_data, n);
      };
      if (int8)
        multiply(Int8Rows{weight.data_ptr<int8_t>(), s.data_ptr<at::Half>(), k});
      else
        multiply(Int4Rows<scalar_t>{weight.data_ptr<uint8_t>(), s.data_ptr<scalar_t>(), k});
    } else {
      gemv_rows(weight.data_ptr<scalar_t>(), xs, k, b_data, y_data, n);
    }
  };
  x.scalar_type() == at::kFloat ? run(float{}) : run(c10::BFloat16{});
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(liteinfer, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? scales, Tensor? bias) -> Tensor");
  m.def("gemv_quantized_form(ScalarType dtype, int rows, int outputs) -> str", &gemv_quantized_form);
}

TORCH_LIBRARY_IMPL(liteinfer, CPU, m) { m.impl("gemv", &gemv); }
