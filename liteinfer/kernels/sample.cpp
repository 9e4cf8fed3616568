// Each row's token drawn from softmax(logits / temperature), truncated by min_p, top_k and top_p, at a uniform u:
// the first token whose running sum of weights e^((l - max) / T) passes u times the row's total (inverse CDF).
// Registered (CPU) as torch.ops.liteinfer.sample; liteinfer/kernels/__init__.py builds it and gives its contract.
//
// The sampler drew tokens as argmax(p / E) over the whole vocabulary, E exponential noise: a [rows, vocab] float
// copy, a temperature division, a softmax, a uniform and a log per token, each a fresh 50 MB tensor at 256 rows of
// SmolLM2's vocabulary (~134 ms a step on an AMD Zen 4), and min-p, top-k and top-p edited a float copy, top-p
// sorting every row whose nucleus was large. Here one uniform a row, the weights in a row-sized buffer (in L2), bf16
// logits read as they are, the truncations' cutoffs found without sorting a row (docs/benchmarks.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "exp16.h"
#include "lanes16.h"

namespace {

// e^x below this is taken as 0: a token 87 nats under the row's best (after temperature) weighs under 1e-38 of it,
// and -inf logits (masked tokens) fall below it too, so they are never drawn.
constexpr float kLowest = -87.f;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // the bf16 tail's masked load: BW+VL
using liteinfer::first_lanes;
using liteinfer::load_row16;

// The largest of a row's n values.
template <typename scalar_t>
float row_max(const scalar_t* x, int64_t n) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) top = _mm512_max_ps(top, load_row16(x + i, first_lanes(n - i)));
  return _mm512_reduce_max_ps(top);
}

// weights[i] = e^((x[i] - max) * inv_t), 0 below kLowest, for a row's n values (n rounded up to 16, the tail 0),
// and each 16's sum into `sums`.
template <typename scalar_t>
void row_weights(const scalar_t* x, int64_t n, float max, float inv_t, float* weights, float* sums) {
  const __m512 shift = _mm512_set1_ps(max), scale = _mm512_set1_ps(inv_t), lowest = _mm512_set1_ps(kLowest);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 t = _mm512_mul_ps(_mm512_sub_ps(load_row16(x + i, first_lanes(n - i)), shift), scale);
    // NaN and -inf compare false: weight 0 (an intrinsic compare, which -ffast-math does not fold).
    const __m512 w = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(t, lowest, _CMP_GE_OQ),
                                         liteinfer::exp16(_mm512_max_ps(t, lowest)));
    _mm512_storeu_ps(weights + i, w);
    sums[i / 16] = _mm512_reduce_add_ps(w);
  }
}
#else
template <typename scalar_t>
float row_max(const scalar_t* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) top = std::max(top, static_cast<float>(x[i]));
  return top;
}

template <typename scalar_t>
void row_weights(const scalar_t* x, int64_t n, float max, float inv_t, float* weights, float* sums) {
  for (int64_t i = 0; i < n; i += 16) {
    float sum = 0.f;
    for (int64_t j = i; j < i + 16; ++j) {
      const float t = j < n ? (static_cast<float>(x[j]) - max) * inv_t : kLowest - 1.f;
      // std::isnan and comparisons with infinities may be folded away under -ffast-math: test the bits' range.
      weights[j] = t >= kLowest && t <= 0.f ? std::exp(t) : 0.f;
      sum += weights[j];
    }
    sums[i / 16] = sum;
  }
}
#endif

// The first token whose running sum of weights passes u times their total; the last token of positive weight when
// rounding leaves the running sum short of it. Sums in double, the 16s' sums first, so that the total is the
// running sum's end exactly.
int64_t draw(const float* weights, const float* sums, int64_t n, float u) {
  const int64_t chunks = (n + 15) / 16;
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) total += sums[c];
  const double target = static_cast<double>(u) * total;
  double running = 0.0;
  int64_t last_positive = -1;
  for (int64_t c = 0; c < chunks; ++c) {
    if (sums[c] > 0.f) last_positive = c;
    if (running + sums[c] <= target) {
      running += sums[c];
      continue;
    }
    for (int64_t i = c * 16; i < std::min(n, c * 16 + 16); ++i) {
      running += weights[i];
      if (weights[i] > 0.f && running > target) return i;
    }
    break;  // rounding: the 16's weights one by one fell short of their sum
  }
  for (int64_t i = std::min(n, last_positive * 16 + 16) - 1; i >= 0; --i)
    if (weights[i] > 0.f) return i;
  return 0;  // no token of positive weight (every logit -inf)
}

// Weights lie in [0, 1] (relative to the row's largest), so their floats' top 12 bits, a positive float's order,
// are at most 0x3F8 (1.0): the buckets below.
constexpr int64_t kBuckets = 1024;
// The histogram's sums in independent copies, consecutive weights in turn: where one copy's adds would wait on each
// other (a row's weights crowd into few buckets, and each add into the same sum waits for the one before, ~5 cycles
// through memory), four chains overlap.
constexpr int64_t kCopies = 4;

inline int64_t bucket_of(float w) { return std::bit_cast<uint32_t>(w) >> 20; }

// The weights of a row's n (rounded up to 16, the tail 0) that lie in bucket b, in `out` (its old contents dropped).
void bucket_weights_of(const float* weights, int64_t n, int64_t b, std::vector<float>& out) {
  out.clear();
#if defined(__AVX512F__)
  out.resize((n + 15) / 16 * 16 + 16);  // room for a whole vector stored at the last count
  int64_t count = 0;
  const __m512i bucket = _mm512_set1_epi32(static_cast<int32_t>(b));
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 w = _mm512_loadu_ps(weights + i);
    const __mmask16 in = _mm512_cmpeq_epi32_mask(_mm512_srli_epi32(_mm512_castps_si512(w), 20), bucket);
    // Compressed in a register, then stored whole: compressing straight into memory is microcoded on AMD Zen 4
    // (measured: this pass took a third of a top-p row).
    _mm512_storeu_ps(out.data() + count, _mm512_maskz_compress_ps(in, w));
    count += std::popcount(static_cast<uint32_t>(in));
  }
  out.resize(count);
#else
  for (int64_t i = 0; i < n; ++i)
    if (bucket_of(weights[i]) == b) out.push_back(weights[i]);
#endif
}

// The largest cutoff c such that the weights >= c hold `target` of a measure, their mass or (kCount) their number,
// without sorting the row: the measure by the top 12 bits of the weights' floats (positive floats order as their
// bits), the bucket where it reaches the target from the top, then that bucket's weights alone sorted. 0 where every
// positive weight together falls short. `buckets` has room for kCopies x kBuckets.
template <bool kCount>
float cutoff_reaching(const float* weights, int64_t n, double target, std::vector<double>& buckets,
                      std::vector<float>& bucket_weights) {
  std::fill(buckets.begin(), buckets.end(), 0.0);
  const int64_t whole = (n + 15) / 16 * 16;  // (the tail's zeros go to bucket 0, which holds the zeros)
  for (int64_t i = 0; i < whole; i += kCopies)
    for (int64_t c = 0; c < kCopies; ++c) {
      const float w = weights[i + c];
      buckets[c * kBuckets + bucket_of(w)] += kCount ? (w > 0.f) : w;
    }
  for (int64_t c = 1; c < kCopies; ++c)
    for (int64_t b = 0; b < kBuckets; ++b) buckets[b] += buckets[c * kBuckets + b];
  double above = 0.0;  // the measure of the buckets above the one being looked at
  int64_t b = kBuckets - 1;
  for (; b > 0 && above + buckets[b] < target; --b) above += buckets[b];
  if (b == 0) return 0.f;  // bucket 0 holds the zeros
  bucket_weights_of(weights, n, b, bucket_weights);
  std::sort(bucket_weights.begin(), bucket_weights.end(), std::greater<float>());
  for (const float w : bucket_weights) {
    above += kCount ? 1.0 : w;
    if (above >= target) return w;
  }
  return bucket_weights.back();  // rounding: the bucket's weights one by one fell short of its sum
}

// Zeroes the weights below `cutoff` and redoes the 16s' sums; returns their total.
double keep_from(float cutoff, float* weights, float* sums, int64_t n) {
  double total = 0.0;
  for (int64_t c = 0; c < (n + 15) / 16; ++c) {
#if defined(__AVX512F__)
    const __m512 w = _mm512_loadu_ps(weights + c * 16);
    const __m512 kept = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(w, _mm512_set1_ps(cutoff), _CMP_GE_OQ), w);
    _mm512_storeu_ps(weights + c * 16, kept);
    sums[c] = _mm512_reduce_add_ps(kept);  // (as row_weights sums them)
#else
    float sum = 0.f;
    for (int64_t i = c * 16; i < c * 16 + 16; ++i) {
      if (weights[i] < cutoff) weights[i] = 0.f;
      sum += weights[i];
    }
    sums[c] = sum;
#endif
    total += sums[c];
  }
  return total;
}

// min_p, top_k and top_p over a row's weights (relative to its largest, 1): min_p keeps the weights of at least
// min_p, top_k the k largest, top_p then the nucleus of what they left, its smallest set of largest weights whose sum
// reaches top_p times their total. Each keeps the ties of its last kept weight.
void truncate(float* weights, float* sums, int64_t n, float min_p, int64_t top_k, float top_p,
              std::vector<double>& buckets, std::vector<float>& bucket_weights) {
  float cutoff = min_p;
  if (top_k > 0 && top_k < n)
    cutoff = std::max(cutoff, cutoff_reaching<true>(weights, n, static_cast<double>(top_k), buckets, bucket_weights));
  const double total = keep_from(cutoff, weights, sums, n);
  if (top_p < 1.f && total > 0.0)
    keep_from(cutoff_reaching<false>(weights, n, top_p * total, buckets, bucket_weights), weights, sums, n);
}

at::Tensor sample(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& min_p,
                  const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "expected logits [rows, vocab] with vocab > 0");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "sample takes fp32 or bf16 logits");
  const int64_t rows = logits.size(0), n = logits.size(1);
  for (const at::Tensor* per_row : {&temperature, &min_p, &top_k, &top_p, &uniforms})
    TORCH_CHECK(per_row->scalar_type() == (per_row == &top_k ? at::kLong : at::kFloat) && per_row->numel() == rows,
                "expected an fp32 temperature, min_p, top_p and uniform and an int64 top_k per row");
  const at::Tensor x = logits.contiguous(), t = temperature.contiguous(), m = min_p.contiguous(),
                   k = top_k.contiguous(), p = top_p.contiguous(), u = uniforms.contiguous();
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* out_data = out.data_ptr<int64_t>();
  const float* t_data = t.data_ptr<float>();
  const float* m_data = m.data_ptr<float>();
  const int64_t* k_data = k.data_ptr<int64_t>();
  const float* p_data = p.data_ptr<float>();
  const float* u_data = u.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(t_data[r] > 0.f, "a row's temperature must be positive");
    TORCH_CHECK(p_data[r] > 0.f && p_data[r] <= 1.f, "a row's top_p must be in (0, 1]");
    TORCH_CHECK(m_data[r] >= 0.f && m_data[r] <= 1.f && k_data[r] >= 0, "a row's min_p must be in [0, 1] and its "
                "top_k at least 0 (0: off)");
  }
  auto run = [&](auto type) {
    using scalar_t = decltype(type);
    const scalar_t* data = x.data_ptr<scalar_t>();
    // A row is tens of microseconds: threads pay off over a few.
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> weights((n + 15) / 16 * 16), sums((n + 15) / 16), bucket_weights;
      std::vector<double> buckets(kCopies * kBuckets);
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = data + r * n;
        row_weights(row, n, row_max(row, n), 1.f / t_data[r], weights.data(), sums.data());
        if (m_data[r] > 0.f || (k_data[r] > 0 && k_data[r] < n) || p_data[r] < 1.f)
          truncate(weights.data(), sums.data(), n, m_data[r], k_data[r], p_data[r], buckets, bucket_weights);
        out_data[r] = draw(weights.data(), sums.data(), n, u_data[r]);
      }
    });
  };
  x.scalar_type() == at::kFloat ? run(float{}) : run(c10::BFloat16{});
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(liteinfer, m) {
  m.def("sample(Tensor logits, Tensor temperature, Tensor min_p, Tensor top_k, Tensor top_p, Tensor uniforms) -> "
        "Tensor");
}

TORCH_LIBRARY_IMPL(liteinfer, CPU, m) {
  m.impl("sample", &sample);
}
