// The index of each row's largest value, the first one where several tie (torch.argmax's answer): the greedy
// token of every row of a step's logits. Registered (CPU) as torch.ops.liteinfer.argmax; liteinfer/kernels/__init__.py
// builds it and gives its contract. Beside it, `head_candidates`: the tokens that can still be a row's greedy token
// when its logits are known only to within a bound (layers/greedy_head.py, which screens an fp32 head in bf16).
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

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
// Sixteen values as fp32; under a mask, -inf past it.
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const float* x, __mmask16 mask) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), mask, x);
}
inline __m512 widen(__m256i bf16_bits) {  // bf16 is the top half of an fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits), 16));
}
inline __m512 load16(const c10::BFloat16* x) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))); }
inline __m512 load16(const c10::BFloat16* x, __mmask16 mask) {
  return _mm512_mask_blend_ps(mask, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                              widen(_mm256_maskz_loadu_epi16(mask, x)));
}

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
  for (; i + 16 <= n; i += 16) keep_larger(load16(x + i));
  if (i < n) keep_larger(load16(x + i, static_cast<__mmask16>((1u << (n - i)) - 1)));
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

// head_candidates: for each row r of approximate logits a, a token j stays a candidate unless some token k is surely
// larger: a[r, j] + e(r, j) < a[r, k] - e(r, k), with e(r, j) = row[r, 0] * vocab[0, j] + row[r, 1] * vocab[1, j]
// + row[r, 2] + relative * |a[r, j]|. Two passes over a row: the largest lower end, then the tokens whose upper end
// reaches it. The answer is the union over the rows, ascending; empty when some approximate logit is not finite (the
// caller then computes the logits themselves).
struct RowBound {
  float alpha, beta, absolute, relative;
  float error(float a, float norm, float rounding) const {
    return alpha * norm + beta * rounding + absolute + relative * std::fabs(a);
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// Sixteen tokens at a time; a lane past the row's end reads nothing and counts for nothing. The first pass also keeps
// the largest upper end of each run of kRun tokens, so that the second revisits only the runs that hold candidates
// (one or two of a row's few hundred, on a real model's logits).
constexpr int64_t kRun = 128;

bool row_candidates(const uint16_t* a, const float* norm, const float* rounding, int64_t n, RowBound b,
                    std::vector<int32_t>& out) {
  const __m512 alpha = _mm512_set1_ps(b.alpha), beta = _mm512_set1_ps(b.beta);
  const __m512 absolute = _mm512_set1_ps(b.absolute), relative = _mm512_set1_ps(b.relative);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i exponent = _mm256_set1_epi16(0x7F80);
  __mmask16 not_finite = 0;
  // Value and error of the sixteen tokens from j on (those under `mask`).
  auto load = [&](int64_t j, __mmask16 mask, __m512& v, __m512& e) {
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, a + j);
    not_finite |= _mm256_mask_cmpeq_epi16_mask(mask, _mm256_and_si256(bits, exponent), exponent);
    v = widen(bits);
    e = _mm512_fmadd_ps(alpha, _mm512_maskz_loadu_ps(mask, norm + j),
                        _mm512_fmadd_ps(beta, _mm512_maskz_loadu_ps(mask, rounding + j),
                                        _mm512_fmadd_ps(relative, _mm512_abs_ps(v), absolute)));
  };
  auto tail = [&](int64_t j) {
    return static_cast<__mmask16>(n - j >= 16 ? 0xFFFF : (1u << (n - j)) - 1);
  };
  std::vector<float> run_upper((n + kRun - 1) / kRun);
  __m512 lower = minus_inf;
  for (int64_t run = 0; run * kRun < n; ++run) {
    __m512 upper = minus_inf;
    for (int64_t j = run * kRun; j < std::min(n, (run + 1) * kRun); j += 16) {
      const __mmask16 mask = tail(j);
      __m512 v, e;
      load(j, mask, v, e);
      lower = _mm512_mask_max_ps(lower, mask, lower, _mm512_sub_ps(v, e));
      upper = _mm512_mask_max_ps(upper, mask, upper, _mm512_add_ps(v, e));
    }
    run_upper[run] = _mm512_reduce_max_ps(upper);
  }
  const float largest_lower = _mm512_reduce_max_ps(lower);
  for (int64_t run = 0; run * kRun < n; ++run) {
    if (run_upper[run] < largest_lower) continue;
    for (int64_t j = run * kRun; j < std::min(n, (run + 1) * kRun); j += 16) {
      const __mmask16 mask = tail(j);
      __m512 v, e;
      load(j, mask, v, e);
      for (uint32_t hits = _mm512_mask_cmp_ps_mask(mask, _mm512_add_ps(v, e), _mm512_set1_ps(largest_lower),
                                                   _CMP_GE_OQ);
           hits; hits &= hits - 1) {
        out.push_back(static_cast<int32_t>(j + __builtin_ctz(hits)));
      }
    }
  }
  return not_finite == 0;
}
#else
bool row_candidates(const uint16_t* a, const float* norm, const float* rounding, int64_t n, RowBound b,
                    std::vector<int32_t>& out) {
  auto value = [&](int64_t j) { return c10::detail::f32_from_bits(a[j]); };
  bool finite = true;
  float lower = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    finite = finite && (a[j] & 0x7F80) != 0x7F80;  // the exponent not all ones
    lower = std::max(lower, value(j) - b.error(value(j), norm[j], rounding[j]));
  }
  for (int64_t j = 0; j < n; ++j) {
    if (value(j) + b.error(value(j), norm[j], rounding[j]) >= lower) out.push_back(static_cast<int32_t>(j));
  }
  return finite;
}
#endif

at::Tensor head_candidates(const at::Tensor& approx, const at::Tensor& row_terms, const at::Tensor& vocab_terms,
                           double relative) {
  TORCH_CHECK(approx.dim() == 2 && approx.scalar_type() == at::kBFloat16 && approx.is_contiguous(),
              "expected approximate logits [rows, vocab], bf16, contiguous");
  const int64_t rows = approx.size(0), n = approx.size(1);
  TORCH_CHECK(n > 0 && n <= std::numeric_limits<int32_t>::max(), "a row's indices must fit in int32");
  TORCH_CHECK(row_terms.sizes() == at::IntArrayRef({rows, 3}) && row_terms.scalar_type() == at::kFloat &&
                  row_terms.is_contiguous(), "expected row terms [rows, 3] fp32, contiguous");
  TORCH_CHECK(vocab_terms.sizes() == at::IntArrayRef({2, n}) && vocab_terms.scalar_type() == at::kFloat &&
                  vocab_terms.is_contiguous(), "expected vocab terms [2, vocab] fp32, contiguous");
  const uint16_t* a = reinterpret_cast<const uint16_t*>(approx.data_ptr<at::BFloat16>());
  const float* terms = row_terms.data_ptr<float>();
  const float* norm = vocab_terms.data_ptr<float>();
  const float* rounding = norm + n;
  std::vector<std::vector<int32_t>> found(rows);
  std::vector<char> finite(rows, 1);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const RowBound bound{terms[3 * r], terms[3 * r + 1], terms[3 * r + 2], static_cast<float>(relative)};
      finite[r] = row_candidates(a + r * n, norm, rounding, n, bound, found[r]);
    }
  });
  std::vector<char> chosen(n, 0);
  for (int64_t r = 0; r < rows; ++r) {
    if (!finite[r]) return at::empty({0}, approx.options().dtype(at::kLong));
    for (const int32_t j : found[r]) chosen[j] = 1;
  }
  std::vector<int64_t> ids;
  for (int64_t j = 0; j < n; ++j) {
    if (chosen[j]) ids.push_back(j);
  }
  at::Tensor out = at::empty({static_cast<int64_t>(ids.size())}, approx.options().dtype(at::kLong));
  std::copy(ids.begin(), ids.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(liteinfer, m) {
  m.def("argmax(Tensor logits) -> Tensor");
  m.def("head_candidates(Tensor approx, Tensor row_terms, Tensor vocab_terms, float relative) -> Tensor");
}

TORCH_LIBRARY_IMPL(liteinfer, CPU, m) {
  m.impl("argmax", &argmax);
  m.impl("head_candidates", &head_candidates);
}
