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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // the int8 tail's masked load: BW+VL
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

// int8 weights sign-extended and converted to fp32, against x widened to fp32 once per call.
template <>
struct Step<int8_t, float> {
  using Vec = __m512;
  static constexpr int64_t width = 16;
  static __m512 full(__m512 acc, const int8_t* w, const float* x) {
    const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
    return _mm512_fmadd_ps(wv, _mm512_loadu_ps(x), acc);
  }
  static __m512 tail(__m512 acc, const int8_t* w, const float* x, int64_t count) {
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w)));
    return _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x), acc);
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
#define LITEINFER_GEMV_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
// The same steps in 8 lanes (AVX2 CPUs; bf16 keeps the portable loop there, int8 takes dot_row_int8 below). With no
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

#if defined(__AVX2__) && defined(__FMA__)  // (AVX-512 CPUs have these too: the int4 row below uses them there)
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
#if defined(LITEINFER_GEMV_AVX512)
template <>
inline float dot_row<int8_t, float>(const int8_t* w, const float* x, int64_t k) {
  return dot_row_vector(w, x, k);
}
#endif
#if defined(__AVX512BF16__)
template <>
inline float dot_row<c10::BFloat16, c10::BFloat16>(const c10::BFloat16* w, const c10::BFloat16* x, int64_t k) {
  return dot_row_vector(w, x, k);
}
#endif
#endif

// int4 weights, in the layout layers/quantization.py packs them in for this kernel: each group of 64 inputs is 32
// bytes read as eight 32-bit lanes, lane l holding the levels q of inputs l, 8 + l, ..., 56 + l in its nibbles from
// the lowest up, so that one mask (a shift for the top nibble) gives eight consecutive inputs' levels (no byte
// shuffles); the weight is (q - 8) * scale + zero, one scale and zero per group.
constexpr int64_t kInt4Group = 64;

#if defined(__AVX2__) && defined(__FMA__)
// The levels of eight consecutive inputs of a group, as fp32, times 2^kShift: nibble kShift / 4 of every lane masked
// in place, its level q read as the integer q 2^kShift (exact in fp32: four significant bits), against x scaled by
// 2^-kShift once per call (int4_inputs below). The top nibble would read as negative, so it is shifted down instead.
// Two instructions per eight inputs where shift, mask and convert took three: 13.4-14.7 inputs per ns on one AMD
// Zen 3 core against 11.2-12.9 (SmolLM2's shapes, in cache or not).
template <int kShift>
inline __m256 int4_levels(__m256i lanes) {
  return _mm256_cvtepi32_ps(kShift == 28 ? _mm256_srli_epi32(lanes, 28)
                                         : _mm256_and_si256(lanes, _mm256_set1_epi32(0xF << kShift)));
}
#endif

// A row's sum of ((q - 8) s + z) x over its groups, as sum of s (q · x) + (z - 8 s) (sum of x): `x_sums` holds each
// group's sum of x, `scales_and_zeros` the row's (s, z) pairs, `x` the inputs as int4_inputs scales them.
template <typename scale_t>
inline float dot_row_int4(const uint8_t* w, const float* x, const scale_t* scales_and_zeros, const float* x_sums,
                          int64_t groups) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 total = _mm256_setzero_ps();  // the s (q · x) terms, reduced once at the end
#else
  float total = 0.f;
#endif
  float offset = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const float scale = static_cast<float>(scales_and_zeros[2 * g]);
    const float zero = static_cast<float>(scales_and_zeros[2 * g + 1]);
    const uint8_t* wg = w + g * kInt4Group / 2;
    const float* xg = x + g * kInt4Group;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg));
    // Two sums, each a chain of four; the next group's sums start afresh, so groups overlap.
    __m256 a0 = _mm256_mul_ps(int4_levels<0>(lanes), _mm256_loadu_ps(xg));
    __m256 a1 = _mm256_mul_ps(int4_levels<4>(lanes), _mm256_loadu_ps(xg + 8));
    a0 = _mm256_fmadd_ps(int4_levels<8>(lanes), _mm256_loadu_ps(xg + 16), a0);
    a1 = _mm256_fmadd_ps(int4_levels<12>(lanes), _mm256_loadu_ps(xg + 24), a1);
    a0 = _mm256_fmadd_ps(int4_levels<16>(lanes), _mm256_loadu_ps(xg + 32), a0);
    a1 = _mm256_fmadd_ps(int4_levels<20>(lanes), _mm256_loadu_ps(xg + 40), a1);
    a0 = _mm256_fmadd_ps(int4_levels<24>(lanes), _mm256_loadu_ps(xg + 48), a0);
    a1 = _mm256_fmadd_ps(int4_levels<28>(lanes), _mm256_loadu_ps(xg + 56), a1);
    total = _mm256_fmadd_ps(_mm256_add_ps(a0, a1), _mm256_set1_ps(scale), total);
#else
    float dot = 0.f;
    for (int64_t i = 0; i < kInt4Group; ++i) {  // input i: lane i % 8, nibble i / 8 (bytes little-endian)
      const uint8_t byte = wg[4 * (i % 8) + i / 16];
      dot += static_cast<float>(i / 8 % 2 ? byte >> 4 : byte & 0xF) * xg[i];
    }
    total += scale * dot;
#endif
    offset += (zero - 8 * scale) * x_sums[g];
  }
#if defined(__AVX2__) && defined(__FMA__)
  return reduce(total) + offset;
#else
  return total + offset;
#endif
}

// x (fp32 or bf16) as dot_row_int4 reads it, in fp32: `scaled`, with AVX2 each input times 2^-kShift for the nibble
// int4_levels finds its level in (powers of two: exact), as given otherwise; `sums`, each group's sum of x. One pass a group, which the
// compiler vectorises: the sums as one serial chain of adds plus a pass of their own for the scaled copy took ~5 us
// of a ~70 us call in the engine, this ~1 us.
struct Int4Inputs {
  std::vector<float> scaled, sums;
};

template <typename scalar_t>
inline Int4Inputs int4_inputs(const scalar_t* x, int64_t k) {
#if defined(__AVX2__) && defined(__FMA__)
  constexpr float kScales[8] = {1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.f};  // top: shifted
#else
  constexpr float kScales[8] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
#endif
  Int4Inputs inputs{std::vector<float>(k), std::vector<float>(k / kInt4Group)};
  for (int64_t g = 0; g < k / kInt4Group; ++g) {
    const scalar_t* xg = x + g * kInt4Group;
    float* scaled = inputs.scaled.data() + g * kInt4Group;
    float sum = 0.f;
    for (int64_t i = 0; i < kInt4Group; ++i) {
      const float xi = static_cast<float>(xg[i]);
      sum += xi;
      scaled[i] = xi * kScales[i / 8];
    }
    inputs.sums[g] = sum;
  }
  return inputs;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(LITEINFER_GEMV_AVX512)
// int8 rows on AVX2 CPUs, in integers: x rounded to 16-bit levels per group of 64 inputs (level = x / scale, scale
// = the group's largest |x| / 32767), each group's sum of levels times weights taken by vpmaddwd in int32 (exact:
// at most 64 * 127 * 32767 < 2^31), then scaled. Sixteen weights a multiply, where widening them to fp32 took two
// conversions per eight; the rounding of x is a relative 2^-16 of its group's largest value, below bf16's own
// (2^-9) and 2^8 times below the weights' (2^-8 of their row's largest). SmolLM2's int8 linears streamed 6-15%
// faster from memory, ~35% faster from cache (docs/benchmarks.md). AVX-512 CPUs keep the fp32 step above, measured
// there and not here.
#define LITEINFER_GEMV_INT16_INPUTS
constexpr int64_t kInt16Group = 64;

struct Int16Inputs {
  std::vector<int16_t> levels;  // x[i] ≈ levels[i] * scales[i / kInt16Group]
  std::vector<float> scales;
};

template <typename scalar_t>
inline Int16Inputs int16_inputs(const scalar_t* x, int64_t k) {
  const int64_t groups = (k + kInt16Group - 1) / kInt16Group;
  Int16Inputs inputs{std::vector<int16_t>(k), std::vector<float>(groups)};
  const std::vector<float> x_float(x, x + k);
  const float* xf = x_float.data();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = g * kInt16Group, end = std::min(k, begin + kInt16Group);
    float largest = 0.f;
    for (int64_t i = begin; i < end; ++i) largest = std::max(largest, std::fabs(xf[i]));
    inputs.scales[g] = largest / 32767.f;
    const float inverse = largest > 0.f ? 32767.f / largest : 0.f;
    int16_t* levels = inputs.levels.data();
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {  // (the compiler leaves lrintf's loop scalar)
      const __m256i rounded = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xf + i), _mm256_set1_ps(inverse)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(levels + i),
                       _mm_packs_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
    }
    for (; i < end; ++i) levels[i] = static_cast<int16_t>(std::lrintf(xf[i] * inverse));
  }
  return inputs;
}

inline float dot_row_int8(const int8_t* w, const Int16Inputs& inputs, int64_t k) {
  const int16_t* levels = inputs.levels.data();
  auto products = [&](int64_t i) {  // 16 weights times their levels, summed in pairs: eight int32
    return _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i))),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(levels + i)));
  };
  __m256 total = _mm256_setzero_ps();
  int64_t i = 0, g = 0;
  for (; i + kInt16Group <= k; i += kInt16Group, ++g) {
    const __m256i group = _mm256_add_epi32(_mm256_add_epi32(products(i), products(i + 16)),
                                           _mm256_add_epi32(products(i + 32), products(i + 48)));
    total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group), _mm256_set1_ps(inputs.scales[g]), total);
  }
  float result = reduce(total);
  if (i < k) {  // the last, partial group
    int32_t group = 0;
    for (; i < k; ++i) group += static_cast<int32_t>(w[i]) * levels[i];
    result += static_cast<float>(group) * inputs.scales[g];
  }
  return result;
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
    TORCH_CHECK(k % kInt4Group == 0, "int4 weights come in groups of 64 inputs");
    TORCH_CHECK(scales && scales->dim() == 3 && scales->size(0) == n && scales->size(1) == k / kInt4Group &&
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
    if (int8) {  // x rounded to levels (AVX2) or widened to fp32 (otherwise) once: every row reads it
      const int8_t* w = weight.data_ptr<int8_t>();
#if defined(LITEINFER_GEMV_INT16_INPUTS)
      const Int16Inputs inputs = int16_inputs(xs, k);
      gemv_rows([&](int64_t row) { return dot_row_int8(w + row * k, inputs, k) * static_cast<float>(s_data[row]); },
                b_data, y_data, n);
#else
      const std::vector<float> x_float(xs, xs + k);
      const float* xf = x_float.data();
      gemv_rows([&](int64_t row) { return dot_row(w + row * k, xf, k) * static_cast<float>(s_data[row]); },
                b_data, y_data, n);
#endif
    } else if (int4) {  // x widened to fp32 as it is scaled, once
      const int64_t groups = k / kInt4Group;
      const Int4Inputs inputs = int4_inputs(xs, k);
      const uint8_t* w = weight.data_ptr<uint8_t>();
      gemv_rows([&](int64_t row) {
        return dot_row_int4(w + row * k / 2, inputs.scaled.data(), s_data + row * groups * 2, inputs.sums.data(),
                            groups);
      }, b_data, y_data, n);
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
