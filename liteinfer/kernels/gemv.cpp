// y = x (W * scales)^T (+ b) for a single row x: the only product a decode step of one sequence has. W is float
// (fp32 or bf16, as x) or int8 with one scale per row (layers/quantization.py's int8). Registered (CPU) as
// torch.ops.liteinfer.gemv; liteinfer/kernels/__init__.py builds it and gives its contract.
//
// At one row a linear layer is a stream through W, bound by memory bandwidth. oneDNN's prepacked matmul reached
// ~35-42 GB/s on SmolLM2's layers here; streaming W's rows in their checkpoint layout, eight rows at a time
// against one register copy of x, reached ~50 (bf16) and ~60 GB/s (fp32) (docs/benchmarks.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// Rows per pass: each x vector loaded is used kRows times; eight measured fastest (2, 4, 8 and 16 tried).
constexpr int64_t kRows = 8;

// y[r] = W[r]·x for R consecutive rows of W (row length k), in fp32. The portable form; AVX-512 ones follow.
template <typename weight_t, typename x_t, int64_t R>
inline void dot_rows(const weight_t* w, const x_t* x, int64_t k, float* y) {
  for (int64_t r = 0; r < R; ++r) {
    float sum = 0.f;
    for (int64_t i = 0; i < k; ++i) sum += static_cast<float>(w[r * k + i]) * static_cast<float>(x[i]);
    y[r] = sum;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // the int8 tail's masked load: BW+VL
// Sixteen weights as fp32: float ones loaded, int8 ones sign-extended and converted; under a mask, zeros past it.
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const float* w, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, w); }
inline __m512 load16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
inline __m512 load16(const int8_t* w, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w)));
}

// fp32 or int8 rows against fp32 x.
template <typename weight_t>
inline void dot_rows_fp32(const weight_t* w, const float* x, int64_t k, float* y) {
  __m512 acc[kRows];
  for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  int64_t i = 0;
  // Plain loads in the loop and a masked one for the tail only: masking every load ran at half the speed.
  for (; i + 16 <= k; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(load16(w + r * k + i), xv, acc[r]);
  }
  if (i < k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - i)) - 1);
    const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i);
    for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(load16(w + r * k + i, mask), xv, acc[r]);
  }
  for (int64_t r = 0; r < kRows; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}

template <>
inline void dot_rows<float, float, kRows>(const float* w, const float* x, int64_t k, float* y) {
  dot_rows_fp32(w, x, k, y);
}

template <>
inline void dot_rows<int8_t, float, kRows>(const int8_t* w, const float* x, int64_t k, float* y) {
  dot_rows_fp32(w, x, k, y);
}
#endif

#if defined(__AVX512BF16__)
// vdpbf16ps multiplies bf16 pairs and accumulates in fp32, as oneDNN's bf16 matmul does.
template <>
inline void dot_rows<c10::BFloat16, c10::BFloat16, kRows>(const c10::BFloat16* w, const c10::BFloat16* x, int64_t k,
                                                          float* y) {
  __m512 acc[kRows];
  for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i);
    for (int64_t r = 0; r < kRows; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w + r * k + i), xv);
  }
  if (i < k) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (k - i)) - 1);
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i);
    for (int64_t r = 0; r < kRows; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * k + i), xv);
  }
  for (int64_t r = 0; r < kRows; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

template <typename weight_t, typename x_t, typename out_t>
void gemv_rows(const x_t* x, const weight_t* w, const out_t* scales, const out_t* bias, out_t* y, int64_t n,
               int64_t k) {
  // Each thread streams one contiguous share of W's rows.
  at::parallel_for(0, (n + kRows - 1) / kRows, 1, [&](int64_t begin, int64_t end) {
    float out[kRows];
    for (int64_t pass = begin; pass < end; ++pass) {
      const int64_t row = pass * kRows, rows = std::min(kRows, n - row);
      if (rows == kRows) {
        dot_rows<weight_t, x_t, kRows>(w + row * k, x, k, out);
      } else {  // the last rows, when n is not a multiple of kRows
        for (int64_t r = 0; r < rows; ++r) dot_rows<weight_t, x_t, 1>(w + (row + r) * k, x, k, out + r);
      }
      for (int64_t r = 0; r < rows; ++r) {
        float v = scales ? out[r] * static_cast<float>(scales[row + r]) : out[r];
        y[row + r] = static_cast<out_t>(bias ? v + static_cast<float>(bias[row + r]) : v);
      }
    }
  });
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scales,
                const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "expected x [1, in] and weight [out, in]");
  TORCH_CHECK(weight.is_contiguous(), "the weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "gemv takes fp32 or bf16 x");
  const bool int8 = weight.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || x.scalar_type() == weight.scalar_type(), "x and a float weight must share a dtype");
  TORCH_CHECK(int8 == scales.has_value(), "an int8 weight takes one scale per row, a float weight none");
  for (const auto& t : {scales, bias}) {
    TORCH_CHECK(!t || (t->dim() == 1 && t->size(0) == weight.size(0) && t->scalar_type() == x.scalar_type()),
                "scales and bias must be [out], in x's dtype");
  }
  const int64_t n = weight.size(0), k = weight.size(1);
  const at::Tensor x_ = x.contiguous(), s = scales ? scales->contiguous() : at::Tensor(),
                   b = bias ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({1, n}, x.options());
  auto run = [&](auto x_type) {  // for x in fp32 or bf16, the two dtypes checked above
    using scalar_t = decltype(x_type);
    const scalar_t* s_data = s.defined() ? s.data_ptr<scalar_t>() : nullptr;
    const scalar_t* b_data = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
    if (int8) {  // x widened to fp32 once: every row reads it
      std::vector<float> x_float(x_.data_ptr<scalar_t>(), x_.data_ptr<scalar_t>() + k);
      gemv_rows<int8_t, float, scalar_t>(x_float.data(), weight.data_ptr<int8_t>(), s_data, b_data,
                                         y.data_ptr<scalar_t>(), n, k);
    } else {
      gemv_rows<scalar_t, scalar_t, scalar_t>(x_.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), nullptr, b_data,
                                              y.data_ptr<scalar_t>(), n, k);
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
