// The index of each row's largest value, the first one where several tie (torch.argmax's answer): the greedy
// token of every row of a step's logits. Registered (CPU) as torch.ops.liteinfer.argmax; liteinfer/kernels/__init__.py
// builds it and gives its contract.
//
// PyTorch's CPU argmax compares one element at a time (~35 µs per 49k-token row here, ~5x that in bf16); the sampler
// ran it on every step's logits, behind a widening copy of bf16 ones. One pass of 16-lane compares reads a row at
// memory speed, bf16 widened in registers (docs/benchmarks.md); CPUs with AVX2 and no AVX-512 compare 8 lanes at a
// time (a 49k-token bf16 row 42 µs in the portable loop on an AMD Zen 3, 13 in 8 lanes).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <limits>

#include "lanes16.h"

namespace {

// The portable form: first index of the largest value of x[0..n), NaN skipped (as the vector form skips it).
template <typename scalar_t>
int64_t argmax_row_scalar(const scalar_t* x, int64_t n) {
  int64_t best = 0;
  float best_value = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (v > best_value) best_value = v, best = i;
  }
  return best;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // the bf16 tail's masked load: BW+VL
using liteinfer::load_row16;

// Each lane keeps the largest value it saw and where, replacing it only on a strictly larger one (so the first of
// equals stays); then, of the lanes holding the overall largest value, the smallest index wins.
template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t n) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i best_index = _mm512_setzero_si512();
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  auto keep_larger = [&](__m512 v) {
    const __mmask16 larger = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_blend_ps(larger, best, v);
    best_index = _mm512_mask_blend_epi32(larger, best_index, index);
    index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) keep_larger(load_row16(x + i));
  if (i < n) keep_larger(load_row16(x + i, liteinfer::first_lanes(n - i)));
  // A lane that saw nothing above -inf keeps index 0: the answer when every value is -inf.
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(at_top, best_index);
}
#elif defined(__AVX2__)
// The same in 8 lanes: no masked loads, so the tail (under 8 values) is compared one at a time after the lanes.
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t n) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256i best_index = _mm256_setzero_si256();
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i), larger = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, larger);
    best_index = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(best_index), _mm256_castsi256_ps(index), larger));
    index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
  }
  alignas(32) float lane_best[8];
  alignas(32) int32_t lane_index[8];
  _mm256_store_ps(lane_best, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_index), best_index);
  // Of the lanes holding the largest value, the smallest index; a lane that saw nothing above -inf holds index 0,
  // the answer when every value is -inf. Then the tail, whose indices all come after the lanes'.
  float best_value = lane_best[0];
  int64_t answer = lane_index[0];
  for (int lane = 1; lane < 8; ++lane) {
    if (lane_best[lane] > best_value || (lane_best[lane] == best_value && lane_index[lane] < answer))
      best_value = lane_best[lane], answer = lane_index[lane];
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (v > best_value) best_value = v, answer = i;
  }
  return answer;
}
#else
template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t n) {
  return argmax_row_scalar(x, n);
}
#endif

at::Tensor argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "expected logits [rows, vocab] with vocab > 0");
  TORCH_CHECK(logits.size(1) <= std::numeric_limits<int32_t>::max(), "a row's indices must fit in int32");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "argmax takes fp32 or bf16 logits");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* out_data = out.data_ptr<int64_t>();
  auto run = [&](auto type) {
    using scalar_t = decltype(type);
    const scalar_t* data = x.data_ptr<scalar_t>();
    // A row is a few microseconds: threads only pay off over several.
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) out_data[r] = argmax_row(data + r * n, n);
    });
  };
  x.scalar_type() == at::kFloat ? run(float{}) : run(c10::BFloat16{});
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(liteinfer, m) {
  m.def("argmax(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(liteinfer, CPU, m) {
  m.impl("argmax", &argmax);
}
