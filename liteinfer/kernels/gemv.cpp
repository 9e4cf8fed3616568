// y = x (W * scales)^T (+ b) for a single row x: the only product a decode step of one sequence has. W is float
// (fp32 or bf16, as x), int8 with one scale per row, or int4 with a scale and a zero per group of 64 inputs
// (layers/quantization.py's int8 and int4). Registered (CPU) as torch.ops.liteinfer.gemv;
// liteinfer/kernels/__init__.py builds it and gives its contract.
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

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// Quantized rows. int8: one scale per row. int4: a scale and a zero per group of 64 inputs, the weight being
// (q - 8) * scale + zero; each group's 64 levels q are 32 bytes, read as sixteen little-endian 16-bit lanes, lane l
// holding the levels of inputs l, 16 + l, 32 + l, 48 + l in its nibbles from the lowest up
// (layers/quantization.py: gemv_int4_layout), so that one shift and one mask give sixteen consecutive inputs' levels
// as 16-bit integers, with no byte shuffles.
constexpr int64_t kGroup = 64;  // int4's group of inputs, and the group x is rounded in below

#if defined(__AVX2__) && defined(__FMA__)
// On x86 CPUs the products are taken in integers: x is rounded once per call to 16-bit levels per group of 64
// inputs (level = x / scale, scale = the group's largest |x| / 32767), and each group's sum of weight levels times
// x levels is exact in int32 (at most 64 * 127 * 32767 < 2^31), then scaled. Sixteen weights a multiply
// (vpmaddwd, or AVX-512 VNNI's vpdpwssd, which adds as it multiplies), where converting them to fp32 took a
// conversion per eight or sixteen. Rounding x moves each input by at most half a level: a relative 2^-16 of its
// group's largest value, below bf16's own rounding (2^-9) and far below the weights' (int8: 2^-8 of the row's
// largest). On AMD Zen 3 (AVX2) this made SmolLM2's int8 linears 6-15% faster from memory and ~35% from cache; on
// AMD Zen 4 (AVX-512, whose 512-bit operations run as two 256-bit halves) int8 16-18% and int4 15-19% faster from
// memory, 19-33% from cache, against fp32 widening in 16 lanes (int4: in 8; in 16 it was no faster). On the AMD
// Zen 5 an earlier int16 prototype of int8 was no faster than fp32 widening (docs/benchmarks.md): not measured
// there since.
#define LITEINFER_GEMV_INT16_INPUTS

struct Int16Inputs {
  std::vector<int16_t> levels;  // x[i] ≈ levels[i] * scales[i / kGroup]
  std::vector<float> scales;
  std::vector<float> sums;  // each group's sum of levels, times its scale: the sum of x as rounded
};

template <typename scalar_t>
inline Int16Inputs int16_inputs(const scalar_t* x, int64_t k) {
  const int64_t groups = (k + kGroup - 1) / kGroup;
  Int16Inputs inputs{std::vector<int16_t>(k), std::vector<float>(groups), std::vector<float>(groups)};
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
    int32_t sum = 0;
    for (i = begin; i < end; ++i) sum += levels[i];
    inputs.sums[g] = static_cast<float>(sum) * inputs.scales[g];
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

// One whole group's sum of weight levels times x levels, in eight int32 lanes; `weights(j)` gives the levels of
// inputs 16 j .. 16 j + 15 as 16-bit integers. Each group starts a chain of its own, so groups overlap.
template <typename Weights>
inline __m256 group_sum(const Weights& weights, const int16_t* x) {
  __m256i acc = multiply_add(_mm256_setzero_si256(), weights(0), x);
  acc = multiply_add(acc, weights(1), x + 16);
  acc = multiply_add(acc, weights(2), x + 32);
  acc = multiply_add(acc, weights(3), x + 48);
  return _mm256_cvtepi32_ps(acc);
}

inline float dot_row_int8(const int8_t* w, const Int16Inputs& inputs, int64_t k) {
  const int16_t* levels = inputs.levels.data();
  __m256 total = _mm256_setzero_ps();
  int64_t i = 0, g = 0;
  for (; i + kGroup <= k; i += kGroup, ++g) {
    auto weights = [&](int64_t j) {
      return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i + 16 * j)));
    };
    total = _mm256_fmadd_ps(group_sum(weights, levels + i), _mm256_set1_ps(inputs.scales[g]), total);
  }
  float result = reduce(total);
  if (i < k) {  // the last, partial group
    int32_t group = 0;
    for (; i < k; ++i) group += static_cast<int32_t>(w[i]) * levels[i];
    result += static_cast<float>(group) * inputs.scales[g];
  }
  return result;
}

// A row's sum of ((q - 8) s + z) x over its groups, as sum of s (q · x) + (z - 8 s) (sum of x); `scales_and_zeros`
// holds the row's (s, z) pairs.
template <typename scale_t>
inline float dot_row_int4(const uint8_t* w, const Int16Inputs& inputs, const scale_t* scales_and_zeros,
                          int64_t groups) {
  const __m256i nibble = _mm256_set1_epi16(0xF);
  __m256 total = _mm256_setzero_ps();  // the s (q · x) terms, reduced once at the end
  float offset = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const float scale = static_cast<float>(scales_and_zeros[2 * g]);
    const float zero = static_cast<float>(scales_and_zeros[2 * g + 1]);
    const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * kGroup / 2));
    auto weights = [&](int64_t j) {  // nibble j of every lane (the top one needs no mask)
      const __m256i shifted = _mm256_srli_epi16(lanes, static_cast<int>(4 * j));
      return j == 3 ? shifted : _mm256_and_si256(shifted, nibble);
    };
    total = _mm256_fmadd_ps(group_sum(weights, inputs.levels.data() + g * kGroup),
                            _mm256_set1_ps(scale * inputs.scales[g]), total);
    offset += (zero - 8 * scale) * inputs.sums[g];
  }
  return reduce(total) + offset;
}
#else
// The portable forms, in fp32 against x as given.
inline float dot_row_int8(const int8_t* w, const float* x, int64_t k) { return dot_row(w, x, k); }

template <typename scale_t>
inline float dot_row_int4(const uint8_t* w, const float* x, const scale_t* scales_and_zeros, int64_t groups) {
  float sum = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const float scale = static_cast<float>(scales_and_zeros[2 * g]);
    const float zero = static_cast<float>(scales_and_zeros[2 * g + 1]);
    const uint8_t* wg = w + g * kGroup / 2;
    for (int64_t i = 0; i < kGroup; ++i) {  // input i: lane i % 16, nibble i / 16 (lanes little-endian)
      const uint8_t byte = wg[2 * (i % 16) + i / 32];
      const int q = i / 16 % 2 ? byte >> 4 : byte & 0xF;
      sum += ((q - 8) * scale + zero) * x[g * kGroup + i];
    }
  }
  return sum;
}
#endif

// y[row] = row_dot(row) (+ bias[row]) for rows 0..n, each thread streaming one contiguous share of W's rows.
template <typename out_t, typename RowDot>
void gemv_rows(const RowDot& row_dot, const out_t* bias, out_t* y, int64_t n) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float v = row_dot(row);
      y[row] = static_cast<out_t>(bias ? v + static_cast<float>(bias[row]) : v);
    }
  });
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scales,
                const c10::optional<at::Tensor>& bias) {
  const bool int8 = weight.scalar_type() == at::kChar, int4 = weight.scalar_type() == at::kByte;
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && weight.dim() == 2 && x.size(1) == weight.size(1) * (int4 ? 2 : 1),
              "expected x [1, in] and weight [out, in] (int4: [out, in / 2] bytes)");
  TORCH_CHECK(weight.is_contiguous(), "the weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "gemv takes fp32 or bf16 x");
  TORCH_CHECK(int8 || int4 || x.scalar_type() == weight.scalar_type(), "x and a float weight must share a dtype");
  const int64_t n = weight.size(0), k = x.size(1);
  if (int4) {
    TORCH_CHECK(k % kGroup == 0, "int4 weights come in groups of 64 inputs");
    TORCH_CHECK(scales && scales->dim() == 3 && scales->size(0) == n && scales->size(1) == k / kGroup &&
                    scales->size(2) == 2 && scales->scalar_type() == x.scalar_type(),
                "an int4 weight takes [out, in / 64, 2] scales and zeros, in x's dtype");
  } else {
    TORCH_CHECK(int8 == scales.has_value(), "an int8 weight takes one scale per row, a float weight none");
  }
  for (const auto& t : {int4 ? c10::optional<at::Tensor>() : scales, bias}) {  // (int4's scales are checked above)
    TORCH_CHECK(!t || (t->dim() == 1 && t->size(0) == n && t->scalar_type() == x.scalar_type()),
                "scales and bias must be [out], in x's dtype");
  }
  const at::Tensor x_ = x.contiguous(), s = scales ? scales->contiguous() : at::Tensor(),
                   b = bias ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({1, n}, x.options());
  auto run = [&](auto x_type) {  // for x in fp32 or bf16, the two dtypes checked above
    using scalar_t = decltype(x_type);
    const scalar_t* s_data = s.defined() ? s.data_ptr<scalar_t>() : nullptr;
    const scalar_t* b_data = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
    scalar_t* y_data = y.data_ptr<scalar_t>();
    const scalar_t* xs = x_.data_ptr<scalar_t>();
    if (int8 || int4) {  // x rounded to levels (x86) or widened to fp32 (otherwise) once: every row reads it
#if defined(LITEINFER_GEMV_INT16_INPUTS)
      const Int16Inputs inputs = int16_inputs(xs, k);
#else
      const std::vector<float> x_float(xs, xs + k);
      const float* inputs = x_float.data();
#endif
      if (int8) {
        const int8_t* w = weight.data_ptr<int8_t>();
        gemv_rows([&](int64_t row) { return dot_row_int8(w + row * k, inputs, k) * static_cast<float>(s_data[row]); },
                  b_data, y_data, n);
      } else {
        const uint8_t* w = weight.data_ptr<uint8_t>();
        const int64_t groups = k / kGroup;
        gemv_rows([&](int64_t row) { return dot_row_int4(w + row * k / 2, inputs, s_data + row * groups * 2, groups); },
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
