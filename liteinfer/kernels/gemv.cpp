// y = x W^T (+ b) for a single row x: the only product a decode step of one sequence has. Registered (CPU) as
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

namespace {

// Rows per pass: each x vector loaded is used kRows times; eight measured fastest (2, 4, 8 and 16 tried).
constexpr int64_t kRows = 8;

// y[r] = W[r]·x for R consecutive rows of W (row length k), in fp32. The portable form; AVX-512 ones follow.
template <typename scalar_t, int64_t R>
inline void dot_rows(const scalar_t* w, const scalar_t* x, int64_t k, float* y) {
  for (int64_t r = 0; r < R; ++r) {
    float sum = 0.f;
    for (int64_t i = 0; i < k; ++i) sum += static_cast<float>(w[r * k + i]) * static_cast<float>(x[i]);
    y[r] = sum;
  }
}

#if defined(__AVX512F__)
template <>
inline void dot_rows<float, kRows>(const float* w, const float* x, int64_t k, float* y) {
  __m512 acc[kRows];
  for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w + r * k + i), xv, acc[r]);
  }
  if (i < k) {  // the tail of a row, read under a mask: zeros past its end
    const __mmask16 mask = static_cast<__mmask16>((1u << (k - i)) - 1);
    const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i);
    for (int64_t r = 0; r < kRows; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, w + r * k + i), xv, acc[r]);
  }
  for (int64_t r = 0; r < kRows; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

#if defined(__AVX512BF16__)
// vdpbf16ps multiplies bf16 pairs and accumulates in fp32, as oneDNN's bf16 matmul does.
template <>
inline void dot_rows<c10::BFloat16, kRows>(const c10::BFloat16* w, const c10::BFloat16* x, int64_t k, float* y) {
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

template <typename scalar_t>
void gemv_rows(const scalar_t* x, const scalar_t* w, const scalar_t* bias, scalar_t* y, int64_t n, int64_t k) {
  // Each thread streams one contiguous share of W's rows.
  at::parallel_for(0, (n + kRows - 1) / kRows, 1, [&](int64_t begin, int64_t end) {
    float out[kRows];
    for (int64_t pass = begin; pass < end; ++pass) {
      const int64_t row = pass * kRows, rows = std::min(kRows, n - row);
      if (rows == kRows) {
        dot_rows<scalar_t, kRows>(w + row * k, x, k, out);
      } else {  // the last rows, when n is not a multiple of kRows
        for (int64_t r = 0; r < rows; ++r) dot_rows<scalar_t, 1>(w + (row + r) * k, x, k, out + r);
      }
      for (int64_t r = 0; r < rows; ++r)
        y[row + r] = static_cast<scalar_t>(bias ? out[r] + static_cast<float>(bias[row + r]) : out[r]);
    }
  });
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "expected x [1, in] and weight [out, in]");
  TORCH_CHECK(weight.is_contiguous(), "the weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and the weight must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "gemv takes fp32 or bf16");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                        bias->scalar_type() == weight.scalar_type()),
              "the bias must be [out], in the weight's dtype");
  const at::Tensor x_ = x.contiguous(), b = bias ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({1, weight.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "gemv", [&] {
    gemv_rows<scalar_t>(x_.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                        b.defined() ? b.data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(), weight.size(0),
                        weight.size(1));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(liteinfer, m) { m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(liteinfer, CPU, m) { m.impl("gemv", &gemv); }
