// Attention over the paged KV cache, reading each key and value row where it lies in the pool, no gathered copy.
// Decode: one pass over a sequence's keys, one over its values. Prompts (AVX-512 builds): queries 16 rows at a time
// against keys 64 at a time, softmax online (in AMX tiles where the CPU has them). Registered (CPU) as
// torch.ops.liteinfer.paged_decode_attention and paged_prefill_attention; liteinfer/kernels/__init__.py builds them
// and gives their contract.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "exp16.h"
#include "int8_pools.h"
#include "lanes16.h"
#include "pool_runs.h"

namespace {

// Widens a cache row to fp32. bf16 is spelled as the bit shift it is, so that the compiler vectorises it, and the
// bits become floats through std::bit_cast: stored through a uint32_t pointer into the float buffer they would
// break strict aliasing, and the compiler may then read the buffer before the stores.
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(src[i].x) << 16);
}

// a·b over n floats. Compilers reduce an auto-vectorised sum one lane at a time (a chain of 16 scalar adds per key:
// the kernel's hot spot when measured), so the AVX-512 build reduces the vector as a tree.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

#if defined(__AVX512F__)
// The lane sums of 16 vectors as one vector: out[j] = sum of v[j]'s lanes. A transposing add tree, ~3 instructions
// per vector where reducing each on its own takes ~8.
inline __m512 sum_lanes_16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v0 0+2, v1 0+2, v0 1+3, v1 1+3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the partial sums of four vectors, in order
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // The four 128-bit lanes of each quad summed, quads 0-3 becoming lanes 0-3 of the result.
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                 _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                 _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}
#endif

// pass(count, first) for items begin..end - 1 (a group's query heads; the prompt kernel's queries or panels) in
// passes of up to kMax, `count` an integral_constant: the passes that keep each item's sums in registers take the
// count fixed at compile time. With a run-time count and a branch per head the compiler kept the sums in memory,
// stored and reloaded around every multiply-add (the AVX2 decode kernel ran ~1.4x slower; the AVX-512 one 10-20%,
// measured on AMD Zen 4).
template <int64_t kCount, typename Pass>
inline void pass_of(int64_t count, int64_t first, const Pass& pass) {
  if constexpr (kCount > 1)
    if (count < kCount) return pass_of<kCount - 1>(count, first, pass);
  pass(std::integral_constant<int64_t, kCount>{}, first);
}

template <int64_t kMax, typename Pass>
inline void for_passes(int64_t begin, int64_t end, const Pass& pass) {
  for (int64_t first = begin; first < end; first += kMax) pass_of<kMax>(std::min(kMax, end - first), first, pass);
}

#if defined(__AVX512F__)
constexpr float kHidden = -1e30f;  // the score of a key a query may not see: e^(kHidden - max) is 0, with no infinities

using liteinfer::first_lanes;

// The first key a query at `position` sees: 0, or where its sliding window (when set) starts.
inline int64_t first_visible_key(int64_t position, int64_t sliding_window) {
  return sliding_window > 0 ? std::max<int64_t>(0, position - sliding_window + 1) : 0;
}

// Which of keys first..first + 15 a query at `position` sees (the prompt kernel's causal and window mask).
inline __mmask16 visible_keys(int64_t first, int64_t position, int64_t sliding_window) {
  const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first)),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const int64_t window_start = first_visible_key(position, sliding_window);
  return _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(position))) &
         _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(window_start)));
}

using liteinfer::exp16;

using liteinfer::load_row16;  // 16 elements of a cache row as fp32, in registers
using liteinfer::store_row16;
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The decode kernel's 8-lane forms, for CPUs with AVX2 and no AVX-512. Against the portable loops (a widened copy
// of each row, one reduction per key and head), one thread, bf16, 64-wide heads in groups of 3: 24-28 against 41-50
// ns per key and KV head with the pools in L2, 46 against 74 with them in DRAM (AMD Zen 3).
#define LITEINFER_DECODE_AVX2

// 8 elements of a cache row as fp32, in registers: fp32 and bf16 pools, and fp16 ones where F16C converts them.
template <typename scalar_t>
#if defined(__F16C__)
constexpr bool kWidens8 = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16> ||
                          std::is_same_v<scalar_t, c10::Half>;
#else
constexpr bool kWidens8 = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;
#endif
inline __m256 widen8(const float* src) { return _mm256_loadu_ps(src); }
inline __m256 widen8(const c10::BFloat16* src) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
#if defined(__F16C__)
inline __m256 widen8(const c10::Half* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}
#endif

// The lane sums of 8 vectors as one vector: out[j] = sum of v[j]'s lanes.
inline __m256 sum_lanes_8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Where the kernel takes these forms: head sizes fixed at compile time, in whole 32-column chunks.
template <typename scalar_t, int64_t kDim>
constexpr bool kDecodeAvx2 = kDim > 0 && kDim % 32 == 0 && kWidens8<scalar_t>;

// The two passes below take a group's query heads up to three at a time (for_passes).
constexpr int64_t kHeadsPerPass = 3;

// scores[h * stride + r] = scale * (query h · key row r) for kHeads heads and rows r < m <= 8: each row widened in
// registers once for all the heads, whose query elements the multiply-adds read from L1; two sums per head and row
// (alternate vectors) keep the chains short; the eight rows' sums are reduced as one vector.
template <int64_t kHeads, int64_t kDim, typename scalar_t>
inline void score_8_rows(const float* query, const scalar_t* rows, int64_t m, float scale, float* scores,
                         int64_t stride) {
  __m256 sums[kHeads][8];
  for (int64_t r = 0; r < 8; ++r) {
    const scalar_t* row = rows + std::min(r, m - 1) * kDim;  // past the last row: the last again, its sums dropped
    __m256 a[kHeads][2];
    for (int64_t h = 0; h < kHeads; ++h) a[h][0] = a[h][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < kDim / 8; c += 2) {
      const __m256 k0 = widen8(row + c * 8), k1 = widen8(row + c * 8 + 8);
      for (int64_t h = 0; h < kHeads; ++h) {
        a[h][0] = _mm256_fmadd_ps(k0, _mm256_loadu_ps(query + h * kDim + c * 8), a[h][0]);
        a[h][1] = _mm256_fmadd_ps(k1, _mm256_loadu_ps(query + h * kDim + c * 8 + 8), a[h][1]);
      }
    }
    for (int64_t h = 0; h < kHeads; ++h) sums[h][r] = _mm256_add_ps(a[h][0], a[h][1]);
  }
  for (int64_t h = 0; h < kHeads; ++h) {
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_mul_ps(sum_lanes_8(sums[h]), _mm256_set1_ps(scale)));
    std::copy(lanes, lanes + m, scores + h * stride);
  }
}

// acc[h * kDim + d] += sum over rows r < n of weights[h * weight_stride + r] * row r's element d, for kHeads heads:
// 32 columns at a time, their kHeads x 4 sums in registers over the rows, each row's vector widened once for all
// the heads.
template <int64_t kHeads, int64_t kDim, typename scalar_t>
inline void add_weighted_rows(const float* weights, int64_t weight_stride, const scalar_t* rows, int64_t n,
                              float* acc) {
  for (int64_t c0 = 0; c0 < kDim; c0 += 32) {
    __m256 a[kHeads][4];
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t c = 0; c < 4; ++c) a[h][c] = _mm256_loadu_ps(acc + h * kDim + c0 + c * 8);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < 4; ++c) {
        const __m256 v = widen8(rows + r * kDim + c0 + c * 8);
        for (int64_t h = 0; h < kHeads; ++h)
          a[h][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(weights + h * weight_stride + r), v, a[h][c]);
      }
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t c = 0; c < 4; ++c) _mm256_storeu_ps(acc + h * kDim + c0 + c * 8, a[h][c]);
  }
}
#endif

// Whether both kernels multiply bf16 pairs with vdpbf16ps (bf16 pools on CPUs with AVX-512 BF16): both operands are
// bf16 already, so the products are exact and summed in fp32, with no widened copy. `Query`: the query as the decode
// kernel's score_rows reads it, bf16 as it is there, widened to fp32 otherwise.
template <typename scalar_t, int64_t kDim>
#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = std::is_same_v<scalar_t, c10::BFloat16> && kDim > 0 && kDim % 32 == 0;
#else
constexpr bool kBf16Dot = false;
#endif
template <typename scalar_t, int64_t kDim>
using Query = std::conditional_t<kBf16Dot<scalar_t, kDim>, c10::BFloat16, float>;

// The cache lines of one block of the pool, requested into L2 a few at a time (`next`) between the multiply-adds
// of the block being read, the rest at its end (`rest`). Requested all at once, a block's 32 lines stalled the core
// until most had arrived: its reads and the arithmetic took turns instead of overlapping (~10% slower from DRAM
// on an Intel Xeon, docs/benchmarks.md).
class LineRequests {
 public:
  LineRequests(const void* block, int64_t bytes)
      : next_(static_cast<const char*>(block)), end_(block ? next_ + bytes : nullptr) {}
  void next(int64_t lines) {
    for (; lines > 0 && next_ < end_; --lines, next_ += 64) __builtin_prefetch(next_, 0, 1);
  }
  void rest() { next(INT64_MAX); }

 private:
  const char* next_;
  const char* end_;
};

// scores[g * stride + j] = scale * (query g · key row j), for n consecutive key rows and each of the group's query
// heads (`group` of them, side by side); fp32 queries take the rows widened into `buffer` (16 rows' room). As many
// of `lines` as a row holds are requested per row of a panel of 16 keys.
template <typename scalar_t, int64_t kDim>
void score_rows(const Query<scalar_t, kDim>* query, int64_t group, int64_t dim, const scalar_t* rows, int64_t n,
                float scale, float* buffer, float* scores, int64_t stride, LineRequests& lines) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if constexpr (kDim > 0 && kDim % 16 == 0) {
    // Sixteen keys at a time, their scores one vector: no horizontal sum per key.
    constexpr int64_t kRowLines = std::max<int64_t>(1, kDim * static_cast<int64_t>(sizeof(scalar_t)) / 64);
    for (; j < n; j += 16) {
      const int64_t m = std::min<int64_t>(16, n - j);
      if constexpr (!kBf16Dot<scalar_t, kDim>) to_float(rows + j * kDim, buffer, m * kDim);
      // A whole panel of 16 keys (every one but a sequence's last) takes no test per row.
      auto panel = [&](auto whole) {
        for (int64_t g = 0; g < group; ++g) {
          __m512 acc[16];
          if constexpr (kBf16Dot<scalar_t, kDim>) {
#if defined(__AVX512BF16__)
            const c10::BFloat16* qg = query + g * kDim;
            __m512bh q[kDim / 32];
            for (int64_t c = 0; c < kDim / 32; ++c) q[c] = (__m512bh)_mm512_loadu_si512(qg + c * 32);
            for (int64_t r = 0; r < 16; ++r) {
              acc[r] = _mm512_setzero_ps();
              if (g == 0) lines.next(kRowLines);
              if (whole() || r < m)
                for (int64_t c = 0; c < kDim / 32; ++c)
                  acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(rows + (j + r) * kDim + c * 32),
                                            q[c]);
            }
#endif
          } else {
            const float* qg = query + g * kDim;
            __m512 q[kDim / 16];
            for (int64_t c = 0; c < kDim / 16; ++c) q[c] = _mm512_loadu_ps(qg + c * 16);
            for (int64_t r = 0; r < 16; ++r) {
              acc[r] = _mm512_setzero_ps();
              if (g == 0) lines.next(kRowLines);
              if (whole() || r < m)
                for (int64_t c = 0; c < kDim / 16; ++c)
                  acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(buffer + r * kDim + c * 16), q[c], acc[r]);
            }
          }
          _mm512_mask_storeu_ps(scores + g * stride + j, first_lanes(m),
                                _mm512_mul_ps(sum_lanes_16(acc), _mm512_set1_ps(scale)));
        }
      };
      if (m == 16) panel(std::true_type{}); else panel(std::false_type{});
    }
  }
#elif defined(LITEINFER_DECODE_AVX2)
  if constexpr (kDecodeAvx2<scalar_t, kDim>) {
    for (; j < n; j += 8)
      for_passes<kHeadsPerPass>(0, group, [&](auto heads, int64_t g0) {
        score_8_rows<heads(), kDim>(query + g0 * kDim, rows + j * kDim, std::min<int64_t>(8, n - j), scale,
                                    scores + g0 * stride + j, stride);
      });
  }
#endif
  if constexpr (!kBf16Dot<scalar_t, kDim>) {  // (bf16 queries took every row above)
    for (; j < n; ++j) {
      to_float(rows + j * dim, buffer, dim);
      for (int64_t g = 0; g < group; ++g) scores[g * stride + j] = scale * dot(query + g * dim, buffer, dim);
    }
  }
}

// Scores s[0..n) become softmax numerators e^(s - max s), in fp32; returns their sum.
inline float softmax_numerators(float* s, int64_t n) {
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(kHidden);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = first_lanes(n - j);
    top = _mm512_mask_max_ps(top, mask, top, _mm512_maskz_loadu_ps(mask, s + j));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = first_lanes(n - j);
    const __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), m)));
    _mm512_mask_storeu_ps(s + j, mask, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
#else
  const float m = *std::max_element(s, s + n);
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
#endif
}

// Tasks 0..n-1 in `runs` consecutive runs of about equal work (`work(task)`), each run ending at the task
// boundary nearest its share: the runs' bounds, runs + 1 of them (a run may be empty).
template <typename Work>
std::vector<int64_t> balanced_runs(int64_t n, int64_t runs, const Work& work) {
  std::vector<int64_t> bounds(runs + 1, n);
  bounds[0] = 0;
  int64_t total = 0;
  for (int64_t task = 0; task < n; ++task) total += work(task);
  int64_t sum = 0, run = 1;
  for (int64_t task = 0; task < n && run < runs; ++task) {
    const int64_t before = sum;
    sum += work(task);
    while (run < runs && sum * runs >= total * run) {
      const bool nearer_before = total * run - before * runs < sum * runs - total * run;
      bounds[run++] = nearer_before ? task : task + 1;
    }
  }
  return bounds;
}

constexpr int64_t kTaskCost = 16;  // a decode task's work besides its keys (its query, softmax, output), in keys

// Tasks 0..n-1 over the threads, one run of consecutive tasks a thread, the runs of about equal work:
// `run_tasks(begin, end)` once per non-empty run.
template <typename Work, typename Run>
void parallel_balanced(int64_t n, const Work& work, const Run& run_tasks) {
  const std::vector<int64_t> bounds = balanced_runs(n, std::min<int64_t>(at::get_num_threads(), n), work);
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t run0, int64_t run1) {
    for (int64_t run = run0; run < run1; ++run)
      if (bounds[run] < bounds[run + 1]) run_tasks(bounds[run], bounds[run + 1]);
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// int8 pools (int8_pools.h gives their layout): the decode kernel's passes multiply bytes with vpdpbusd, 64 products
// an instruction where vdpbf16ps takes 32, so the query and the softmax weights are rounded to 8-bit levels too; the
// prompt kernel dequantizes the rows it lays out in panels (int8_key_row, int8_value_row).
#define LITEINFER_INT8_POOLS
constexpr bool kInt8Pools = true;

// The group's query heads as the int8 passes take them: each head's bytes, four to an int32 (as vpdpbusd takes
// them), their sum and the head's scale (times the attention's).
struct Int8Queries {
  const int32_t* quads;
  const int32_t* sums;
  const float* scales;
};

// Scores of query heads g0..g0 + kHeads - 1 against kPanels panels of 16 keys of one int8 K block (int8_pools.h),
// the panels from p0 (counted from the block's start): scores[h * stride + key], key counted from the block's start.
// A K vector holds four elements of 16 keys, which one vpdpbusd multiplies by the same four query bytes broadcast,
// so a panel's 16 scores build up in one vector's lanes over the head's quads, with no sum across lanes; kHeads x
// kPanels independent sums. K is stored as k + 128 (unsigned, as vpdpbusd takes it): q·k = q·K - 128 Σq.
template <int64_t kDim, int64_t kHeads, int64_t kPanels>
inline void int8_scores(const uint8_t* block, int64_t block_size, int64_t p0, const Int8Queries& queries, int64_t g0,
                        const float* row_scales, float* scores, int64_t stride, LineRequests& lines,
                        int64_t lines_per_quad) {
  const uint8_t* panels = block + p0 * 64;
  __m512i dots[kHeads][kPanels];
  for (int64_t h = 0; h < kHeads; ++h)
    for (int64_t p = 0; p < kPanels; ++p) dots[h][p] = _mm512_setzero_si512();
#pragma GCC unroll 32
  for (int64_t c = 0; c < kDim / 4; ++c) {
    if (g0 == 0) lines.next(lines_per_quad);  // the first pass over the heads walks on
    __m512i keys[kPanels];
    for (int64_t p = 0; p < kPanels; ++p) keys[p] = _mm512_loadu_si512(panels + c * block_size * 4 + p * 64);
    for (int64_t h = 0; h < kHeads; ++h) {
      const __m512i quad = _mm512_set1_epi32(queries.quads[(g0 + h) * (kDim / 4) + c]);
      for (int64_t p = 0; p < kPanels; ++p) dots[h][p] = _mm512_dpbusd_epi32(dots[h][p], keys[p], quad);
    }
  }
  for (int64_t h = 0; h < kHeads; ++h) {
    const __m512i offset = _mm512_set1_epi32(128 * queries.sums[g0 + h]);
    const __m512 step = _mm512_set1_ps(queries.scales[g0 + h]);
    for (int64_t p = 0; p < kPanels; ++p) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(dots[h][p], offset));
      _mm512_storeu_ps(scores + (g0 + h) * stride + (p0 + p) * 16,
                       _mm512_mul_ps(_mm512_mul_ps(dot, step), _mm512_loadu_ps(row_scales + (p0 + p) * 16)));
    }
  }
}

// Key row `row` of an int8 K block (int8_pools.h) times its scale, into out[0..kDim): the row's groups of four
// elements lie block_size * 4 bytes apart, 16 groups gathered at a time.
template <int64_t kDim, typename Out>
inline void int8_key_row(const uint8_t* block, int64_t block_size, int64_t row, float scale, Out* out) {
  const __m512i groups = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int32_t>(block_size)));
  const __m512 step = _mm512_set1_ps(scale), offset = _mm512_set1_ps(128.f);  // (K stored as k + 128)
  alignas(64) uint8_t bytes[kDim];
  for (int64_t c = 0; c < kDim / 64; ++c)
    _mm512_store_si512(bytes + c * 64, _mm512_i32gather_epi32(groups, block + (c * 16 * block_size + row) * 4, 4));
  for (int64_t d = 0; d < kDim; d += 16) {
    const __m512i levels = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(bytes + d)));
    store_row16(out + d, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(levels), offset), step));
  }
}

// Value row `row` of an int8 V block (int8_pools.h) times its scale, into out[0..kDim): each 32-bit lane of its
// quad of rows holds one element of four rows, row % 4 its byte.
template <int64_t kDim, typename Out>
inline void int8_value_row(const int8_t* block, int64_t row, float scale, Out* out) {
  const int8_t* quad = block + row / 4 * kDim * 4;
  const __m128i up = _mm_cvtsi32_si128(static_cast<int>(24 - 8 * (row % 4)));  // the row's byte to the top, then
  const __m128i down = _mm_cvtsi32_si128(24);                                     // back, sign-extended
  const __m512 step = _mm512_set1_ps(scale);
  for (int64_t d = 0; d < kDim; d += 16) {
    const __m512i lanes = _mm512_loadu_si512(quad + d * 4);
    const __m512i levels = _mm512_sra_epi32(_mm512_sll_epi32(lanes, up), down);
    store_row16(out + d, _mm512_mul_ps(_mm512_cvtepi32_ps(levels), step));
  }
}
#else
constexpr bool kInt8Pools = false;
#endif

// scalar_t: q's dtype; kv_t: the pools', q's own or uint8_t for int8 pools (their rows' scales in k_scales and
// v_scales). kDim > 0 fixes the head size at compile time, so the loops over it unroll; 0 reads it from q.
template <typename scalar_t, typename kv_t, int64_t kDim>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t block_size,
                      const float* k_scales, const float* v_scales, const at::Tensor& block_tables,
                      const at::Tensor& positions, at::Tensor& out, double scale, int64_t sliding_window,
                      double softcap) {
  constexpr bool kInt8 = std::is_same_v<kv_t, uint8_t>;
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), dim = kDim > 0 ? kDim : q.size(2);
  const int64_t kv_heads = k_cache.size(1);
  const int64_t group = num_heads / kv_heads, table_width = block_tables.size(1);
  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const kv_t* k_data = static_cast<const kv_t*>(k_cache.data_ptr());
  const kv_t* v_data = static_cast<const kv_t*>(v_cache.data_ptr());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();

  // A task is one (sequence, KV head); it reads keys first..num_keys-1 of its sequence, in the blocks from the one
  // holding key `first` (whose first key is `first_block`) on.
  struct Task {
    int64_t seq, kv_head, first, first_block, num_keys;
  };
  auto task_at = [&](int64_t task) {
    const int64_t seq = task / kv_heads, num_keys = pos[seq] + 1;  // keys 0..pos, the new token's own included
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, num_keys - sliding_window) : 0;
    return Task{seq, task % kv_heads, first, first - first % block_size, num_keys};
  };
  const liteinfer::PoolRuns runs = liteinfer::PoolRuns::of(k_cache);  // (check_query_and_pools: all pools alike)
  auto block_of = [&](const auto* pool, const Task& t, int64_t start) {  // a pool's block, or its rows' scales
    const int64_t row = std::is_same_v<decltype(pool), const float*> && kInt8 ? 1 : dim;
    return pool + runs.start(tables[t.seq * table_width + start / block_size], t.kv_head, block_size * row);
  };
  const int64_t block_bytes = block_size * dim * static_cast<int64_t>(sizeof(kv_t));

  // The query heads of a task's group share every row read.
  auto run_tasks = [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * dim), krows(16 * dim), vblock(block_size * dim), acc(group * dim), scores;
    std::vector<float> denom(group);
    std::vector<uint16_t> weights;  // with bf16 values, their softmax weights as bf16 bits
    // With int8 pools: the group's queries as bytes (four to an int32, as vpdpbusd takes them), each one's scale
    // and its bytes' sum; the softmax weights times each key's V scale as bytes.
    std::vector<int32_t> query_quads(group * dim / 4), query_sum(group);
    std::vector<float> query_scale(group);
    std::vector<uint8_t> weight_bytes;
    // Blocks lie anywhere in the pool, so the hardware prefetcher cannot run ahead across them: they are requested
    // by hand (measured: DRAM-latency bound without it), into L2 (locality hint 1), not L1, which a few tasks'
    // blocks outgrow (~1.5x faster from DRAM on AMD Zen 4). The thread walks its blocks in the order it reads them
    // (a task's K blocks, then its V blocks, then the next task's) and, as it reads one, requests the one
    // kBlocksAhead further on that walk (docs/benchmarks.md). An int8 block is half a bf16 one's bytes and read in
    // fewer instructions: 8 ahead (30 layers, 256 x ~250 keys from DRAM: 2 / 4 / 8 / 12 ahead 65.4 / 63.5 / 61.8 /
    // 60.8 ms).
    constexpr int64_t kBlocksAhead = kInt8 ? 8 : 2;
    struct Walk {
      int64_t task, values, start;  // values: 0 while in a task's K blocks, 1 in its V blocks
    };
    Walk ahead{begin, 0, task_at(begin).first_block};
    auto block_ahead = [&]() -> LineRequests {  // the walk's next block; none past the thread's last task
      while (ahead.task < end) {
        const Task t = task_at(ahead.task);
        if (ahead.start < t.num_keys) {
          const kv_t* block = block_of(ahead.values ? v_data : k_data, t, ahead.start);
          if constexpr (kInt8)  // the block's scales, whole (with 32-token blocks two lines, the second a miss else)
            LineRequests(block_of(ahead.values ? v_scales : k_scales, t, ahead.start), block_size * 4).rest();
          ahead.start += block_size;
          return LineRequests(block, block_bytes);
        }
        // A pass over the task's blocks is done: on to its values, or to the next task's keys.
        ahead = ahead.values ? Walk{ahead.task + 1, 0, 0} : Walk{ahead.task, 1, 0};
        if (ahead.task < end) ahead.start = task_at(ahead.task).first_block;
      }
      return LineRequests(nullptr, 0);
    };
    for (int64_t i = 0; i < kBlocksAhead; ++i) block_ahead().rest();
    for (int64_t task = begin; task < end; ++task) {
      const Task t = task_at(task);
      const int64_t first = t.first, first_block = t.first_block, num_keys = t.num_keys, span = num_keys - first;
      const int64_t head = t.seq * num_heads + t.kv_head * group;  // the group's first query head
      // A head's scores: the span's keys from `first`; with int8 pools the keys of whole blocks from first_block
      // (scores are computed a panel of 16 keys at a time), the span's from visible_at.
      const int64_t score_stride = kInt8 ? (num_keys - first_block + block_size - 1) / block_size * block_size : span;
      const int64_t visible_at = kInt8 ? first - first_block : 0;
      scores.resize(group * score_stride);
      if constexpr (kInt8) {
#if defined(LITEINFER_INT8_POOLS)
        // Each query head as signed bytes at its own scale (its largest |element| / 127), with their sum.
        for (int64_t g = 0; g < group; ++g) {
          to_float(q_data + (head + g) * kDim, query.data(), kDim);
          __m512 top = _mm512_setzero_ps();
          for (int64_t c = 0; c < kDim / 16; ++c)
            top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(query.data() + c * 16)));
          const float largest = _mm512_reduce_max_ps(top);
          const __m512 to_levels = _mm512_set1_ps(largest > 0 ? 127.f / largest : 0.f);
          __m512i sum = _mm512_setzero_si512();
          for (int64_t c = 0; c < kDim / 16; ++c) {
            const __m512i levels = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(query.data() + c * 16), to_levels));
            sum = _mm512_add_epi32(sum, levels);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(query_quads.data() + g * kDim / 4 + c * 4),
                             _mm512_cvtsepi32_epi8(levels));
          }
          query_sum[g] = _mm512_reduce_add_epi32(sum);
          query_scale[g] = static_cast<float>(scale) * largest / 127.f;
        }
        // Up to four panels (a block's, from the first the span reads) and four heads at once.
        constexpr int64_t kPanels = 4, kHeads = 4;
        // The block ahead's lines, requested evenly over the quads of a whole block's passes.
        const int64_t quad_steps = (block_size / 16 + kPanels - 1) / kPanels * (kDim / 4);
        const int64_t lines_per_quad = (block_bytes / 64 + quad_steps - 1) / quad_steps;
        const Int8Queries queries{query_quads.data(), query_sum.data(), query_scale.data()};
        for (int64_t start = first_block; start < num_keys; start += block_size) {
          LineRequests lines = block_ahead();
          const uint8_t* block = block_of(k_data, t, start);
          const float* row_scales = block_of(k_scales, t, start);
          float* block_scores = scores.data() + (start - first_block);
          const int64_t lo = std::max(start, first) - start, hi = std::min(start + block_size, num_keys) - start;
          for_passes<kPanels>(lo / 16, (hi + 15) / 16, [&](auto panels, int64_t p0) {
            for_passes<kHeads>(0, group, [&](auto heads, int64_t g0) {
              int8_scores<kDim, heads(), panels()>(block, block_size, p0, queries, g0, row_scales, block_scores,
                                                  score_stride, lines, lines_per_quad);
            });
          });
          lines.rest();
        }
#endif
      } else {
        const Query<scalar_t, kDim>* query_heads;
        if constexpr (kBf16Dot<scalar_t, kDim>) {
          query_heads = q_data + head * dim;
        } else {
          to_float(q_data + head * dim, query.data(), group * dim);
          query_heads = query.data();
        }
        for (int64_t start = first_block; start < num_keys; start += block_size) {
          LineRequests lines = block_ahead();
          const int64_t lo = std::max(start, first), hi = std::min(start + block_size, num_keys);
          score_rows<scalar_t, kDim>(query_heads, group, dim, block_of(k_data, t, start) + (lo - start) * dim,
                                     hi - lo, static_cast<float>(scale), krows.data(), scores.data() + (lo - first),
                                     span, lines);
          lines.rest();
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * score_stride + visible_at;
        if (softcap > 0)
          for (int64_t j = 0; j < span; ++j) sg[j] = static_cast<float>(std::tanh(sg[j] / softcap) * softcap);
        denom[g] = softmax_numerators(sg, span);
      }
      if constexpr (kInt8) {
#if defined(LITEINFER_INT8_POOLS)
        // Values: each key's weight times its V row's scale, as unsigned bytes (255 the head's largest), four keys'
        // bytes one int that vpdpbusd multiplies by the four keys' interleaved elements. A head's weights lie as
        // its scores, from its first block's first key in whole blocks, zero for keys not read (their panels'
        // scores, and their scales, may be anything).
        weight_bytes.resize(group * score_stride);
        for (int64_t g = 0; g < group; ++g) {
          float* wg = scores.data() + g * score_stride;
          __m512 top = _mm512_setzero_ps();
          for (int64_t start = first_block; start < num_keys; start += block_size) {
            const float* row_scales = block_of(v_scales, t, start);
            for (int64_t j = 0; j < block_size && start + j < num_keys; j += 16) {
              const int64_t key = start + j;
              const __mmask16 read = first_lanes(num_keys - key) & ~first_lanes(std::max<int64_t>(0, first - key));
              const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(read, wg + key - first_block),
                                             _mm512_maskz_loadu_ps(read, row_scales + j));
              _mm512_storeu_ps(wg + key - first_block, w);
              top = _mm512_max_ps(top, w);
            }
          }
          const float largest = _mm512_reduce_max_ps(top);
          const __m512 to_levels = _mm512_set1_ps(largest > 0 ? 255.f / largest : 0.f);
          for (int64_t j = 0; j < num_keys - first_block; j += 16) {
            const __m512i levels = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(wg + j), to_levels));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(weight_bytes.data() + g * score_stride + j),
                             _mm512_cvtusepi32_epi8(levels));
          }
          if (largest > 0) denom[g] *= 255.f / largest;  // the output's sums are in units of largest / 255
        }
        // The int32 sums move into the fp32 ones every flush_keys keys: a key adds at most 255 x 128 to a lane, so
        // 16,384 keys stay under 2^31.
        constexpr int64_t kVecs = kDim / 16, kHeads = std::max<int64_t>(1, 16 / kVecs), kFlushKeys = 16384;
        constexpr int64_t kQuadLines = kDim * 4 / 64;
        const int64_t flush_keys = std::max<int64_t>(1, kFlushKeys / block_size) * block_size;
        std::fill(acc.begin(), acc.end(), 0.f);
        for_passes<kHeads>(0, group, [&](auto heads, int64_t g0) {
          for (int64_t from = first_block; from < num_keys; from += flush_keys) {
            __m512i a[heads()][kVecs];  // (in registers: no reference to them leaves this scope)
            for (int64_t h = 0; h < heads(); ++h)
              for (int64_t c = 0; c < kVecs; ++c) a[h][c] = _mm512_setzero_si512();
            for (int64_t start = from; start < std::min(num_keys, from + flush_keys); start += block_size) {
              LineRequests lines = g0 == 0 ? block_ahead() : LineRequests(nullptr, 0);  // the first pass walks on
              const int8_t* quads = reinterpret_cast<const int8_t*>(block_of(v_data, t, start));
              const uint8_t* w = weight_bytes.data() + g0 * score_stride + (start - first_block);
              const int64_t n = (std::min(start + block_size, num_keys) - start + 3) / 4;
              for (int64_t quad = 0; quad < n; ++quad) {
                lines.next(kQuadLines);
                __m512i v[kVecs];
                for (int64_t c = 0; c < kVecs; ++c)
                  v[c] = _mm512_loadu_si512(quads + liteinfer::v_byte(quad * 4, c * 16, kDim));
                for (int64_t h = 0; h < heads(); ++h) {
                  int32_t four;
                  std::memcpy(&four, w + h * score_stride + quad * 4, sizeof(four));
                  const __m512i weights4 = _mm512_set1_epi32(four);
                  for (int64_t c = 0; c < kVecs; ++c) a[h][c] = _mm512_dpbusd_epi32(a[h][c], weights4, v[c]);
                }
              }
              lines.rest();
            }
            for (int64_t h = 0; h < heads(); ++h)
              for (int64_t c = 0; c < kVecs; ++c) {
                float* dst = acc.data() + (g0 + h) * kDim + c * 16;
                _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), _mm512_cvtepi32_ps(a[h][c])));
              }
          }
        });
#endif
      } else
#if defined(__AVX512F__)
      if constexpr (kBf16Dot<scalar_t, kDim>) {
#if defined(__AVX512BF16__)
        // bf16 values: two keys' rows interleaved element by element (vpunpck{l,h}wd) and multiplied by the two
        // keys' weights, rounded to bf16 as the prompt kernel rounds them, with vdpbf16ps: per key, half the
        // multiply-adds of the fp32 form below and no widening. An interleave keeps each 128-bit lane's elements
        // 0-3 (low) or 4-7 (high), so each head's sums are put back in order once, at the end.
        constexpr int64_t kChunks = kDim / 32, kHeads = std::max<int64_t>(1, 8 / kChunks);
        const int64_t stride = (span + 15) / 16 * 16;  // a head's weights, whole vectors of 16
        weights.resize(group * stride);
        for (int64_t g = 0; g < group; ++g)
          for (int64_t j = 0; j < span; j += 16) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights.data() + g * stride + j),
                                (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_maskz_loadu_ps(first_lanes(span - j), scores.data() + g * span + j)));
          }
        const __m512i low_order = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i high_order = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        for_passes<kHeads>(0, group, [&](auto heads, int64_t g0) {
          __m512 low[heads()][kChunks], high[heads()][kChunks];
          for (int64_t h = 0; h < heads(); ++h)
            for (int64_t c = 0; c < kChunks; ++c) low[h][c] = high[h][c] = _mm512_setzero_ps();
          for (int64_t start = first_block; start < num_keys; start += block_size) {
            LineRequests lines = g0 == 0 ? block_ahead() : LineRequests(nullptr, 0);  // the first pass walks on
            const int64_t lo = std::max(start, first), hi = std::min(start + block_size, num_keys);
            const scalar_t* rows = block_of(v_data, t, start) + (lo - start) * kDim;
            const uint16_t* w = weights.data() + g0 * stride + (lo - first);
            // Rows a and b times their weights, each head's pair of them one int (a's in the low half).
            auto add_pair = [&](const scalar_t* a, const scalar_t* b, const auto& weight_pair) {
              __m512i x[kChunks], y[kChunks];
              lines.next(2 * kChunks);  // the two rows' lines
              for (int64_t c = 0; c < kChunks; ++c) {
                const __m512i ra = _mm512_loadu_si512(a + c * 32), rb = _mm512_loadu_si512(b + c * 32);
                x[c] = _mm512_unpacklo_epi16(ra, rb);
                y[c] = _mm512_unpackhi_epi16(ra, rb);
              }
              for (int64_t h = 0; h < heads(); ++h) {
                const __m512bh wp = (__m512bh)_mm512_set1_epi32(weight_pair(h));
                for (int64_t c = 0; c < kChunks; ++c) {
                  low[h][c] = _mm512_dpbf16_ps(low[h][c], (__m512bh)x[c], wp);
                  high[h][c] = _mm512_dpbf16_ps(high[h][c], (__m512bh)y[c], wp);
                }
              }
            };
            const int64_t n = hi - lo;
            for (int64_t r = 0; r + 1 < n; r += 2)  // two keys' weights lie side by side: one load each head
              add_pair(rows + r * kDim, rows + (r + 1) * kDim, [&](int64_t h) {
                int32_t pair;
                std::memcpy(&pair, w + h * stride + r, sizeof(pair));
                return pair;
              });
            if (n % 2)  // an odd last row, paired with itself at weight 0
              add_pair(rows + (n - 1) * kDim, rows + (n - 1) * kDim,
                       [&](int64_t h) { return static_cast<int32_t>(w[h * stride + n - 1]); });
            lines.rest();
          }
          for (int64_t h = 0; h < heads(); ++h)
            for (int64_t c = 0; c < kChunks; ++c) {
              float* dst = acc.data() + (g0 + h) * kDim + c * 32;
              _mm512_storeu_ps(dst, _mm512_permutex2var_ps(low[h][c], low_order, high[h][c]));
              _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(low[h][c], high_order, high[h][c]));
            }
        });
#endif
      } else if constexpr (kDim > 0 && kDim % 16 == 0 && !std::is_same_v<scalar_t, double>) {
        // Values: each row widened once into registers, then added into every head's sums, which stay in registers
        // (up to 16 of them: 4 heads of 64, 2 of 128) for the whole sequence.
        constexpr int64_t kVecs = kDim / 16, kHeads = std::max<int64_t>(1, 16 / kVecs);
        for_passes<kHeads>(0, group, [&](auto heads, int64_t g0) {
          __m512 a[heads()][kVecs];
          for (int64_t h = 0; h < heads(); ++h)
            for (int64_t c = 0; c < kVecs; ++c) a[h][c] = _mm512_setzero_ps();
          for (int64_t start = first_block; start < num_keys; start += block_size) {
            if (g0 == 0) block_ahead().rest();
            const int64_t lo = std::max(start, first), hi = std::min(start + block_size, num_keys);
            const scalar_t* rows = block_of(v_data, t, start) + (lo - start) * kDim;
            const float* p = scores.data() + g0 * span + (lo - first);
            for (int64_t r = 0; r < hi - lo; ++r) {
              __m512 v[kVecs];
              for (int64_t c = 0; c < kVecs; ++c) v[c] = load_row16(rows + r * kDim + c * 16);
              for (int64_t h = 0; h < heads(); ++h) {
                const __m512 w = _mm512_set1_ps(p[h * span + r]);
                for (int64_t c = 0; c < kVecs; ++c) a[h][c] = _mm512_fmadd_ps(w, v[c], a[h][c]);
              }
            }
          }
          for (int64_t h = 0; h < heads(); ++h)
            for (int64_t c = 0; c < kVecs; ++c) _mm512_storeu_ps(acc.data() + (g0 + h) * kDim + c * 16, a[h][c]);
        });
      } else
#endif
      {
        // Values a block at a time: its rows widened once (in registers with AVX2), then each query head sums them.
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t start = first_block; start < num_keys; start += block_size) {
          block_ahead().rest();
          const int64_t lo = std::max(start, first), hi = std::min(start + block_size, num_keys);
#if defined(LITEINFER_DECODE_AVX2)
          if constexpr (kDecodeAvx2<scalar_t, kDim>) {
            for_passes<kHeadsPerPass>(0, group, [&](auto heads, int64_t g0) {
              add_weighted_rows<heads(), kDim>(scores.data() + g0 * span + (lo - first), span,
                                               block_of(v_data, t, start) + (lo - start) * kDim, hi - lo,
                                               acc.data() + g0 * kDim);
            });
          } else
#endif
          {
            to_float(block_of(v_data, t, start) + (lo - start) * dim, vblock.data(), (hi - lo) * dim);
            for (int64_t g = 0; g < group; ++g) {
              const float* p = scores.data() + g * span + (lo - first);
              float* ag = acc.data() + g * dim;
              for (int64_t r = 0; r < hi - lo; ++r)
                for (int64_t d = 0; d < dim; ++d) ag[d] += p[r] * vblock[r * dim + d];
            }
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = out_data + (head + g) * dim;
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * dim + d] * inv);
      }
    }
  };
  // Each thread takes a run of tasks with about as many keys as the others' runs: a batch's sequences differ in
  // length, and an even split by count left a thread idle (2-5% slower with lengths 10-500, docs/benchmarks.md).
  parallel_balanced(num_seqs * kv_heads, [&](int64_t task) {
    const Task t = task_at(task);
    return t.num_keys - t.first + kTaskCost;
  }, run_tasks);
}

// What both attention ops ask of q and the pools: the pools in q's dtype, or int8 pools (int8_pools.h) with their
// rows' scales. Returns whether they are int8 pools and their block size, which their layouts place apart.
struct CheckedPools {
  bool int8;
  int64_t block_size;
};

CheckedPools check_query_and_pools(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales) {
  const bool int8 = k_scales.has_value();
  TORCH_CHECK(int8 == v_scales.has_value(), "give both pools' scales or neither");
  TORCH_CHECK(q.dim() == 3, "expected q [queries, heads, dim]");
  TORCH_CHECK(liteinfer::PoolRuns::of(v_cache) == liteinfer::PoolRuns::of(k_cache),
              "the K and V pools' runs must lie alike (pool_runs.h)");
  int64_t dim, block_size;
  if (int8) {
    const liteinfer::Int8Pools pools = liteinfer::check_int8_pools(k_cache, v_cache, *k_scales, *v_scales);
    TORCH_CHECK(kInt8Pools, "int8 pools need a CPU with AVX-512 VNNI (kernels.int8_pools_available())");
    TORCH_CHECK((pools.dim == 64 || pools.dim == 128) && pools.block_size % 16 == 0,
                "int8 pools take head sizes 64 and 128 and blocks of a multiple of 16 keys");
    dim = pools.dim, block_size = pools.block_size;
  } else {
    TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
                "expected K and V pools [blocks, kv_heads, block_size, dim] of one shape");
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
                "q and the pools must share a dtype");
    dim = k_cache.size(3), block_size = k_cache.size(2);
  }
  TORCH_CHECK(q.size(2) == dim && q.size(1) % k_cache.size(1) == 0,
              "q's head size or head count does not fit the pools");
  return {int8, block_size};
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& positions, double scale,
                                  int64_t sliding_window, double softcap, const std::optional<at::Tensor>& k_scales,
                                  const std::optional<at::Tensor>& v_scales) {
  const auto [int8, block_size] = check_query_and_pools(q, k_cache, v_cache, k_scales, v_scales);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && positions.scalar_type() == at::kLong,
              "block tables and positions must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && positions.numel() == q.size(0),
              "one block table and one position per query");
  const at::Tensor q_ = q.contiguous(), tables = block_tables.contiguous(), pos = positions.contiguous();
  at::Tensor out = at::empty_like(q_);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
#if defined(LITEINFER_INT8_POOLS)
    if (int8) {
      const float* ks = k_scales->data_ptr<float>();
      const float* vs = v_scales->data_ptr<float>();
      if (q.size(2) == 64)
        return decode_attention<scalar_t, uint8_t, 64>(q_, k_cache, v_cache, block_size, ks, vs, tables, pos, out,
                                                       scale, sliding_window, softcap);
      return decode_attention<scalar_t, uint8_t, 128>(q_, k_cache, v_cache, block_size, ks, vs, tables, pos, out,
                                                      scale, sliding_window, softcap);
    }
#endif
    switch (q.size(2)) {
      case 64: return decode_attention<scalar_t, scalar_t, 64>(q_, k_cache, v_cache, block_size, nullptr, nullptr,
                                                              tables, pos, out, scale, sliding_window, softcap);
      case 128: return decode_attention<scalar_t, scalar_t, 128>(q_, k_cache, v_cache, block_size, nullptr, nullptr,
                                                                tables, pos, out, scale, sliding_window, softcap);
      default: return decode_attention<scalar_t, scalar_t, 0>(q_, k_cache, v_cache, block_size, nullptr, nullptr,
                                                             tables, pos, out, scale, sliding_window, softcap);
    }
  });
  return out;
}

#if defined(__AVX512F__)
// Elements in each 32-bit lane of the prompt kernel's panels: bf16 panels hold pairs (vdpbf16ps multiplies pairs),
// fp32 panels one element.
template <typename Panel>
constexpr int64_t kPerLane = std::is_same_v<Panel, float> ? 1 : 2;

// 32-bit lane w of a row of bf16 pairs or floats, read as bytes: the kernel fills some rows through their own type
// (widened or dequantized keys and queries) and reads them as lanes, and through an int32_t pointer the compiler
// could, by strict aliasing, read a lane before the stores that fill it. memcpy compiles to the same load.
inline int32_t lane_at(const void* row, int64_t w) {
  int32_t lane;
  std::memcpy(&lane, static_cast<const char*>(row) + w * sizeof(int32_t), sizeof(int32_t));
  return lane;
}

// A 64-byte row of a panel, its 16 lanes, in a register. The empty asm pins it there: given the load itself, GCC
// folded it into each FMA that reads the row, one load per query (fp32 values: 20 loads per 16 FMAs, ~10% slower).
template <typename Panel>
inline __m512i panel_row(const Panel* row) {
  __m512i lanes = _mm512_loadu_si512(row);
  asm("" : "+v"(lanes));
  return lanes;
}

// acc + a panel row times `word` broadcast: a query's (or a softmax weight's) 32-bit lane, a bf16 pair multiplied by
// vdpbf16ps or a float's bits by FMA.
template <typename Panel>
inline __m512 lane_products(__m512 acc, __m512i row, int32_t word) {
  const __m512i broadcast = _mm512_set1_epi32(word);
  if constexpr (std::is_same_v<Panel, float>) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(row), _mm512_castsi512_ps(broadcast), acc);
  } else {
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, (__m512bh)row, (__m512bh)broadcast);
#else
    static_assert(std::is_same_v<Panel, float>, "bf16 panels need AVX-512 BF16");
    return acc;
#endif
  }
}

constexpr int64_t kStepKeys = 64;  // the keys of one online-softmax step of the prompt kernel: four panels of 16

// scores[u * 64 + p * 16 + j] = scale * (query u . key j of panel p), for N queries (their 32-bit lanes) against
// the step's first NP panels. The N x NP sums are independent chains: at N x NP = 16 the multiply-adds issue every
// cycle, where one panel against four queries (four chains) waited on each product's latency.
template <int64_t N, int64_t NP, int64_t kDim, typename Panel>
inline void step_scores(const void* const* queries, const Panel* kp, float scale, float* scores) {
  constexpr int64_t kLanes = kDim / kPerLane<Panel>;  // a query's lanes: the rows of a K panel
  __m512 a[N][NP];
  for (int64_t u = 0; u < N; ++u)
    for (int64_t p = 0; p < NP; ++p) a[u][p] = _mm512_setzero_ps();
  for (int64_t w = 0; w < kLanes; ++w) {
    __m512i rows[NP];  // (each loaded once for the N queries)
#pragma GCC unroll 4
    for (int64_t p = 0; p < NP; ++p) rows[p] = panel_row(kp + p * 16 * kDim + w * 16 * kPerLane<Panel>);
    // (Unrolled whole, so that the sums stay in registers: GCC kept some forms' in memory otherwise.)
#pragma GCC unroll 4
    for (int64_t u = 0; u < N; ++u)
#pragma GCC unroll 4
      for (int64_t p = 0; p < NP; ++p) a[u][p] = lane_products<Panel>(a[u][p], rows[p], lane_at(queries[u], w));
  }
  for (int64_t u = 0; u < N; ++u)
    for (int64_t p = 0; p < NP; ++p)
      _mm512_storeu_ps(scores + u * kStepKeys + p * 16, _mm512_mul_ps(a[u][p], _mm512_set1_ps(scale)));
}

// acc[u] = acc[u] * rescale[u] + the step's values weighted by weights[u], for N queries, over its first `units`
// V lanes' rows (a key pair in bf16, a key in fp32): N x kDim / 16 sums in registers, each V row loaded once for
// the N queries.
template <int64_t N, int64_t kDim, typename Panel>
inline void step_values(float* const* acc, const float* rescale, const int32_t* const* weights, int64_t units,
                        const Panel* vp) {
  constexpr int64_t kVectors = kDim / 16;
  __m512 a[N][kVectors];
  for (int64_t u = 0; u < N; ++u)
    for (int64_t c = 0; c < kVectors; ++c)
      a[u][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[u] + c * 16), _mm512_set1_ps(rescale[u]));
  for (int64_t t = 0; t < units; ++t) {
    __m512i rows[kVectors];
#pragma GCC unroll 8
    for (int64_t c = 0; c < kVectors; ++c) rows[c] = panel_row(vp + (t * kDim + c * 16) * kPerLane<Panel>);
#pragma GCC unroll 4
    for (int64_t u = 0; u < N; ++u)
#pragma GCC unroll 8
      for (int64_t c = 0; c < kVectors; ++c) a[u][c] = lane_products<Panel>(a[u][c], rows[c], weights[u][t]);
  }
  for (int64_t u = 0; u < N; ++u)
    for (int64_t c = 0; c < kVectors; ++c) _mm512_storeu_ps(acc[u] + c * 16, a[u][c]);
}

#if defined(LITEINFER_AMX)
// What prompt attention's tasks read once prefill_attention (below) has laid the spans' keys out in bf16 panels.
struct PromptTasks {
  const c10::BFloat16* q;  // [tokens, num_heads, dim]
  c10::BFloat16* out;
  int64_t num_heads, kv_heads, group;
  const c10::BFloat16 *k_panels, *v_panels;  // per KV head `keys` keys, span s's from key_base[s]
  int64_t keys;
  const int64_t *key_base, *starts, *pos;
  const int64_t *task_span, *task_row;  // each row group's span and first query row (16 rows or the span's last)
  float scale;
  int64_t sliding_window;
};

constexpr int64_t kAmxRows = 16, kAmxKeys = 64;  // a task's query rows; the keys of one softmax step

// Prompt attention in AMX tiles (CPUs with AMX, bf16): the bf16 panels are already the tiles' B layout (a K panel's
// 16 pairs of dims by 16 keys; two V panels' 16 pairs of keys by 16 dims). A task takes 16 query rows against one KV
// head; for each of its group's heads and each 64 keys: the scores, Q (16 x 32 slices of a zero-padded copy) times
// four K panels, in tiles 0..3; the softmax online in registers, the weights rounded to bf16 into two 16 x 32 tiles
// (4, 5); the weights times the V panels in tiles 0..3, 64 dims at a time, added to the running outputs once those
// are rescaled. Tiles 6 and 7 take the panels' slices. A step's products take 16 tile instructions where the
// AVX-512 loop takes ~2,000 vdpbf16ps, and the softmax's bookkeeping is paid per 64 keys instead of per 16. This
// thread's share: tasks begin..end (task = row group * KV heads + KV head).
template <int64_t kDim>
void amx_prompt_tasks(const PromptTasks& t, int64_t begin, int64_t end) {
  static_assert(kDim % 64 == 0, "the values' sums are taken 64 dims (four tiles) at a time");
  using bf16 = c10::BFloat16;
  constexpr int64_t kStride = kAmxKeys * sizeof(float);  // a row of the 16 x 64 fp32 `step` buffer
  const __m512 scale = _mm512_set1_ps(t.scale);
  const liteinfer::TileConfig config(8);
  _tile_loadconfig(&config);
  const int64_t heads = t.group * kAmxRows;  // a task's queries, head-major: query g * 16 + i
  std::vector<bf16> queries(heads * kDim);
  std::vector<float> acc(heads * kDim), run_max(heads), run_sum(heads);
  alignas(64) float step[kAmxRows * kAmxKeys];  // a step's scores, then 64 dims of its values' sums
  alignas(64) bf16 weights[2][kAmxRows * 32];   // the step's softmax weights, keys 0..31 and 32..63
  alignas(64) float max_before[kAmxRows], max_after[kAmxRows], step_sum[kAmxRows], rescale[kAmxRows];
  __mmask16 visible[kAmxRows][kAmxKeys / 16];
  for (int64_t task = begin; task < end; ++task) {
    const int64_t h = task % t.kv_heads, s = t.task_span[task / t.kv_heads], r0 = t.task_row[task / t.kv_heads];
    const int64_t rows = std::min(r0 + kAmxRows, t.starts[s + 1]) - r0;
    std::fill(queries.begin(), queries.end(), bf16(0.f));  // rows past the span's last stay zero, as their weights
    std::memset(weights, 0, sizeof(weights));
    for (int64_t g = 0; g < t.group; ++g)
      for (int64_t i = 0; i < rows; ++i) {
        const bf16* row = t.q + ((r0 + i) * t.num_heads + h * t.group + g) * kDim;
        std::copy(row, row + kDim, queries.data() + (g * kAmxRows + i) * kDim);
      }
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(run_max.begin(), run_max.end(), kHidden);
    std::fill(run_sum.begin(), run_sum.end(), 0.f);
    const int64_t lo = first_visible_key(t.pos[r0], t.sliding_window), hi = t.pos[r0 + rows - 1];
    for (int64_t first = lo - lo % kAmxKeys; first <= hi; first += kAmxKeys) {
      const bf16* kp = t.k_panels + (h * t.keys + t.key_base[s] + first) * kDim;
      const bf16* vp = t.v_panels + (h * t.keys + t.key_base[s] + first) * kDim;
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t v = 0; v < kAmxKeys / 16; ++v)
          visible[i][v] = visible_keys(first + v * 16, t.pos[r0 + i], t.sliding_window);
      for (int64_t g = 0; g < t.group; ++g) {
        const bf16* q = queries.data() + g * kAmxRows * kDim;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t c = 0; c < kDim / 32; ++c) {  // dims c * 32.. of the queries; pairs c * 16.. of each panel
          const bf16* panel = kp + c * 16 * 32;
          _tile_loadd(4, q + c * 32, kDim * sizeof(bf16));
          _tile_loadd(6, panel, 64); _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, panel + 16 * kDim, 64); _tile_dpbf16ps(1, 4, 7);
          _tile_loadd(6, panel + 32 * kDim, 64); _tile_dpbf16ps(2, 4, 6);
          _tile_loadd(7, panel + 48 * kDim, 64); _tile_dpbf16ps(3, 4, 7);
        }
        _tile_stored(0, step, kStride); _tile_stored(1, step + 16, kStride);
        _tile_stored(2, step + 32, kStride); _tile_stored(3, step + 48, kStride);
        float* row_max = run_max.data() + g * kAmxRows;
        for (int64_t i = 0; i < kAmxRows; ++i) max_before[i] = max_after[i] = row_max[i], step_sum[i] = 0.f;
        for (int64_t i = 0; i < rows; ++i) {
          __m512 x[kAmxKeys / 16];
          __m512 top = _mm512_set1_ps(kHidden);
          for (int64_t v = 0; v < kAmxKeys / 16; ++v) {
            x[v] = _mm512_mask_blend_ps(visible[i][v], _mm512_set1_ps(kHidden),
                                        _mm512_mul_ps(_mm512_load_ps(step + i * kAmxKeys + v * 16), scale));
            top = _mm512_max_ps(top, x[v]);
          }
          max_after[i] = std::max(max_before[i], _mm512_reduce_max_ps(top));
          __m512 e[kAmxKeys / 16], sum = _mm512_setzero_ps();
          for (int64_t v = 0; v < kAmxKeys / 16; ++v) {  // (wholly hidden vectors skip the exp)
            e[v] = visible[i][v] ? _mm512_maskz_mov_ps(visible[i][v],
                                                       exp16(_mm512_sub_ps(x[v], _mm512_set1_ps(max_after[i]))))
                                 : _mm512_setzero_ps();
            sum = _mm512_add_ps(sum, e[v]);
          }
          step_sum[i] = _mm512_reduce_add_ps(sum);
          for (int64_t half = 0; half < 2; ++half)
            _mm512_store_si512(weights[half] + i * 32,
                               (__m512i)_mm512_cvtne2ps_pbh(e[half * 2 + 1], e[half * 2]));
        }
        // The rows' earlier sums scaled to their new maxima, 16 rows in one exp (0 where nothing was seen yet).
        const __m512 after = _mm512_load_ps(max_after);
        _mm512_store_ps(rescale, exp16(_mm512_sub_ps(_mm512_load_ps(max_before), after)));
        float* row_sum = run_sum.data() + g * kAmxRows;
        for (int64_t i = 0; i < rows; ++i) {
          row_sum[i] = row_sum[i] * rescale[i] + step_sum[i];
          row_max[i] = max_after[i];
        }
        _tile_loadd(4, weights[0], 64); _tile_loadd(5, weights[1], 64);
        for (int64_t d0 = 0; d0 < kDim; d0 += 64) {  // 64 dims: in a V panel pair row, 16 dims' pairs are 64 bytes
          const bf16* low = vp + d0 * 2, *high = vp + 32 * kDim + d0 * 2;  // keys 0..31, 32..63
          constexpr int64_t pair_row = kDim * 2 * sizeof(bf16);
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
          _tile_loadd(6, low, pair_row); _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, high, pair_row); _tile_dpbf16ps(0, 5, 7);
          _tile_loadd(6, low + 32, pair_row); _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(7, high + 32, pair_row); _tile_dpbf16ps(1, 5, 7);
          _tile_loadd(6, low + 64, pair_row); _tile_dpbf16ps(2, 4, 6);
          _tile_loadd(7, high + 64, pair_row); _tile_dpbf16ps(2, 5, 7);
          _tile_loadd(6, low + 96, pair_row); _tile_dpbf16ps(3, 4, 6);
          _tile_loadd(7, high + 96, pair_row); _tile_dpbf16ps(3, 5, 7);
          _tile_stored(0, step, kStride); _tile_stored(1, step + 16, kStride);
          _tile_stored(2, step + 32, kStride); _tile_stored(3, step + 48, kStride);
          for (int64_t i = 0; i < rows; ++i) {
            float* a = acc.data() + (g * kAmxRows + i) * kDim + d0;
            const __m512 r = _mm512_set1_ps(rescale[i]);
            for (int64_t c = 0; c < 4; ++c)
              _mm512_storeu_ps(a + c * 16, _mm512_fmadd_ps(_mm512_loadu_ps(a + c * 16), r,
                                                           _mm512_load_ps(step + i * kAmxKeys + c * 16)));
          }
        }
      }
    }
    for (int64_t g = 0; g < t.group; ++g)
      for (int64_t i = 0; i < rows; ++i) {
        bf16* dst = t.out + ((r0 + i) * t.num_heads + h * t.group + g) * kDim;
        const float* a = acc.data() + (g * kAmxRows + i) * kDim;
        const float inv = 1.f / run_sum[g * kAmxRows + i];
        for (int64_t d = 0; d < kDim; ++d) dst[d] = static_cast<bf16>(a[d] * inv);
      }
  }
  _tile_release();
}
#endif

// Prompt attention: the queries of each span (rows starts[s]..starts[s+1] of q, at positions[row]) against keys
// 0..position of their sequence (the last `sliding_window` of them when set), read through the span's block table.
// First every span's keys are laid out once in panels of 16 keys: in fp32, K transposed ([dim][16]) and V as rows;
// in bf16 (kBf16Dot), K as [dim / 2][16][2] and V as [8][dim][2] (key pairs), the pairs vdpbf16ps multiplies. Then
// each task takes 16 query rows with their group's heads against one KV head, 64 keys (four panels) at a time:
// scores as FMAs (or bf16 pair products) of broadcast query elements with panel rows (step_scores), softmax online
// (a running max and sum per query), the values summed in registers (step_values; in bf16, the softmax weights
// rounded to bf16 for the pair products, as PyTorch's flash attention rounds them). On CPUs with AMX, bf16 tasks
// run in its tiles instead (amx_prompt_tasks, above), on the same panels.
// int8 pools (k_scales and v_scales given) are laid out in panels dequantized, in q's dtype.
template <typename scalar_t, int64_t kDim>
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t block_size,
                       const float* k_scales, const float* v_scales, const at::Tensor& block_tables,
                       const at::Tensor& starts_t, const at::Tensor& positions, at::Tensor& out, double scale,
                       int64_t sliding_window) {
  constexpr int64_t kRowsPerTask = 16, kPanel = 16;
  const bool int8 = k_scales != nullptr;
  const int64_t num_heads = q.size(1), kv_heads = k_cache.size(1);
  const int64_t group = num_heads / kv_heads, table_width = block_tables.size(1), spans = starts_t.numel() - 1;
  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const scalar_t* k_data = int8 ? nullptr : k_cache.data_ptr<scalar_t>();
  const scalar_t* v_data = int8 ? nullptr : v_cache.data_ptr<scalar_t>();
  const uint8_t* k_bytes = int8 ? k_cache.data_ptr<uint8_t>() : nullptr;
  const int8_t* v_bytes = int8 ? v_cache.data_ptr<int8_t>() : nullptr;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const liteinfer::PoolRuns runs = liteinfer::PoolRuns::of(k_cache);  // (check_query_and_pools: all pools alike)
  const int64_t* starts = starts_t.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();

  // Span s's keys 0..its last position, rounded up to whole softmax steps, start at key_base[s] of each head's
  // buffers.
  std::vector<int64_t> key_base(spans + 1, 0), panel_span;
  for (int64_t s = 0; s < spans; ++s) {
    key_base[s + 1] = key_base[s] + (pos[starts[s + 1] - 1] + kStepKeys) / kStepKeys * kStepKeys;
    for (int64_t k = key_base[s]; k < key_base[s + 1]; k += kPanel) panel_span.push_back(s);
  }
  const int64_t keys = key_base[spans], panels = static_cast<int64_t>(panel_span.size());
  constexpr bool kBf16 = kBf16Dot<scalar_t, kDim>;
  using Panel = std::conditional_t<kBf16, c10::BFloat16, float>;
  // Every element is written below (keys past a span's last position as zeros): allocated, not zero-filled first.
  const std::unique_ptr<Panel[]> k_panels(new Panel[kv_heads * keys * kDim]);
  const std::unique_ptr<Panel[]> v_panels(new Panel[kv_heads * keys * kDim]);
  at::parallel_for(0, panels * kv_heads, 1, [&](int64_t begin, int64_t end) {
    static const Panel zeros[kDim] = {};  // the rows of keys past a span's last: never seen (hidden by position)
    Panel k_row[kDim], v_rows[2][kDim];   // a key's rows in the panels' type, where the pools' are not
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % kv_heads, panel = task / kv_heads, s = panel_span[panel];
      const int64_t first = panel * kPanel - key_base[s], last = pos[starts[s + 1] - 1];
      Panel* kp = k_panels.get() + (h * keys + panel * kPanel) * kDim;
      Panel* vp = v_panels.get() + (h * keys + panel * kPanel) * kDim;
      const Panel* v_even = zeros;  // the V row of the pair's first key
      for (int64_t j = 0; j < kPanel; ++j) {
        const int64_t key = first + j;
        const Panel *k = zeros, *v = zeros;
        if (key <= last) {
          const int64_t block = tables[s * table_width + key / block_size], row = key % block_size;
          const int64_t run = runs.start(block, h, block_size * kDim), offset = run + row * kDim;
          if (int8) {
#if defined(LITEINFER_INT8_POOLS)
            const int64_t scale_at = runs.start(block, h, block_size) + row;
            int8_key_row<kDim>(k_bytes + run, block_size, row, k_scales[scale_at], k_row);
            int8_value_row<kDim>(v_bytes + run, row, v_scales[scale_at], v_rows[j % 2]);
#endif
            k = k_row, v = v_rows[j % 2];
          } else if constexpr (kBf16) {
            k = k_data + offset, v = v_data + offset;
          } else {
            to_float(k_data + offset, k_row, kDim);
            to_float(v_data + offset, v_rows[j % 2], kDim);
            k = k_row, v = v_rows[j % 2];
          }
        }
        // K: the key's lanes (bf16 pairs or floats) down panel column j, lane w in panel row w.
        for (int64_t w = 0; w < kDim / kPerLane<Panel>; ++w) {
          const int32_t lane = lane_at(k, w);
          std::memcpy(kp + (w * kPanel + j) * kPerLane<Panel>, &lane, sizeof(lane));
        }
        // V: fp32 rows as they are; bf16 ones by key pairs, the two keys' elements side by side.
        if constexpr (kBf16) {
#if defined(__AVX512BF16__)
          if (j % 2 == 0) {
            v_even = v;
            continue;
          }
          // Elements 0..15 of the even row's 32 (indices 0..31) beside the odd row's (32..63); then 16..31.
          alignas(64) static constexpr uint16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                            37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                            11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
          const __m512i low = _mm512_load_si512(kLow), high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
          Panel* pair = vp + j / 2 * kDim * 2;
          for (int64_t d = 0; d < kDim; d += 32) {
            const __m512i even = _mm512_loadu_si512(v_even + d), odd = _mm512_loadu_si512(v + d);
            _mm512_storeu_si512(pair + d * 2, _mm512_permutex2var_epi16(even, low, odd));
            _mm512_storeu_si512(pair + d * 2 + 32, _mm512_permutex2var_epi16(even, high, odd));
          }
#endif
        } else {
          std::copy(v, v + kDim, vp + j * kDim);
        }
      }
    }
  });

  std::vector<int64_t> task_span, task_row;  // (span, first query row) of each group of rows
  for (int64_t s = 0; s < spans; ++s)
    for (int64_t r = starts[s]; r < starts[s + 1]; r += kRowsPerTask) task_span.push_back(s), task_row.push_back(r);
  // A task (a row group against one KV head) walks the keys its rows see, and along a span the later rows see more:
  // split evenly by count, the thread with a long span's second half had ~3/4 of the work (one span of 2,048 tokens
  // on 2 threads, in AMX tiles: 11.5 ms, against 6.4 split by work).
  const int64_t num_tasks = static_cast<int64_t>(task_span.size()) * kv_heads;
  auto task_work = [&](int64_t task) {  // its rows times the keys they walk (plus a step's worth for the rest)
    const int64_t s = task_span[task / kv_heads], r0 = task_row[task / kv_heads];
    const int64_t r1 = std::min(r0 + kRowsPerTask, starts[s + 1]);
    return (r1 - r0) * (pos[r1 - 1] - first_visible_key(pos[r0], sliding_window) + kStepKeys);
  };
#if defined(LITEINFER_AMX)
  if constexpr (kBf16 && kDim % 64 == 0) {
    static_assert(kRowsPerTask == kAmxRows && kStepKeys % kAmxKeys == 0);
    if (liteinfer::amx_permitted()) {
      const PromptTasks tasks{q_data, out_data, num_heads, kv_heads, group, k_panels.get(), v_panels.get(), keys,
                              key_base.data(), starts, pos, task_span.data(), task_row.data(),
                              static_cast<float>(scale), sliding_window};
      return parallel_balanced(num_tasks, task_work,
                               [&](int64_t begin, int64_t end) { amx_prompt_tasks<kDim>(tasks, begin, end); });
    }
  }
#endif
  // Each task: its queries' scores against 64 keys (four panels) at a time, the softmax online over them, then the
  // values; panels past the last key a pass of queries sees are skipped, as are queries that see none of the step.
  parallel_balanced(num_tasks, task_work, [&](int64_t begin, int64_t end) {
    constexpr int64_t kWeightLanes = kStepKeys / kPerLane<Panel>;
    constexpr int64_t kScorePass = 4, kValuePass = 256 / kDim;  // queries a pass: 16 sums in registers each way
    const int64_t max_queries = (kRowsPerTask * group + 15) / 16 * 16;  // (whole vectors for the rescale's exp)
    std::vector<float> query(max_queries * kDim), acc(max_queries * kDim), scores(max_queries * kStepKeys);
    std::vector<float> run_max(max_queries), run_sum(max_queries), max_before(max_queries), step_sum(max_queries),
        rescale(max_queries);
    std::vector<int32_t> weights(max_queries * kWeightLanes);  // the step's softmax weights, as the V rows' lanes
    std::vector<const void*> query_lanes(max_queries);  // each query as step_scores reads it: bf16, or widened
    std::vector<const int32_t*> weight_lanes(max_queries);
    std::vector<float*> acc_rows(max_queries);
    for (int64_t i = 0; i < max_queries; ++i) {
      weight_lanes[i] = weights.data() + i * kWeightLanes;
      acc_rows[i] = acc.data() + i * kDim;
    }
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % kv_heads, s = task_span[task / kv_heads], r0 = task_row[task / kv_heads];
      const int64_t r1 = std::min(r0 + kRowsPerTask, starts[s + 1]), queries = (r1 - r0) * group;
      // Query i: row r0 + i / group, head h * group + i % group.
      auto position = [&](int64_t i) { return pos[r0 + i / group]; };
      auto query_row = [&](int64_t i) {
        return q_data + ((r0 + i / group) * num_heads + h * group + i % group) * kDim;
      };
      for (int64_t i = 0; i < queries; ++i) {
        if constexpr (kBf16) {
          query_lanes[i] = query_row(i);
        } else {
          to_float(query_row(i), query.data() + i * kDim, kDim);
          query_lanes[i] = query.data() + i * kDim;
        }
      }
      std::fill(acc.begin(), acc.begin() + queries * kDim, 0.f);
      std::fill(run_max.begin(), run_max.end(), kHidden);
      std::fill(run_sum.begin(), run_sum.begin() + queries, 0.f);
      // Positions grow along a span: the first row sees the first key, the last row the last.
      const int64_t lo = first_visible_key(pos[r0], sliding_window), hi = pos[r1 - 1];
      int64_t seen = 0;  // queries before it see none of the step's keys (their positions come before it)
      for (int64_t first = lo - lo % kStepKeys; first <= hi; first += kStepKeys) {
        const Panel* kp = k_panels.get() + (h * keys + key_base[s] + first) * kDim;
        const Panel* vp = v_panels.get() + (h * keys + key_base[s] + first) * kDim;
        while (position(seen) < first) ++seen;
        // The step's panels that hold keys query i may see (its position's and those before); a pass of queries
        // takes its last query's.
        auto panels_to = [&](int64_t i) { return std::min<int64_t>(4, (position(i) - first) / 16 + 1); };
        for_passes<kScorePass>(seen, queries, [&](auto n, int64_t i0) {
          pass_of<4>(panels_to(i0 + n() - 1), 0, [&](auto np, int64_t) {
            step_scores<n(), np(), kDim>(query_lanes.data() + i0, kp, static_cast<float>(scale),
                                         scores.data() + i0 * kStepKeys);
          });
        });
        std::copy(run_max.begin(), run_max.end(), max_before.begin());
        for (int64_t i = seen; i < queries; ++i) {
          const int64_t panels = panels_to(i);
          __m512 x[4], top = _mm512_set1_ps(kHidden);
          __mmask16 visible[4];
          for (int64_t p = 0; p < 4; ++p) {
            visible[p] = p < panels ? visible_keys(first + p * 16, position(i), sliding_window) : 0;
            x[p] = _mm512_mask_blend_ps(visible[p], _mm512_set1_ps(kHidden),
                                        _mm512_loadu_ps(&scores[i * kStepKeys + p * 16]));
            top = _mm512_max_ps(top, x[p]);
          }
          run_max[i] = std::max(max_before[i], _mm512_reduce_max_ps(top));
          __m512 e[4], sum = _mm512_setzero_ps();
          for (int64_t p = 0; p < 4; ++p) {  // (wholly hidden panels skip the exp)
            const __m512 shifted = _mm512_sub_ps(x[p], _mm512_set1_ps(run_max[i]));
            e[p] = visible[p] ? _mm512_maskz_mov_ps(visible[p], exp16(shifted)) : _mm512_setzero_ps();
            sum = _mm512_add_ps(sum, e[p]);
          }
          step_sum[i] = _mm512_reduce_add_ps(sum);
          int32_t* w = weights.data() + i * kWeightLanes;
          if constexpr (kBf16) {  // rounded to bf16, two keys a lane, as the V panels pair them
#if defined(__AVX512BF16__)
            _mm512_storeu_si512(w, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
            _mm512_storeu_si512(w + 16, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
#endif
          } else {
            for (int64_t p = 0; p < 4; ++p) _mm512_storeu_si512(w + p * 16, _mm512_castps_si512(e[p]));
          }
        }
        // The queries' earlier sums scaled to their new maxima, 16 in one exp (0 where nothing was seen yet; 1 where
        // nothing is seen now).
        for (int64_t i = seen / 16 * 16; i < queries; i += 16)
          _mm512_storeu_ps(&rescale[i], exp16(_mm512_sub_ps(_mm512_loadu_ps(&max_before[i]),
                                                            _mm512_loadu_ps(&run_max[i]))));
        for (int64_t i = seen; i < queries; ++i) run_sum[i] = run_sum[i] * rescale[i] + step_sum[i];
        for_passes<kValuePass>(seen, queries, [&](auto n, int64_t i0) {
          step_values<n(), kDim>(acc_rows.data() + i0, rescale.data() + i0, weight_lanes.data() + i0,
                                 panels_to(i0 + n() - 1) * 16 / kPerLane<Panel>, vp);
        });
      }
      for (int64_t i = 0; i < queries; ++i) {
        scalar_t* dst = out_data + ((r0 + i / group) * num_heads + h * group + i % group) * kDim;
        const float inv = 1.f / run_sum[i];
        for (int64_t d = 0; d < kDim; ++d) dst[d] = static_cast<scalar_t>(acc[i * kDim + d] * inv);
      }
    }
  });
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& query_starts,
                                   const at::Tensor& positions, double scale, int64_t sliding_window,
                                   const std::optional<at::Tensor>& k_scales,
                                   const std::optional<at::Tensor>& v_scales) {
  const auto [int8, block_size] = check_query_and_pools(q, k_cache, v_cache, k_scales, v_scales);
  const float* ks = int8 ? k_scales->data_ptr<float>() : nullptr;
  const float* vs = int8 ? v_scales->data_ptr<float>() : nullptr;
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_starts.scalar_type() == at::kLong &&
                  positions.scalar_type() == at::kLong,
              "block tables, query starts and positions must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && query_starts.numel() == block_tables.size(0) + 1 &&
                  positions.numel() == q.size(0),
              "one block table per span, its start and end rows, and one position per query");
  const at::Tensor q_ = q.contiguous(), tables = block_tables.contiguous(), starts = query_starts.contiguous(),
                   pos = positions.contiguous();
  const int64_t* starts_data = starts.data_ptr<int64_t>();
  for (int64_t s = 0; s + 1 < starts.numel(); ++s)
    TORCH_CHECK(starts_data[s] < starts_data[s + 1], "every span needs at least one query row");
  TORCH_CHECK(starts_data[0] == 0 && starts_data[starts.numel() - 1] == q.size(0), "the spans must cover q's rows");
  at::Tensor out = at::empty_like(q_);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill_attention", [&] {
    switch (q.size(2)) {
      case 64: return prefill_attention<scalar_t, 64>(q_, k_cache, v_cache, block_size, ks, vs, tables, starts, pos,
                                                     out, scale, sliding_window);
      case 128: return prefill_attention<scalar_t, 128>(q_, k_cache, v_cache, block_size, ks, vs, tables, starts, pos,
                                                       out, scale, sliding_window);
      default: TORCH_CHECK(false, "paged_prefill_attention takes head sizes 64 and 128, not ", q.size(2));
    }
  });
  return out;
}
#endif

}  // namespace

TORCH_LIBRARY(liteinfer, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor positions, "
        "float scale, int sliding_window, float softcap, Tensor? k_scales=None, Tensor? v_scales=None) -> Tensor");
  m.def("int8_pools_available() -> bool", +[] { return kInt8Pools; });  // no tensor: no dispatch key
#if defined(__AVX512F__)  // elsewhere prompts keep PyTorch's SDPA
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_starts, "
        "Tensor positions, float scale, int sliding_window, Tensor? k_scales=None, Tensor? v_scales=None) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(liteinfer, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
#if defined(__AVX512F__)
  m.impl("paged_prefill_attention", &paged_prefill_attention);
#endif
}
