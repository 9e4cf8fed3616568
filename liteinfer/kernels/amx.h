// AMX (Intel Xeon since Sapphire Rapids), shared by the packed linears (packed_linear.cpp), the quantized batches
// (gemv.cpp) and prompt attention (paged_attention.cpp): the permission Linux asks for before a thread may use the
// tiles, the one tile shape the kernels configure, and the chunk of W the linears keep in L2 over many rows. Builds
// for CPUs without AMX define nothing here (LITEINFER_AMX unset).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define LITEINFER_AMX
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace liteinfer {

// Linux hands out AMX's tile registers only to a process that asks for them (its state is 8 KB per thread).
inline bool amx_permitted() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return permitted;
}

// Past 128 rows of x, the bytes of W (bf16, as the tiles read it) that a thread keeps in L2 while every 128 rows pass
// over them, before the next such chunk: W then comes from memory (or is dequantized) once a call, not once every 128
// rows. A quarter of the 2 MB of L2 a core of these Xeons has, beside the 128 rows' x and y; 256 KB to 3 MB measured
// (docs/benchmarks.md). The packed linears and the quantized batches both walk W this way.
constexpr int64_t kAmxChunkBytes = 512 * 1024;

// The tiles' shapes (ldtilecfg's 64-byte layout, palette 1): tiles 0..tiles-1 of 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int tiles) {
    for (int t = 0; t < tiles; ++t) bytes_per_row[t] = 64, rows[t] = 16;
  }
};

}  // namespace liteinfer
#endif
