// The greedy head's screen (layers/greedy_head.py): a step's logits in bytes, each known to within a bound, and the
// tokens that can still be a row's greedy token. Registered (CPU, AVX-512 VNNI and BF16) as
// torch.ops.liteinfer.head_screen; liteinfer/kernels/__init__.py builds it and gives its contract.
//
// x's rows are rounded to uint8 levels (one scale a row) but for a few input dims where hidden states carry values
// far above the rest (they would set the scale), which are multiplied in bf16 pairs (exact for a bf16 model); W is
// held as int8 levels (one scale a token). vpdpbusd multiplies 64 bytes an instruction, twice vdpbf16ps's pairs, and
// W's levels are half a bf16 head's bytes. Layouts: levels [tokens / 64, in / 4, 64, 4] (64 tokens' four inputs side
// by side, one stream through W), outlier weights [tokens / 64, dims / 2, 64, 2] bf16 (64 tokens' pairs side by side).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "lanes16.h"

namespace {

constexpr int64_t kBlock = 64;    // tokens a tile: four vectors of 16
constexpr int kMaxRows = 6;       // rows a tile: 24 accumulators, 4 vectors of W and a broadcast in 32 registers
constexpr double kRounding = 0x1p-23;  // twice fp32's unit roundoff: a bound for any one rounding, as in greedy_head.py
constexpr double kMargin = 1 + 0x1p-10;
constexpr double kAbsolute = 1e-6;

using liteinfer::first_lanes;

// acc += the products of x's unsigned bytes and w's signed ones, four a lane. In asm, so that the sum stays in its
// register: with the intrinsic GCC copied every accumulator to another register (or the stack) around each one.
inline void dpbusd(__m512i& acc, __m512i x, __m512i w) { __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w)); }

// One block of 64 tokens for R rows: the byte products summed in int32, less each token's offset (128 times its
// levels' sum: x's levels are unsigned, x + 128), scaled by the row's and the token's scale, plus the outlier dims'
// pairs' products; and each row's largest of them into `high`. The logits go out by streaming stores (`out` on a
// line's start): a plain store reads each line from memory first (6 MB a 32-row call, beside W's levels' stream),
// and only the few blocks that can hold a candidate are read back (a 32-row call ~8% faster).
template <int R>
void screen_tile(const uint8_t* x, int64_t in, const int8_t* w, const float* row_scale, const uint16_t* outliers,
                 int64_t pairs, const uint16_t* w_outliers, const float* w_scale, const int32_t* w_offset, float* out,
                 int64_t out_stride, float* high, int64_t high_stride) {
  static_assert(1 <= R && R <= 6);
  // Four vectors of 16 tokens a row (rows past R unused).
  __m512i a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33, a40, a41, a42, a43, a50,
      a51, a52, a53;
  a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = a40 = a41 = a42 =
      a43 = a50 = a51 = a52 = a53 = _mm512_setzero_si512();
  for (int64_t step = 0; step < in / 4; ++step) {
    const int8_t* ws = w + step * kBlock * 4;
    const __m512i w0 = _mm512_loadu_si512(ws), w1 = _mm512_loadu_si512(ws + 64);
    const __m512i w2 = _mm512_loadu_si512(ws + 128), w3 = _mm512_loadu_si512(ws + 192);
    auto row = [&](int r, __m512i& c0, __m512i& c1, __m512i& c2, __m512i& c3) {
      int32_t four;
      std::memcpy(&four, x + r * in + step * 4, 4);
      const __m512i xr = _mm512_set1_epi32(four);
      dpbusd(c0, xr, w0);
      dpbusd(c1, xr, w1);
      dpbusd(c2, xr, w2);
      dpbusd(c3, xr, w3);
    };
    row(0, a00, a01, a02, a03);
    if constexpr (R > 1) row(1, a10, a11, a12, a13);
    if constexpr (R > 2) row(2, a20, a21, a22, a23);
    if constexpr (R > 3) row(3, a30, a31, a32, a33);
    if constexpr (R > 4) row(4, a40, a41, a42, a43);
    if constexpr (R > 5) row(5, a50, a51, a52, a53);
  }
  const __m512i acc[6][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23},
                             {a30, a31, a32, a33}, {a40, a41, a42, a43}, {a50, a51, a52, a53}};
  __m512 sum[R][4];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      sum[r][c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], _mm512_loadu_si512(w_offset + 16 * c))),
                                _mm512_mul_ps(_mm512_set1_ps(row_scale[r]), _mm512_loadu_ps(w_scale + 16 * c)));
    }
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* wp = w_outliers + p * kBlock * 2;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      int32_t two;
      std::memcpy(&two, outliers + r * pairs * 2 + p * 2, 4);
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(two);
      sum[r][0] = _mm512_dpbf16_ps(sum[r][0], xp, w0);
      sum[r][1] = _mm512_dpbf16_ps(sum[r][1], xp, w1);
      sum[r][2] = _mm512_dpbf16_ps(sum[r][2], xp, w2);
      sum[r][3] = _mm512_dpbf16_ps(sum[r][3], xp, w3);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_stream_ps(out + r * out_stride + 16 * c, sum[r][c]);
    high[r * high_stride] =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(sum[r][0], sum[r][1]), _mm512_max_ps(sum[r][2], sum[r][3])));
  }
}

using TileFn = decltype(&screen_tile<1>);
constexpr TileFn kTiles[kMaxRows] = {screen_tile<1>, screen_tile<2>, screen_tile<3>,
                                     screen_tile<4>, screen_tile<5>, screen_tile<6>};

// What a row's bound needs besides W's norms: e(j) = alpha |w_j| + beta |w_j - w'_j| + absolute (see greedy_head.py).
struct RowBound {
  float alpha, beta, absolute;
  double reach;  // the l1 norm of what the screen multiplies: x's levels times its scale, and its outlier dims
};

// Rounds row x (in inputs) to levels, outlier dims aside (their values rounded to bf16 and copied out, their levels
// 128: zero), and returns its bound's terms; `finite` false when some value is not finite (the screen then declines).
// `weight_rounding`: how far W's outlier columns were rounded (relative to |w_j|; 0 when they are W's own values).
template <typename scalar_t>
RowBound quantize_row(const scalar_t* x, int64_t in, const int64_t* dims, int64_t num_dims, double weight_rounding,
                      uint8_t* levels, uint16_t* outliers, float& scale, bool& finite) {
  std::vector<float> rest(in);
  for (int64_t k = 0; k < in; ++k) rest[k] = static_cast<float>(x[k]);
  double norm = 0, outlier_error = 0, norm_outliers = 0, reach = 0;
  uint32_t exponents = 0;
  auto not_finite = [](float value) {  // bits, not isfinite: the build's -ffast-math drops that
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    return (bits & 0x7F800000u) == 0x7F800000u;
  };
  for (int64_t d = 0; d < num_dims; ++d) {
    const float value = rest[dims[d]];
    const c10::BFloat16 rounded(value);  // to nearest even
    outliers[d] = rounded.x;
    exponents |= not_finite(value);
    const double exact = value, kept = static_cast<float>(rounded);
    norm += exact * exact, outlier_error += (exact - kept) * (exact - kept), norm_outliers += kept * kept;
    reach += std::fabs(kept);
    rest[dims[d]] = 0;
  }
  float largest = 0;
  for (int64_t k = 0; k < in; ++k) {
    exponents |= not_finite(rest[k]);
    largest = std::max(largest, std::fabs(rest[k]));
  }
  finite = exponents == 0;
  scale = largest > 0 ? largest / 127 : 1.0f;
  const float inverse = 1.0f / scale;
  double error = 0, norm_rounded = 0;
  for (int64_t k = 0; k < in; ++k) {
    const float level = std::clamp(std::nearbyint(rest[k] * inverse), -127.0f, 127.0f);
    levels[k] = static_cast<uint8_t>(static_cast<int>(level) + 128);
    const double value = rest[k], rounded = static_cast<double>(scale) * level;
    norm += value * value, error += (value - rounded) * (value - rounded), norm_rounded += rounded * rounded;
    reach += std::fabs(rounded);
  }
  // The full head's fp32 sum over `in` products, and the screen's: its byte sum converted, scaled twice, then two
  // roundings per pair of outlier dims.
  auto gamma = [](double n) { return n * kRounding / (1 - n * kRounding); };
  const double head = gamma(static_cast<double>(in)), screen = gamma(static_cast<double>(num_dims + 4));
  norm = std::sqrt(norm), error = std::sqrt(error), norm_rounded = std::sqrt(norm_rounded);
  outlier_error = std::sqrt(outlier_error), norm_outliers = std::sqrt(norm_outliers);
  const double alpha = error + outlier_error + weight_rounding * norm_outliers + head * norm +
                       screen * (norm_rounded + (1 + weight_rounding) * norm_outliers);
  return {static_cast<float>(alpha * kMargin), static_cast<float>(norm_rounded * (1 + screen) * kMargin),
          static_cast<float>(kAbsolute), reach};
}

// The tokens of one row whose upper end a + E reaches the row's largest lower end a - E, E = (1 + relative) e +
// relative |a|, found from the row's largest a in each block (`high`, which the tiles keep): a block's E computed as a
// token's own E is but from the block's largest |w_j| and |w_j - w'_j| is no smaller than the E of the token that
// holds its largest a, so the blocks' lower ends give a lower bound L of the row's largest, and a block whose upper
// end stays below L holds neither a candidate nor that largest. Only the others are read token by token (a few of a
// row's 768 on a real model's logits): first for the row's largest lower end among their tokens, then for the tokens
// that reach it.
void row_candidates(const float* a, const float* high, const float* maxima, int64_t blocks, int64_t n,
                    const float* norm, const float* distance, RowBound b, float relative, std::vector<int32_t>& out) {
  const float widen = 1 + relative;
  const __m512 alpha = _mm512_set1_ps(b.alpha * widen), beta = _mm512_set1_ps(b.beta * widen);
  const __m512 absolute = _mm512_set1_ps(b.absolute * widen), relative_v = _mm512_set1_ps(relative);
  auto half_width = [&](__m512 n_j, __m512 d_j, __m512 a_j) {  // E, in the same order for a token and for a block
    return _mm512_fmadd_ps(alpha, n_j, _mm512_fmadd_ps(beta, d_j, _mm512_fmadd_ps(relative_v, _mm512_abs_ps(a_j),
                                                                                  absolute)));
  };
  std::vector<float> upper(blocks);
  __m512 bound = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t block = 0; block < blocks; block += 16) {
    const __mmask16 mask = first_lanes(blocks - block);
    const __m512 h = _mm512_maskz_loadu_ps(mask, high + block);
    const __m512 e = half_width(_mm512_maskz_loadu_ps(mask, maxima + block),
                                _mm512_maskz_loadu_ps(mask, maxima + blocks + block), h);
    // A token below the block's largest a may have a larger |a| (a negative one), so a larger E by relative times the
    // difference, which its own a makes up (a + relative |a| grows with a) in exact arithmetic; the block's upper end
    // is widened by more than the roundings of both ends could take (~10 units of fp32's roundoff of |a| + E).
    const __m512 slack = _mm512_fmadd_ps(_mm512_add_ps(_mm512_abs_ps(h), e), _mm512_set1_ps(0x1p-20f), absolute);
    _mm512_mask_storeu_ps(upper.data() + block, mask, _mm512_add_ps(_mm512_add_ps(h, e), slack));
    bound = _mm512_mask_max_ps(bound, mask, bound, _mm512_sub_ps(h, e));
  }
  const float lower_bound = _mm512_reduce_max_ps(bound);
  std::vector<int64_t> kept;
  for (int64_t block = 0; block < blocks; ++block)
    if (upper[block] >= lower_bound) kept.push_back(block);
  // Each kept block's tokens, 16 at a time: fn(first token, mask, a, E).
  auto for_tokens = [&](const auto& fn) {
    for (const int64_t block : kept)
      for (int64_t j = block * kBlock; j < std::min(n, (block + 1) * kBlock); j += 16) {
        const __mmask16 mask = first_lanes(n - j);
        const __m512 v = _mm512_maskz_loadu_ps(mask, a + j);
        fn(j, mask, v, half_width(_mm512_maskz_loadu_ps(mask, norm + j), _mm512_maskz_loadu_ps(mask, distance + j), v));
      }
  };
  __m512 lower = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for_tokens([&](int64_t, __mmask16 mask, __m512 v, __m512 e) {
    lower = _mm512_mask_max_ps(lower, mask, lower, _mm512_sub_ps(v, e));
  });
  const __m512 largest_lower = _mm512_set1_ps(_mm512_reduce_max_ps(lower));
  for_tokens([&](int64_t j, __mmask16 mask, __m512 v, __m512 e) {
    for (uint32_t hits = _mm512_mask_cmp_ps_mask(mask, _mm512_add_ps(v, e), largest_lower, _CMP_GE_OQ); hits;
         hits &= hits - 1)
      out.push_back(static_cast<int32_t>(j + __builtin_ctz(hits)));
  });
}

at::Tensor head_screen(const at::Tensor& hidden, const at::Tensor& outlier_dims, const at::Tensor& levels,
                       const at::Tensor& level_scales, const at::Tensor& level_offsets,
                       const at::Tensor& outlier_weights, const at::Tensor& vocab_terms,
                       const at::Tensor& block_terms, at::Tensor& logits, double relative, double weight_rounding,
                       double largest_scale) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() &&
                  (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
              "expected hidden [rows, in], fp32 or bf16, contiguous");
  const int64_t rows = hidden.size(0), in = hidden.size(1);
  TORCH_CHECK(levels.dim() == 4 && levels.size(1) * 4 == in && levels.size(2) == kBlock && levels.size(3) == 4 &&
                  levels.scalar_type() == at::kChar && levels.is_contiguous(),
              "expected levels [tokens / 64, in / 4, 64, 4] int8, contiguous");
  // A row's byte sum stays within int32: at most in * 255 * 127.
  TORCH_CHECK(in <= 65536, "the screen takes at most 65,536 inputs");
  const int64_t blocks = levels.size(0), n = blocks * kBlock, dims = outlier_dims.numel();
  TORCH_CHECK(outlier_dims.dim() == 1 && outlier_dims.scalar_type() == at::kLong && outlier_dims.is_contiguous() &&
                  dims % 2 == 0, "expected outlier_dims [dims] int64, an even number of them");
  const int64_t* dim_index = outlier_dims.data_ptr<int64_t>();
  for (int64_t d = 0; d < dims; ++d) TORCH_CHECK(0 <= dim_index[d] && dim_index[d] < in, "outlier dim out of range");
  TORCH_CHECK(outlier_weights.sizes() == at::IntArrayRef({blocks, dims / 2, kBlock, 2}) &&
                  outlier_weights.scalar_type() == at::kBFloat16 && outlier_weights.is_contiguous(),
              "expected outlier_weights [tokens / 64, dims / 2, 64, 2] bf16, contiguous");
  TORCH_CHECK(level_scales.sizes() == at::IntArrayRef({n}) && level_scales.scalar_type() == at::kFloat &&
                  level_offsets.sizes() == at::IntArrayRef({n}) && level_offsets.scalar_type() == at::kInt &&
                  level_scales.is_contiguous() && level_offsets.is_contiguous(),
              "expected level_scales [tokens] fp32 and level_offsets [tokens] int32");
  TORCH_CHECK(vocab_terms.dim() == 2 && vocab_terms.size(0) == 2 && vocab_terms.size(1) <= n &&
                  vocab_terms.size(1) > 0 && vocab_terms.scalar_type() == at::kFloat && vocab_terms.is_contiguous(),
              "expected vocab_terms [2, vocab] fp32 with vocab <= tokens, contiguous");
  const int64_t vocab = vocab_terms.size(1), vocab_blocks = (vocab + kBlock - 1) / kBlock;
  TORCH_CHECK(block_terms.sizes() == at::IntArrayRef({2, vocab_blocks}) &&
                  block_terms.scalar_type() == at::kFloat && block_terms.is_contiguous(),
              "expected block_terms [2, vocab / 64 rounded up] fp32, contiguous");
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) >= rows && logits.size(1) == n &&
                  logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.stride(0) == n &&
                  reinterpret_cast<uintptr_t>(logits.data_ptr()) % 64 == 0,
              "expected logits [rows or more, tokens] fp32, contiguous, on a 64-byte boundary (streaming stores)");
  TORCH_CHECK(largest_scale > 0, "expected largest_scale > 0: the largest of level_scales over the vocabulary");

  std::vector<uint8_t> x_levels(rows * in);
  std::vector<uint16_t> x_outliers(rows * dims);
  std::vector<float> x_scales(rows);
  std::vector<RowBound> bounds(rows);
  bool finite = true;
  for (int64_t r = 0; r < rows; ++r) {
    bool row_finite;
    auto quantize = [&](auto type) {
      using scalar_t = decltype(type);
      bounds[r] = quantize_row(hidden.data_ptr<scalar_t>() + r * in, in, dim_index, dims, weight_rounding,
                               &x_levels[r * in], &x_outliers[r * dims], x_scales[r], row_finite);
    };
    hidden.scalar_type() == at::kFloat ? quantize(float{}) : quantize(c10::BFloat16{});
    finite = finite && row_finite;
  }
  const auto none = at::empty({0}, hidden.options().dtype(at::kLong));
  // Every logit the screen computes, and each partial sum of it, is at most a row's reach times W's largest |level
  // times scale| (its outlier columns' values no larger, but for an fp32 head's rounding to bf16): rows that reach
  // 2^126 are declined rather than checked value by value, so that the screen's logits are finite without a test.
  const double largest_w = 127.0 * (1 + 0x1p-7) * largest_scale;
  for (int64_t r = 0; r < rows; ++r) finite = finite && bounds[r].reach * largest_w < 0x1p126;
  if (!finite) return none;

  const int8_t* w = levels.data_ptr<int8_t>();
  const uint16_t* w_outliers = reinterpret_cast<const uint16_t*>(outlier_weights.data_ptr<at::BFloat16>());
  const float* w_scale = level_scales.data_ptr<float>();
  const int32_t* w_offset = level_offsets.data_ptr<int32_t>();
  float* a = logits.data_ptr<float>();
  // Each row's largest logit in each block, which the tiles keep as they store the block's logits.
  std::unique_ptr<float[]> high(new float[rows * blocks]);
  // Each thread streams its own range of W's blocks once, every row tile reading a block while it is in cache.
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r));
        kTiles[tile_rows - 1](&x_levels[r * in], in, w + block * kBlock * in, &x_scales[r], &x_outliers[r * dims],
                              dims / 2, w_outliers + block * dims * kBlock, w_scale + block * kBlock,
                              w_offset + block * kBlock, a + r * n + block * kBlock, n, &high[r * blocks + block],
                              blocks);
      }
    }
    _mm_sfence();  // the streamed logits written before another thread reads them
  });
  if (vocab % kBlock)  // the last block's tokens past the vocabulary (zeros) left out of its largest
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = a + r * n + (vocab_blocks - 1) * kBlock;
      high[r * blocks + vocab_blocks - 1] = *std::max_element(row, row + vocab % kBlock);
    }
  const float* norm = vocab_terms.data_ptr<float>();
  const float* distance = norm + vocab;
  const float* block_maxima = block_terms.data_ptr<float>();
  std::vector<std::vector<int32_t>> found(rows);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      row_candidates(a + r * n, &high[r * blocks], block_maxima, vocab_blocks, vocab, norm, distance,
                     bounds[r], static_cast<float>(relative), found[r]);
  });
  std::vector<char> chosen(vocab, 0);
  for (int64_t r = 0; r < rows; ++r)
    for (const int32_t j : found[r]) chosen[j] = 1;
  std::vector<int64_t> ids;
  for (int64_t j = 0; j < vocab; ++j) {
    if (chosen[j]) ids.push_back(j);
  }
  at::Tensor out = at::empty({static_cast<int64_t>(ids.size())}, hidden.options().dtype(at::kLong));
  std::copy(ids.begin(), ids.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(liteinfer, m) {
  m.def("head_screen(Tensor hidden, Tensor outlier_dims, Tensor levels, Tensor level_scales, Tensor level_offsets, "
        "Tensor outlier_weights, Tensor vocab_terms, Tensor block_terms, Tensor(a!) logits, float relative, "
        "float weight_rounding, float largest_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(liteinfer, CPU, m) { m.impl("head_screen", &head_screen); }
#endif
