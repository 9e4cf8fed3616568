// The mask of a vector's first lanes (AVX-512), shared by decode attention (paged_attention.cpp), the greedy head's
// screen (greedy_head.cpp) and the sampler (sample.cpp); sixteen of a row's fp32, bf16 or fp16 values as fp32 (-inf
// in the lanes past a mask), shared by attention, the per-token ops (pointwise.cpp), the argmax (argmax.cpp) and the
// sampler; and sixteen fp32 values stored as fp32 or bf16 (attention, the per-token ops).
#pragma once

#if defined(__AVX512F__)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <limits>

namespace liteinfer {

// The mask of a vector's first min(n, 16) lanes: the rows, scores or tokens left when fewer than 16 remain.
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

inline __m512 widen_bf16(__m256i bits) {  // bf16 is the top half of an fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load_row16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load_row16(const c10::BFloat16* x) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
inline __m512 load_row16(const c10::Half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// And back: sixteen fp32 values stored as a row's fp32 or bf16 (rounded to nearest even).
inline void store_row16(float* x, __m512 v) { _mm512_storeu_ps(x, v); }
#if defined(__AVX512BF16__)
inline void store_row16(c10::BFloat16* x, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__)  // the bf16 tail's masked load: BW+VL
// The lanes past `mask` read nothing and hold -inf, which neither a max nor a weight e^(x - max) takes.
inline __m512 load_row16(const float* x, __mmask16 mask) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), mask, x);
}
inline __m512 load_row16(const c10::BFloat16* x, __mmask16 mask) {
  return _mm512_mask_blend_ps(mask, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                              widen_bf16(_mm256_maskz_loadu_epi16(mask, x)));
}
#endif

}  // namespace liteinfer
#endif
