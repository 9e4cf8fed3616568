// e^x in 16 fp32 lanes (AVX-512), shared by decode attention's softmax (paged_attention.cpp) and the gated SiLU
// (pointwise.cpp): ~10 instructions where a call to the C library's expf per element, or SLEEF's accurate vector
// form, costs several times more.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace liteinfer {

// 2^(x log2 e) as 2^n (vscalefps, which also takes a hugely negative n to 0) times 2^f, |f| <= 1/2, from the
// Taylor series of e^(f ln 2) to the 6th power (relative error ~1e-7).
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 y = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

}  // namespace liteinfer
#endif
