// The gated activation of one row, shared by gated_activation (pointwise.cpp, which defines it) and
// packed_gated_linear (packed_linear.cpp).
#pragma once

#include <cstdint>

namespace liteinfer {

// act(gate) * up for one row of `size` outputs, the activation rounded to T before the product as PyTorch's two ops
// round it (kGelu: GELU's tanh approximation, else SiLU); T fp32, bf16 or fp16. Defined once and never inlined, so
// that both ops run the same instructions: with -ffast-math the compiler may regroup an inlined copy's arithmetic,
// and where an activation sits near a tie between two bf16 values the ops then differ in the last bit (seen while
// packed_gated_linear was written; pointwise.cpp's silu_row16 fixes its own order).
template <typename T, bool kGelu>
void gate_row(const T* gate, const T* up, T* o, int64_t size);

}  // namespace liteinfer
