// The mask of a vector's first lanes (AVX-512), shared by decode attention (paged_attention.cpp) and the greedy
// head's screen (greedy_head.cpp).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

namespace liteinfer {

// The mask of a vector's first min(n, 16) lanes: the rows, scores or tokens left when fewer than 16 remain.
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

}  // namespace liteinfer
#endif
