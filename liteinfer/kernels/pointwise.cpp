// A decoder layer's per-token operations, each one pass over its rows: RMSNorm (with the residual add before it),
// rotary embedding of the queries and keys, the gated activation, and the new K/V copied into their cache slots.
// Eager PyTorch spends several ops on each (seven for a norm), every one a trip through memory and, at a decode
// step's few rows, mostly dispatch; inductor fuses them in the compiled graph, and these serve the steps that run
// eagerly (and the graphs' SiLU, where ours is the faster). Each rounds to the activations' dtype where the PyTorch
// expression it replaces does (layers/norm.py, rotary.py, activation.py), so that bf16 results agree with it.
// Registered (CPU) as torch.ops.liteinfer.rms_norm, add_rms_norm, rotary, gated_activation and write_kv;
// liteinfer/kernels/__init__.py builds them and gives their contract.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "exp16.h"
#include "gate_row.h"
#include "int8_pools.h"
#include "lanes16.h"
#include "pool_runs.h"

namespace {

// fp32 arithmetic on values stored in T, with PyTorch's rounding back to T (round to nearest even). Written as bit
// operations for bf16 so that the loops vectorise (-ffast-math: no NaN branch).
template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}
template <>
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename T>
inline T narrow(float x) {
  return static_cast<T>(x);
}
template <>
inline c10::BFloat16 narrow(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return c10::BFloat16(static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16), c10::BFloat16::from_bits());
}
template <typename T>
inline float round_to(float x) {  // x as T would hold it
  return widen(narrow<T>(x));
}

// Rows a task takes: at least ~16k elements, so that a decode step's few rows run on one thread (a parallel
// region costs more than they do).
inline int64_t grain(int64_t row_size) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_size)); }

// out = norm(x + residual) and sum = x + residual (rounded to T) when `residual` is given; out = norm(x) otherwise.
// norm(v) = (v / rms(v)) rounded to T, times the weight, rounded (Llama); Gemma: v / rms(v) * (1 + weight), one
// rounding.
template <typename T>
void rms_norm_rows(const at::Tensor& x, const T* residual, const at::Tensor& weight, double eps, bool gemma,
                   at::Tensor& out, T* sum) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xd = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* od = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xd + r * n;
      T* o = od + r * n;
      float squares = 0.f;
      if (residual != nullptr) {
        const T* res = residual + r * n;
        T* s = sum + r * n;
        for (int64_t d = 0; d < n; ++d) {
          s[d] = narrow<T>(widen(xr[d]) + widen(res[d]));
          const float v = widen(s[d]);
          squares += v * v;
        }
        xr = s;
      } else {
        for (int64_t d = 0; d < n; ++d) squares += widen(xr[d]) * widen(xr[d]);
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + static_cast<float>(eps));
      if (gemma) {
        for (int64_t d = 0; d < n; ++d) o[d] = narrow<T>(widen(xr[d]) * inv * (1.f + widen(w[d])));
      } else {
        for (int64_t d = 0; d < n; ++d) o[d] = narrow<T>(widen(w[d]) * round_to<T>(widen(xr[d]) * inv));
      }
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expected x [rows, size], contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              "expected a weight [size] in x's dtype");
}

#define LITEINFER_DISPATCH(dtype, name, ...) \
  AT_DISPATCH_SWITCH(dtype, name, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma) {
  check_norm(x, weight);
  at::Tensor out = at::empty_like(x);
  LITEINFER_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x, nullptr, weight, eps, gemma, out, nullptr);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, bool gemma) {
  check_norm(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "expected a residual like x");
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  LITEINFER_DISPATCH(x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x, residual.data_ptr<scalar_t>(), weight, eps, gemma, out, sum.data_ptr<scalar_t>());
  });
  return {out, sum};
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define LITEINFER_VECTORS16
// fp32 and bf16 values 16 lanes at a time, in fp32 (lanes16.h's load_row16 and store_row16), and the rounding to T
// that PyTorch's ops do between them.
using liteinfer::load_row16;
using liteinfer::store_row16;
inline __m512 round16(__m512 v, const float*) { return v; }
inline __m512 round16(__m512 v, const c10::BFloat16*) {  // to bf16 (nearest even) and back
  return liteinfer::widen_bf16((__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// One head rotated ("rotate half": the first half of a head pairs with the second): out = x * cos +
// rotate_half(x) * sin, each product and the sum rounded to T as the three PyTorch ops round them; both halves at
// once, 16 lanes at a time for fp32 and bf16 (a scalar loop per half ran ~4x a copy of the same bytes at a prompt
// step's 2,048 rows of SmolLM2).
template <typename T>
inline void rotate_head(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,
                        T* __restrict__ out, int64_t half) {
  int64_t d = 0;
#if defined(LITEINFER_VECTORS16)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    for (; d + 16 <= half; d += 16) {
      const __m512 first = load_row16(x + d), second = load_row16(x + d + half);
      const __m512 cos1 = load_row16(cos + d), sin1 = load_row16(sin + d), cos2 = load_row16(cos + d + half),
                   sin2 = load_row16(sin + d + half);
      store_row16(out + d,
                  _mm512_sub_ps(round16(_mm512_mul_ps(first, cos1), x), round16(_mm512_mul_ps(second, sin1), x)));
      store_row16(out + d + half,
                  _mm512_add_ps(round16(_mm512_mul_ps(second, cos2), x), round16(_mm512_mul_ps(first, sin2), x)));
    }
  }
#endif
  for (; d < half; ++d) {
    const float first = widen(x[d]), second = widen(x[d + half]);
    out[d] = narrow<T>(round_to<T>(first * widen(cos[d])) - round_to<T>(second * widen(sin[d])));
    out[d + half] = narrow<T>(round_to<T>(second * widen(cos[d + half])) + round_to<T>(first * widen(sin[d + half])));
  }
}

// Each head of x [tokens, heads, dim] rotated by its token's angles, cos and sin [tokens, dim].
template <typename T>
void rotate(const at::Tensor& x, const T* cos, const T* sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2, row_stride = x.stride(0);
  const T* xd = x.data_ptr<T>();
  T* od = out.data_ptr<T>();
  at::parallel_for(0, tokens, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(xd + t * row_stride + h * dim, c, s, od + (t * heads + h) * dim, half);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  for (const at::Tensor* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 3 && x->stride(2) == 1 && x->stride(1) == x->size(2) && x->size(2) % 2 == 0,
                "expected q and k [tokens, heads, dim], heads side by side in each token's row, dim even");
    TORCH_CHECK(x->size(0) == cos.size(0) && x->size(2) == cos.size(-1) && x->scalar_type() == cos.scalar_type(),
                "q and k need one cos and sin row per token, of their head size and dtype");
  }
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == cos.size(0) * cos.size(-1) && cos.is_contiguous() &&
                  sin.is_contiguous() && sin.scalar_type() == cos.scalar_type(),
              "expected cos and sin [tokens, (1,) dim], contiguous");
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  LITEINFER_DISPATCH(q.scalar_type(), "rotary", [&] {
    rotate<scalar_t>(q, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), q_out);
    rotate<scalar_t>(k, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), k_out);
  });
  return {q_out, k_out};
}

constexpr float kMaxExponent = 88.f;  // SiLU's e^-g is taken at most e^88: see silu_row16

#if defined(LITEINFER_VECTORS16)
// SiLU(gate) * up 16 lanes at a time for fp32 and bf16 rows, as gate_row's scalar loop computes it but with the exp
// of exp16.h and the division as a reciprocal refined once (a few fp32 steps from that loop's values): 1.7x its
// speed on a decode step's 32 rows of SmolLM2 in bf16 and 1.9x on a prompt step's 1,315, and faster than inductor's
// kernel for the same expression, so that compiled graphs call it too (layers/activation.py; docs/benchmarks.md).
// The row's elements in whole vectors; returns how many (the caller's scalar loop takes the rest).
template <typename T>
int64_t silu_row16(const T* gate, const T* up, T* o, int64_t size) {
  int64_t d = 0;
  for (; d + 16 <= size; d += 16) {
    const __m512 g = load_row16(gate + d);
    // e^-g at most e^88 (finite in fp32): past it the sum overflowed to infinity, and the refined reciprocal of
    // infinity is 0 * infinity, NaN, where PyTorch's SiLU of such a gate (below -88) is -0.
    const __m512 minus_g = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(kMaxExponent));
    const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.f), liteinfer::exp16(minus_g));
    const __m512 estimate = _mm512_rcp14_ps(denominator);  // 14 bits; one Newton step doubles them
    // g / denominator as (g * estimate) * (2 - denominator * estimate), in that order: as g * (estimate * (2 - ...))
    // the bf16 activation of 5.9375 (5.92187440, just under the tie 5.921875) rounded up where PyTorch rounds down
    // (3,409 of 6.3 million outputs of random gates of scale 3; none in this order). The empty asm keeps the compiler
    // (-ffast-math: free to reassociate) from turning the one into the other.
    __m512 scaled = _mm512_mul_ps(g, estimate);
    asm("" : "+v"(scaled));
    const __m512 silu = _mm512_mul_ps(scaled, _mm512_fnmadd_ps(denominator, estimate, _mm512_set1_ps(2.f)));
    store_row16(o + d, _mm512_mul_ps(round16(silu, o), load_row16(up + d)));
  }
  return d;
}
#endif

}  // namespace

// gate_row.h's function: SiLU in vectors of 16 where this build has them (silu_row16), GELU and the rest of a row
// in scalars.
template <typename T, bool kGelu>
__attribute__((noinline)) void liteinfer::gate_row(const T* gate, const T* up, T* o, int64_t size) {
  int64_t d = 0;
#if defined(LITEINFER_VECTORS16)
  if constexpr (!kGelu && (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>))
    d = silu_row16(gate, up, o, size);
#endif
  for (; d < size; ++d) {
    const float g = widen(gate[d]);
    float act;
    if constexpr (kGelu) {
      act = 0.5f * g * (1.f + std::tanh(0.7978845608f * (g + 0.044715f * g * g * g)));
    } else {
      act = g / (1.f + std::exp(std::min(-g, kMaxExponent)));  // (-ffast-math: no infinity, as above)
    }
    o[d] = narrow<T>(round_to<T>(act) * widen(up[d]));
  }
}
template void liteinfer::gate_row<float, false>(const float*, const float*, float*, int64_t);
template void liteinfer::gate_row<float, true>(const float*, const float*, float*, int64_t);
template void liteinfer::gate_row<c10::BFloat16, false>(const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*,
                                                        int64_t);
template void liteinfer::gate_row<c10::BFloat16, true>(const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*,
                                                       int64_t);
template void liteinfer::gate_row<c10::Half, false>(const c10::Half*, const c10::Half*, c10::Half*, int64_t);
template void liteinfer::gate_row<c10::Half, true>(const c10::Half*, const c10::Half*, c10::Half*, int64_t);

namespace {

// act(gate) * up for gate_up [rows, 2 * size] (gate the first half of each row), a row at a time (gate_row).
// act: "silu", or "gelu_tanh" (GELU's tanh approximation).
template <typename T, bool kGelu>
void gate_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), size = gate_up.size(1) / 2;
  const T* in = gate_up.data_ptr<T>();
  T* od = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(size), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * 2 * size;
      liteinfer::gate_row<T, kGelu>(gate, gate + size, od + r * size, size);
    }
  });
}

at::Tensor gated_activation(const at::Tensor& gate_up, c10::string_view act) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "expected gate_up [rows, 2 * size], contiguous");
  TORCH_CHECK(act == "silu" || act == "gelu_tanh", "gated_activation takes silu or gelu_tanh, not ", act);
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  LITEINFER_DISPATCH(gate_up.scalar_type(), "gated_activation", [&] {
    act == "silu" ? gate_rows<scalar_t, false>(gate_up, out) : gate_rows<scalar_t, true>(gate_up, out);
  });
  return out;
}

// Each new token's K and V ([tokens, kv_heads, dim], each head's row contiguous) copied into its cache slot: row
// slot_offsets[t] of block slot_blocks[t] of pools [blocks, kv_heads, block_size, dim] (their runs block- or
// head-major: pool_runs.h). PyTorch's indexed assignment costs ~10 us a call at a decode step's few tokens, two
// calls a layer.
// What both K/V writes ask of the new rows k and v ([tokens, kv_heads, dim], each head's row contiguous, in
// `dtype`) and of their slots (one int64 block and offset per token, inside the pool of `blocks` x `block_size`).
void check_rows_and_slots(const at::Tensor& k, const at::Tensor& v, int64_t heads, int64_t dim, at::ScalarType dtype,
                          const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, int64_t blocks,
                          int64_t block_size) {
  const int64_t tokens = k.size(0);
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->size(0) == tokens && x->size(1) == heads && x->size(2) == dim &&
                    x->stride(2) == 1 && x->scalar_type() == dtype,
                "expected k and v [tokens, kv_heads, dim] in the pools' dtype, each head's row contiguous");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.numel() == tokens && slot_offsets.numel() == tokens && slot_blocks.is_contiguous() &&
                  slot_offsets.is_contiguous(),
              "expected one int64 slot block and offset per token");
  const int64_t* block = slot_blocks.data_ptr<int64_t>();
  const int64_t* offset = slot_offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(block[t] >= 0 && block[t] < blocks && offset[t] >= 0 && offset[t] < block_size,
                "cache slot (", block[t], ", ", offset[t], ") outside the pool");
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "expected K/V pools [blocks, kv_heads, block_size, dim], alike");
  const liteinfer::PoolRuns runs = liteinfer::PoolRuns::of(k_cache);
  TORCH_CHECK(liteinfer::PoolRuns::of(v_cache) == runs, "the K and V pools' runs must lie alike (pool_runs.h)");
  const int64_t tokens = k.size(0), heads = k_cache.size(1), block_size = k_cache.size(2), dim = k_cache.size(3);
  check_rows_and_slots(k, v, heads, dim, k_cache.scalar_type(), slot_blocks, slot_offsets, k_cache.size(0),
                       block_size);
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  const int64_t row_bytes = dim * static_cast<int64_t>(k.element_size());
  // The tokens shared by the threads as the layer's other per-token ops share them (a prompt step's 2,048 tokens of
  // SmolLM2 took ~0.23 ms a layer on one thread).
  at::parallel_for(0, tokens, grain(2 * heads * dim), [&](int64_t begin, int64_t end) {
    for (auto [src, pool] : {std::pair{&k, &k_cache}, std::pair{&v, &v_cache}}) {
      const char* from = static_cast<const char*>(src->data_ptr());
      char* to = static_cast<char*>(pool->data_ptr());
      const int64_t token_stride = src->stride(0) * src->element_size();
      const int64_t head_stride = src->stride(1) * src->element_size();
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h)
          std::memcpy(to + (runs.start(blocks[t], h, block_size) + offsets[t]) * row_bytes,
                      from + t * token_stride + h * head_stride, row_bytes);
    }
  });
}

// The same into int8 pools (layout in kernels/__init__.py), each row at its own scale, its largest |element| / 127:
// levels round(x * (127 / largest)), scale largest * (1 / 127), as layers/attention.py's `_int8_levels` computes
// them (a division by 127 would be a multiplication under -ffast-math anyway).
template <typename scalar_t>
void write_kv_int8_rows(const at::Tensor& k, const at::Tensor& v, uint8_t* k_pool, int8_t* v_pool, float* k_scales,
                        float* v_scales, const int64_t* blocks, const int64_t* offsets, int64_t heads,
                        int64_t block_size, int64_t dim, liteinfer::PoolRuns runs) {
  const scalar_t* k_data = k.data_ptr<scalar_t>();
  const scalar_t* v_data = v.data_ptr<scalar_t>();
  // Row o's scales lie at block_row + o; its K and V elements among the block's bytes for the head (int8_pools.h:
  // k_byte, v_byte), K's 4 * block_size bytes apart in groups of four, V's in the quad of rows o / 4.
  auto block_row = [&](int64_t t, int64_t h) { return runs.start(blocks[t], h, block_size); };
  auto k_block = [&](int64_t t, int64_t h) { return k_pool + block_row(t, h) * dim; };
  auto v_block = [&](int64_t t, int64_t h) { return v_pool + block_row(t, h) * dim; };
  // The slots lie anywhere in the pools, so each token's lines (those its K row is spread over, the V quad its row
  // is spread over, two scales) are requested kAhead tokens before they are written: one at a time, the misses took
  // turns (the write ran ~2.4x as long as the bf16 pools' copy, measured from DRAM).
  constexpr int64_t kAhead = 4;
  auto request = [&](int64_t t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = block_row(t, h) + offsets[t];
      const uint8_t* k_row = k_block(t, h) + liteinfer::k_byte(offsets[t], 0, block_size);
      for (int64_t d = 0; d < dim; d += 4) __builtin_prefetch(k_row + d * block_size, 1, 3);
      const int8_t* quad = v_block(t, h) + liteinfer::v_byte(offsets[t] / 4 * 4, 0, dim);
      for (int64_t line = 0; line < 4 * dim; line += 64) __builtin_prefetch(quad + line, 1, 3);
      __builtin_prefetch(k_scales + row, 1, 3);
      __builtin_prefetch(v_scales + row, 1, 3);
    }
  };
  const int64_t strides[2][2] = {{k.stride(0), k.stride(1)}, {v.stride(0), v.stride(1)}};
  at::parallel_for(0, k.size(0), grain(2 * heads * dim), [&](int64_t begin, int64_t end) {
    const int64_t n = dim, keys = block_size;  // local copies: the byte stores below may alias what the lambda reaches
    std::vector<float> row(n);
    std::vector<int32_t> levels(n);
    for (int64_t t = begin; t < std::min(begin + kAhead, end); ++t) request(t);
    for (int64_t t = begin; t < end; ++t) {
      if (t + kAhead < end) request(t + kAhead);
      for (int64_t h = 0; h < heads; ++h)
        for (const int values : {0, 1}) {
          const scalar_t* x = (values ? v_data : k_data) + t * strides[values][0] + h * strides[values][1];
          float* r = row.data();
          int32_t* l = levels.data();
          float largest = 0.f;
          for (int64_t d = 0; d < n; ++d) {
            r[d] = widen(x[d]);
            largest = std::max(largest, std::abs(r[d]));
          }
          const float to_levels = largest > 0 ? 127.f / largest : 0.f;
          for (int64_t d = 0; d < n; ++d) l[d] = static_cast<int32_t>(std::nearbyint(r[d] * to_levels));
          (values ? v_scales : k_scales)[block_row(t, h) + offsets[t]] = largest * (1.f / 127.f);
          if (values) {
            int8_t* v_row = v_block(t, h) + liteinfer::v_byte(offsets[t], 0, n);  // its elements 4 bytes apart
            for (int64_t d = 0; d < n; ++d) v_row[d * 4] = static_cast<int8_t>(l[d]);
          } else {
            uint8_t* k_row = k_block(t, h) + liteinfer::k_byte(offsets[t], 0, keys);
            for (int64_t d = 0; d < n; ++d) k_row[liteinfer::k_byte(0, d, keys)] = static_cast<uint8_t>(l[d] + 128);
          }
        }
    }
  });
}

void write_kv_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                   at::Tensor& k_scales, at::Tensor& v_scales, const at::Tensor& slot_blocks,
                   const at::Tensor& slot_offsets) {
  const auto [block_size, dim] = liteinfer::check_int8_pools(k_cache, v_cache, k_scales, v_scales);
  const int64_t heads = k_cache.size(1);
  check_rows_and_slots(k, v, heads, dim, k.scalar_type(), slot_blocks, slot_offsets, k_cache.size(0), block_size);
  LITEINFER_DISPATCH(k.scalar_type(), "write_kv_int8", [&] {
    write_kv_int8_rows<scalar_t>(k, v, k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<int8_t>(),
                                 k_scales.data_ptr<float>(), v_scales.data_ptr<float>(),
                                 slot_blocks.data_ptr<int64_t>(), slot_offsets.data_ptr<int64_t>(), heads, block_size,
                                 dim, liteinfer::PoolRuns::of(k_cache));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(liteinfer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool gemma) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool gemma) -> (Tensor, Tensor)");
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("gated_activation(Tensor gate_up, str act) -> Tensor");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_blocks, "
        "Tensor slot_offsets) -> ()");
  m.def("write_kv_int8(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scales, "
        "Tensor(d!) v_scales, Tensor slot_blocks, Tensor slot_offsets) -> ()");
}

TORCH_LIBRARY_IMPL(liteinfer, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("gated_activation", &gated_activation);
  m.impl("write_kv", &write_kv);
  m.impl("write_kv_int8", &write_kv_int8);
}
