// y = x W^T (+ b) for a single row x: the only product a decode step of one sequence has. W is float (fp32 or
// bf16, as x), or int8 or int4 with a scale and a zero per group of inputs (layers/quantization.py's int8 and int4).
// int8 weights take any number of rows, as their only kernel for batches too (below). Registered (CPU) as
// torch.ops.liteinfer.gemv; liteinfer/kernels/__init__.py builds it and gives its contract.
//
// At one row a linear layer is a stream through W, bound by memory bandwidth. oneDNN's prepacked matmul reached
// ~35-42 GB/s on SmolLM2's layers here; streaming W's rows in their checkpoint layout, each thread through its
// share of rows in address order, reads as fast as a plain read of the same bytes (docs/benchmarks.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "amx.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// y = W[r]·x for one row of W (length k), in fp32. The portable form; the vector ones (AVX-512, AVX2) follow.
template <typename weight_t, typename x_t>
inline float dot_row(const weight_t* w, const x_t* x, int64_t k) {
  float sum = 0.f;
  for (int64_t i = 0; i < k; ++i) sum += static_cast<float>(w[i]) * static_cast<float>(x[i]);
  return sum;
}

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
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(mask, w), (__m512bh)_mm512_maskz_loadu_epi16(mask, x));
  }
};
#endif

inline __m512 zero(__m512) { return _mm512_setzero_ps(); }
inline __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }
#define LITEINFER_GEMV_VECTOR
#elif defined(__AVX2__) && defined(__FMA__)
// The same steps in 8 lanes (AVX2 CPUs; bf16 keeps the portable loop there). With no
// masked byte loads, a tail is copied into zeroed registers' worth of memory first.
template <typename weight_t, typename x_t>
struct Step;

template <typename weight_t, typename x_t, typename S>
inline __m256 tail_through_copy(__m256 acc, const weight_t* w, const x_t* x, int64_t count) {
  weight_t w_tail[S::width] = {};
  x_t x_tail[S::width] = {};
  std::copy(w, w + count, w_tail);
  std::copy(x, x + count, x_tail);
  return S::full(acc, w_tail, x_tail);
}

template <>
struct Step<float, float> {
  using Vec = __m256;
  static constexpr int64_t width = 8;
  static __m256 full(__m256 acc, const float* w, const float* x) {
    return _mm256_fmadd_ps(_mm256_loadu_ps(w), _mm256_loadu_ps(x), acc);
  }
  static __m256 tail(__m256 acc, const float* w, const float* x, int64_t count) {
    return tail_through_copy<float, float, Step>(acc, w, x, count);
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
// The row is read front to back, in address order, into four independent sums (one alone stalls on its own
// add's latency). Reading eight rows side by side against one load of x, as this kernel did before, was 10-15%
// slower in bf16 and int8: x stays in L1 either way, and one sequential stream per thread is what the hardware
// prefetcher follows best (docs/benchmarks.md). The sums are four named registers, not an array indexed in a loop:
// that form kept them in memory and lost the gain.
template <typename weight_t, typename x_t, typename S = Step<weight_t, x_t>>
inline float dot_row_vector(const weight_t* w, const x_t* x, int64_t k) {
  constexpr int64_t n = S::width;
  using Vec = typename S::Vec;
  Vec a0 = zero(Vec{}), a1 = zero(Vec{}), a2 = zero(Vec{}), a3 = zero(Vec{});
  int64_t i = 0;
  for (; i + 4 * n <= k; i += 4 * n) {
    a0 = S::full(a0, w + i, x + i);
    a1 = S::full(a1, w + i + n, x + i + n);
    a2 = S::full(a2, w + i + 2 * n, x + i + 2 * n);
    a3 = S::full(a3, w + i + 3 * n, x + i + 3 * n);
  }
  for (; i + n <= k; i += n) a0 = S::full(a0, w + i, x + i);
  if (i < k) a1 = S::tail(a1, w + i, x + i, k - i);
  return reduce(add(add(a0, a1), add(a2, a3)));
}

template <>
inline float dot_row<float, float>(const float* w, const float* x, int64_t k) {
  return dot_row_vector(w, x, k);
}
#if defined(__AVX512BF16__)
template <>
inline float dot_row<c10::BFloat16, c10::BFloat16>(const c10::BFloat16* w, const c10::BFloat16* x, int64_t k) {
  return dot_row_vector(w, x, k);
}
#endif
#endif

// Quantized rows. int8: a scale and a zero per group of 32 inputs, the weight being q * scale + zero, both fp16, a
// row's scales side by side and then its zeros. int4: a scale and a zero per group of 32 inputs in x's dtype, laid
// out as int8's, the weight being (q - 8) * scale + zero; each block of 64 inputs' levels q is 32 bytes, read as
// sixteen little-endian 16-bit lanes, lane l holding the levels of inputs l, 16 + l, 32 + l, 48 + l in its nibbles
// from the lowest up (layers/quantization.py: gemv_int4_layout), so that one shift and one mask give sixteen
// consecutive inputs' levels as 16-bit integers, with no byte shuffles.
constexpr int64_t kGroup = 64;  // int4's block of inputs in its layout, and the group x is rounded in below
constexpr int64_t kInt8Group = 32, kInt4Group = 32;  // the groups that share a scale and a zero

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

struct Int16Inputs {
  std::vector<int16_t> levels;  // x[i] ≈ levels[i] * scales[i / kGroup]
  std::vector<float> scales;
  // Per group of 32 inputs (int8's and int4's): its levels' scale (its group of 64's), and its sum of levels times
  // that scale (the sum of x as rounded); zero past the last group up to a multiple of 16, so that int8 loads them a
  // chunk at a time.
  std::vector<float> group_scales;
  std::vector<float> sums;
};

template <typename scalar_t>
inline Int16Inputs int16_inputs(const scalar_t* x, int64_t k) {
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

// int8's vector operations, in the widest registers there are: a group's 32 levels as 16-bit integers, the products
// with x's levels summed in pairs into int32 lanes, then in fp32; and `chunk` groups' scales or zeros widened from
// fp16 (int4's: from x's dtype) at once, zero past `count`. (Zeroing, adding and summing a vector: the float rows'
// zero, add and reduce.)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// A group in one 512-bit register: on the Intel Xeon this ran SmolLM2's int8 linears 10-25% faster at one row and
// 5-10% at 32 than two 256-bit halves (docs/benchmarks.md).
struct Int8Vectors {
  using Float = __m512;
  using Levels = __m512i;
  static constexpr int64_t chunk = 16;
  static Levels load(const int8_t* w) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  }
  static Float dot(Levels w, const int16_t* x) {
    const __m512i xv = _mm512_loadu_si512(x);
#if defined(__AVX512VNNI__)
    return _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), w, xv));
#else
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(w, xv));
#endif
  }
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
  static Float widen_chunk(const at::Half* v) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
  }
  static Float widen_chunk(const float* v) { return _mm256_loadu_ps(v); }
  static Float widen_chunk(const c10::BFloat16* v) {  // bf16: fp32's top half
    const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
  }
  template <typename T>
  static Float widen(const T* v, int64_t count) {
    if (count == chunk) return widen_chunk(v);
    T eight[8] = {};  // (no masked 16-bit loads: the tail through a copy, once a row)
    std::copy(v, v + count, eight);
    return widen_chunk(eight);
  }
  static Float load(const float* v) { return _mm256_loadu_ps(v); }
  static void store(float* v, Float a) { _mm256_storeu_ps(v, a); }
  static Float broadcast(float v) { return _mm256_set1_ps(v); }
  static Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
  static Float fma(Float a, Float b, Float c) { return _mm256_fmadd_ps(a, b, c); }
};
#endif

// The sums of one row of int8 weights (q s + z per group) times each of R rows of x, as sum of s (q · x) + z (sum
// of x) over the groups. A chunk of groups at a time, their scales and zeros are widened in one vector each: the
// zeros times x's sums go into a vector per row of x, and the scales times x's scales are the factors of the
// groups' integer sums. The weight levels are widened once for all R rows (a tile of x's rows, where there are
// several), and each row of x gets the same operations in the same order whatever R is: a row's result does not
// depend on the rows beside it.
template <int R>
inline void dot_rows_int8(const int8_t* w, const Int16Inputs* const* inputs, const at::Half* scales,
                          const at::Half* zeros, int64_t groups, float* out) {
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
    for (int64_t j = 0; j < count; ++j) {
      const typename V::Levels levels = V::load(w + (g0 + j) * kInt8Group);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int16_t* x = inputs[r]->levels.data() + (g0 + j) * kInt8Group;
        total[r] = V::fma(V::dot(levels, x), V::broadcast(factors[r][j]), total[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce(add(total[r], offsets[r]));
}

// A row's sum of ((q - 8) s + z) x over its groups, as sum of s (q · x) + (z - 8 s) (sum of x); each block of 64
// inputs holds two groups (nibbles 0-1 of its lanes the first, 2-3 the second). As int8's rows do, a chunk of
// groups' scales and zeros is widened at once into the groups' factors and the offsets, so that a block costs its
// integer products, two conversions and two multiply-adds (one chain per group of the block); scalar conversions
// and sums per group had made int4 bound by its instructions rather than its bytes (docs/benchmarks.md).
template <typename scale_t>
inline float dot_row_int4(const uint8_t* w, const Int16Inputs* inputs, const scale_t* scales, const scale_t* zeros,
                          int64_t groups) {
  using V = Int8Vectors;
  const __m256i nibble = _mm256_set1_epi16(0xF);
  __m256 first = _mm256_setzero_ps(), second = _mm256_setzero_ps();  // the s (q · x) terms of each block's groups
  typename V::Float offsets = zero(typename V::Float{});
  for (int64_t g0 = 0; g0 < groups; g0 += V::chunk) {
    const int64_t count = std::min(V::chunk, groups - g0);
    const typename V::Float s = V::widen(scales + g0, count);
    alignas(64) float factors[V::chunk];
    V::store(factors, V::mul(s, V::load(inputs->group_scales.data() + g0)));
    offsets = V::fma(V::fma(s, V::broadcast(-8.f), V::widen(zeros + g0, count)), V::load(inputs->sums.data() + g0),
                     offsets);
    for (int64_t j = 0; j < count; j += 2) {  // the block of groups g0 + j and g0 + j + 1
      const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g0 + j) * kInt4Group / 2));
      auto weights = [&](int n) {  // nibble n of every lane (the top one needs no mask)
        const __m256i shifted = _mm256_srli_epi16(lanes, 4 * n);
        return n == 3 ? shifted : _mm256_and_si256(shifted, nibble);
      };
      const int16_t* x = inputs->levels.data() + (g0 + j) * kInt4Group;
      const __m256i sum0 = multiply_add(multiply_add(_mm256_setzero_si256(), weights(0), x), weights(1), x + 16);
      const __m256i sum1 = multiply_add(multiply_add(_mm256_setzero_si256(), weights(2), x + 32), weights(3), x + 48);
      first = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum0), _mm256_set1_ps(factors[j]), first);
      second = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum1), _mm256_set1_ps(factors[j + 1]), second);
    }
  }
  return reduce(_mm256_add_ps(first, second)) + reduce(offsets);
}
#else
// The portable forms, in fp32 against x as given.
template <int R>
inline void dot_rows_int8(const int8_t* w, const float* const* x, const at::Half* scales, const at::Half* zeros,
                          int64_t groups, float* out) {
  for (int r = 0; r < R; ++r) {
    float sum = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = static_cast<float>(scales[g]), zero = static_cast<float>(zeros[g]);
      for (int64_t i = g * kInt8Group; i < (g + 1) * kInt8Group; ++i) sum += (w[i] * scale + zero) * x[r][i];
    }
    out[r] = sum;
  }
}

template <typename scale_t>
inline float dot_row_int4(const uint8_t* w, const float* x, const scale_t* scales, const scale_t* zeros,
                          int64_t groups) {
  float sum = 0.f;
  for (int64_t i = 0; i < groups * kInt4Group; ++i) {  // input i of its block: lane i % 16, nibble i / 16
    const int64_t g = i / kInt4Group, in_block = i % kGroup;
    const uint8_t byte = w[i / kGroup * kGroup / 2 + 2 * (in_block % 16) + in_block / 32];
    const int q = in_block / 16 % 2 ? byte >> 4 : byte & 0xF;
    sum += ((q - 8) * static_cast<float>(scales[g]) + static_cast<float>(zeros[g])) * x[i];
  }
  return sum;
}
#endif

// A row of x as the quantized rows read it: rounded to 16-bit levels (x86), or widened to fp32 (otherwise); `row_ref`
// is what their dot products take.
#if defined(LITEINFER_GEMV_INT16_INPUTS)
using RowInputs = Int16Inputs;
template <typename scalar_t>
RowInputs row_inputs(const scalar_t* x, int64_t k) { return int16_inputs(x, k); }
inline const Int16Inputs* row_ref(const RowInputs& row) { return &row; }
#else
using RowInputs = std::vector<float>;
template <typename scalar_t>
RowInputs row_inputs(const scalar_t* x, int64_t k) { return RowInputs(x, x + k); }
inline const float* row_ref(const RowInputs& row) { return row.data(); }
#endif
using RowRef = decltype(row_ref(std::declval<const RowInputs&>()));

template <typename out_t>
inline out_t output(float v, const out_t* bias, int64_t row) {
  return static_cast<out_t>(bias ? v + static_cast<float>(bias[row]) : v);
}

// y[row] = row_dot(row) (+ bias[row]) for rows 0..n, each thread streaming one contiguous share of W's rows.
template <typename out_t, typename RowDot>
void gemv_rows(const RowDot& row_dot, const out_t* bias, out_t* y, int64_t n) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) y[row] = output(row_dot(row), bias, row);
  });
}

// int8 weights against m rows of x, y [m, n]. Each thread takes a contiguous share of W's rows, kRowBlock at a time,
// and runs every row of x over a block, kTile rows of x at a time, while the block sits in L1 (16 rows of 1,536
// inputs: 24 KB); x's rows kRowsPerPass at a time, so that their levels stay in L2 (128 x 1,536 x 2 bytes: 384 KB).
// With one row of x this is the GEMV's stream through W, row after row.
constexpr int64_t kRowBlock = 16, kRowsPerPass = 128;
constexpr int kTile = 4;

template <int R, typename out_t>
void int8_tile(const int8_t* w, const at::Half* scales_and_zeros, const RowRef* x, const out_t* bias, out_t* y,
               int64_t row_begin, int64_t row_end, int64_t n, int64_t k) {
  const int64_t groups = k / kInt8Group;
  for (int64_t row = row_begin; row < row_end; ++row) {
    float sums[R];
    const at::Half* scales = scales_and_zeros + row * groups * 2;
    dot_rows_int8<R>(w + row * k, x, scales, scales + groups, groups, sums);
    for (int r = 0; r < R; ++r) y[r * n + row] = output(sums[r], bias, row);
  }
}

#if defined(LITEINFER_AMX) && defined(LITEINFER_GEMV_INT16_INPUTS) && defined(__AVX512BF16__)
#define LITEINFER_GEMV_AMX
// bf16 rows of x against int8 weights, on CPUs with AMX, from kAmxMinRows rows up: each thread dequantizes 32 rows
// of W at a time to bf16 (q * scale + zero in fp32, rounded to nearest even) into a buffer in L2, and multiplies them
// in tiles, the transposed product y^T = W x^T: W's rows are then the first operand as they are (a tile: 16 rows of
// W by one group of 32 inputs), and x, small, is what gets rearranged (once a call: its pairs of inputs side by side
// for 16 rows, the second operand's layout). A pass keeps 2 x 2 tiles of sums: 32 rows of W by 32 rows of x. The
// weights' rounding to bf16 (2^-9) is the model's own precision in bf16; a row's result does not depend on the
// other rows, but differs from the integer form's, which one row (and fewer than kAmxMinRows) takes.
constexpr int64_t kAmxMinRows = 5, kAmxBlock = 16;

// x [m, k] bf16 as tiles of 16 rows (the last zero-padded): for each pair of inputs, the 16 rows' pairs side by side.
std::vector<int32_t> amx_x_pairs(const c10::BFloat16* x, int64_t m, int64_t k) {
  const int64_t tiles = (m + kAmxBlock - 1) / kAmxBlock, pairs = k / 2;
  std::vector<int32_t> out(tiles * pairs * kAmxBlock);
  const int32_t* x_pairs = reinterpret_cast<const int32_t*>(x);
  const __m512i row_offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                 _mm512_set1_epi32(static_cast<int32_t>(pairs)));
  for (int64_t t = 0; t < tiles; ++t) {
    const __mmask16 valid = static_cast<__mmask16>((1u << std::min(kAmxBlock, m - t * kAmxBlock)) - 1);
    const int32_t* rows = x_pairs + t * kAmxBlock * pairs;
    for (int64_t p = 0; p < pairs; ++p)
      _mm512_storeu_si512(out.data() + (t * pairs + p) * kAmxBlock,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, row_offsets, rows + p, 4));
  }
  return out;
}

// Rows [row0, row0 + 32) of W (those past n as zeros) in bf16, as tiles: for each group of 32 inputs, the 16 rows
// of each block of 16 side by side ([block][group][16][32]).
void amx_dequantize(const int8_t* w, const at::Half* scales_and_zeros, int64_t row0, int64_t n, int64_t k,
                    c10::BFloat16* out) {
  constexpr int64_t rows = 2 * kAmxBlock, tile = kAmxBlock * kInt8Group;
  const int64_t groups = k / kInt8Group;
  for (int64_t i = 0; i < rows; ++i) {
    c10::BFloat16* tile_row = out + i / kAmxBlock * groups * tile + i % kAmxBlock * kInt8Group;
    if (row0 + i >= n) {
      for (int64_t g = 0; g < groups; ++g) _mm512_storeu_si512(tile_row + g * tile, _mm512_setzero_si512());
      continue;
    }
    const int8_t* levels = w + (row0 + i) * k;
    const at::Half* scales = scales_and_zeros + (row0 + i) * groups * 2;
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const int64_t count = std::min<int64_t>(16, groups - g0);
      alignas(64) float s[16], z[16];
      _mm512_store_ps(s, Int8Vectors::widen(scales + g0, count));
      _mm512_store_ps(z, Int8Vectors::widen(scales + groups + g0, count));
      for (int64_t j = 0; j < count; ++j) {
        const int8_t* q = levels + (g0 + j) * kInt8Group;
        const __m512 scale = _mm512_set1_ps(s[j]), zero = _mm512_set1_ps(z[j]);
        auto dequantized = [&](int half) {  // 16 levels, from input 16 * half
          const __m128i values = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * half));
          return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(values)), scale, zero);
        };
        _mm512_storeu_si512(tile_row + (g0 + j) * tile, (__m512i)_mm512_cvtne2ps_pbh(dequantized(1), dequantized(0)));
      }
    }
  }
}

// y [rows of x, n] for the 2 x XT tiles of sums: 32 rows of W (from row0) by XT tiles of 16 rows of x (from r0).
template <int XT>
void amx_int8_pass(const c10::BFloat16* weights, const int32_t* x_pairs, int64_t groups, const c10::BFloat16* bias,
                   c10::BFloat16* y, int64_t row0, int64_t r0, int64_t m, int64_t n) {
  constexpr int64_t tile_bytes = 64, tile_elems = kAmxBlock * kInt8Group;
  const int64_t x_tile = groups * tile_elems / 2;  // int32 pairs per 16 rows of x
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (XT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(4, weights + g * tile_elems, tile_bytes);
    _tile_loadd(5, weights + (groups + g) * tile_elems, tile_bytes);
    _tile_loadd(6, x_pairs + g * tile_elems / 2, tile_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    if constexpr (XT == 2) {
      _tile_loadd(7, x_pairs + x_tile + g * tile_elems / 2, tile_bytes);
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
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  for (int t = 0; t < XT; ++t)
    for (int64_t r = 0; r < std::min(kAmxBlock, m - r0 - t * kAmxBlock); ++r)
      for (int b = 0; b < 2; ++b) {
        const int64_t out0 = row0 + b * kAmxBlock;
        if (out0 >= n) continue;
        const __mmask16 valid = static_cast<__mmask16>((1u << std::min(kAmxBlock, n - out0)) - 1);
        __m512 v = _mm512_i32gather_ps(column, &sums[2 * t + b][0][r], 4);
        if (bias) {
          const __m256i bits = _mm256_maskz_loadu_epi16(valid, bias + out0);
          v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
        }
        _mm256_mask_storeu_epi16(y + (r0 + t * kAmxBlock + r) * n + out0, valid, (__m256i)_mm512_cvtneps_pbh(v));
      }
}

void int8_rows_amx(const int8_t* w, const at::Half* scales_and_zeros, const c10::BFloat16* x,
                   const c10::BFloat16* bias, c10::BFloat16* y, int64_t m, int64_t n, int64_t k) {
  const int64_t groups = k / kInt8Group, row_pairs = (n + 2 * kAmxBlock - 1) / (2 * kAmxBlock);
  for (int64_t m0 = 0; m0 < m; m0 += kRowsPerPass) {
    const int64_t m_end = std::min(m, m0 + kRowsPerPass);
    const std::vector<int32_t> x_pairs = amx_x_pairs(x + m0 * k, m_end - m0, k);
    at::parallel_for(0, row_pairs, 1, [&](int64_t begin, int64_t end) {
      const liteinfer::TileConfig config(8);
      _tile_loadconfig(&config);
      thread_local std::vector<c10::BFloat16> weights;  // (kept: zeroing it each call cost more than the tiles)
      weights.resize(std::max<size_t>(weights.size(), 2 * kAmxBlock * k));
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t row0 = pair * 2 * kAmxBlock;
        amx_dequantize(w, scales_and_zeros, row0, n, k, weights.data());
        for (int64_t r0 = m0; r0 < m_end; r0 += 2 * kAmxBlock) {
          const int32_t* tiles = x_pairs.data() + (r0 - m0) / kAmxBlock * groups * kAmxBlock * kAmxBlock;
          if (m_end - r0 > kAmxBlock)
            amx_int8_pass<2>(weights.data(), tiles, groups, bias, y, row0, r0, m_end, n);
          else
            amx_int8_pass<1>(weights.data(), tiles, groups, bias, y, row0, r0, m_end, n);
        }
      }
      _tile_release();
    });
  }
}
#endif

template <typename out_t>
void int8_rows(const int8_t* w, const at::Half* scales_and_zeros, const std::vector<RowInputs>& x, const out_t* bias,
               out_t* y, int64_t n, int64_t k) {
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
          int8_tile<kTile>(w, scales_and_zeros, refs.data() + r, bias, y + r * n, b0, b_end, n, k);
        for (; r < m_end; ++r) int8_tile<1>(w, scales_and_zeros, refs.data() + r, bias, y + r * n, b0, b_end, n, k);
      }
    });
  }
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scales,
                const c10::optional<at::Tensor>& bias) {
  const bool int8 = weight.scalar_type() == at::kChar, int4 = weight.scalar_type() == at::kByte;
  TORCH_CHECK(x.dim() == 2 && (int8 ? x.size(0) >= 1 : x.size(0) == 1) && weight.dim() == 2 &&
                  x.size(1) == weight.size(1) * (int4 ? 2 : 1),
              "expected x [1, in] (int8: [rows, in]) and weight [out, in] (int4: [out, in / 2] bytes)");
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
#if defined(LITEINFER_GEMV_AMX)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      if (int8 && m >= kAmxMinRows && liteinfer::amx_permitted()) {
        int8_rows_amx(weight.data_ptr<int8_t>(), s.data_ptr<at::Half>(), xs, b_data, y_data, m, n, k);
        return;
      }
    }
#endif
    if (int8 || int4) {  // each row of x prepared once: every row of W reads it
      std::vector<RowInputs> rows;
      for (int64_t r = 0; r < m; ++r) rows.push_back(row_inputs(xs + r * k, k));
      if (int8) {
        int8_rows(weight.data_ptr<int8_t>(), s.data_ptr<at::Half>(), rows, b_data, y_data, n, k);
      } else {
        const uint8_t* w = weight.data_ptr<uint8_t>();
        const scalar_t* s_data = s.data_ptr<scalar_t>();
        const int64_t groups = k / kInt4Group;
        gemv_rows(
            [&](int64_t row) {
              const scalar_t* scales = s_data + row * groups * 2;
              return dot_row_int4(w + row * k / 2, row_ref(rows[0]), scales, scales + groups, groups);
            },
            b_data, y_data, n);
      }
    } else {
      const scalar_t* w = weight.data_ptr<scalar_t>();
      gemv_rows([&](int64_t row) { return dot_row(w + row * k, xs, k); }, b_data, y_data, n);
    }
  };
  x.scalar_type() == at::kFloat ? run(float{}) : run(c10::BFloat16{});
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(liteinfer, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(liteinfer, CPU, m) { m.impl("gemv", &gemv); }
