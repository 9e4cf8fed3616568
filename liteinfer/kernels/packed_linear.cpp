// y = x W^T (+ b) for any number of rows x, with W packed for it by layers/linear.py: pack_weight. W's outputs go
// in groups of three blocks of 16 (48 outputs; the last group one or two blocks when the blocks do not divide by
// three), each group stored step by step: for each input pair (bf16: the two inputs one vdpbf16ps multiplies) or
// input (fp32), its outputs' weights side by side. Registered (CPU: AVX-512 with BF16, or AVX2 with FMA) as
// torch.ops.liteinfer.packed_linear; liteinfer/kernels/__init__.py builds it and gives its contract.
//
// A step of a block is one 64-byte load holding 16 outputs' weights for one input (pair): multiplied by that input
// of every row, broadcast, it adds into 16 outputs at once, with no sum across a register at the end. A tile keeps
// ROWS rows by one group (up to 48 outputs) of fp32 sums in registers and reads the group front to back, one
// sequential stream, while the thread's next lines of W are prefetched into L2, so that W comes from DRAM once per
// call, overlapped with the arithmetic: on AVX-512 a few tiles of fp32 rows take the group in passes of 64 steps,
// each pass through every tile (its W then in L1); otherwise each tile takes the whole group (re-read from L2).
// Threads share W's groups, or from SHARE_ROWS_FROM rows a thread on x's rows (each then reads all of W). The same
// loops serve torch.ops.liteinfer.packed_gated_linear: a gated MLP's gate/up W packed in halves, act(gate) * up made
// from each tile's sums before they leave the core (group_outputs).
// On SmolLM2's linears this ran about 1.5x oneDNN's prepacked matmul at 32 rows, level with our one-row GEMV at
// one row, and level with oneDNN from 256 rows up (docs/benchmarks.md).
//
// The tiles are in packed_tile.h, which the quantized weights' batches (gemv.cpp) share. On CPUs with AVX2 and FMA
// but not AVX-512 BF16 the same layout is read by a tile of their own: a block of 16 outputs is two 8-lane vectors,
// and bf16 weights are widened in registers. On CPUs with AMX, bf16 goes
// through its tiles instead (amx_rows): on an Intel Xeon with AMX that ran SmolLM2's linears 3.1x faster than the
// AVX-512 tile at 32 rows and 1.2-1.3x oneDNN's prepacked matmul, 0.8-0.9x it at 256 rows, level at 1,024.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "packed_tile.h"

#if defined(LITEINFER_PACKED_AVX512) || defined(LITEINFER_PACKED_AVX2)
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "amx.h"
#include "gate_row.h"

namespace {

using liteinfer::packed::BLOCKS, liteinfer::packed::FLOAT_TILES, liteinfer::packed::LINE, liteinfer::packed::Prefetch,
    liteinfer::packed::ROWS, liteinfer::packed::tile_for;
#if defined(LITEINFER_PACKED_AVX512)
using liteinfer::load_row16, liteinfer::packed::store_outputs;
#endif

constexpr int64_t M_BLOCK = 128;  // rows per pass over W: their x stays in L2 (128 x 1536 bf16: 384 KB)

// A thread's part of a call: rows [row_begin, row_end) of x and y, groups [group_begin, group_end) of W.
struct Share {
  int64_t row_begin, row_end, group_begin, group_end;
};

// From this many rows a thread on, the threads share x's rows and each reads all of W, rather than sharing W's
// groups and each reading all of x: a thread then reads and writes only its own rows of x and y, the rows that the
// layer's row-parallel ops before and after it (norms, rotary, the activation: at::parallel_for over rows) write and
// read on the same core. On the Intel Xeon (2 threads), eager bf16 prompt steps of 512 / 1,024 / 2,048 tokens 5-6% /
// 9% / 7-11% faster, fp32 ones of 1,280 3-5%; at 128 rows a thread sharing them was level or slower
// (docs/benchmarks.md). Counted per thread: with fewer rows each, every thread would stream all of W for a few rows.
constexpr int64_t SHARE_ROWS_FROM = 256;

// body(share) on each thread, rows shared (in units of `row_unit`) or groups shared, as above.
template <typename Body>
void share_out(int64_t m, int64_t groups, int64_t row_unit, const Body& body) {
  if (m >= SHARE_ROWS_FROM * at::get_num_threads()) {
    at::parallel_for(0, (m + row_unit - 1) / row_unit, 1, [&](int64_t begin, int64_t end) {
      body(Share{begin * row_unit, std::min(m, end * row_unit), 0, groups});
    });
  } else {
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) { body(Share{0, m, begin, end}); });
  }
}

// What a call makes of the products: y = x W^T (+ b), or for a gate/up W packed in halves (gate's rows, then up's,
// each half packed on its own by layers/linear.py: pack_gate_up, so that group g of each covers the same outputs)
// act(x G^T + b_g) * (x U^T + b_u): the gated MLP's activation made beside its matmul, where gated_activation would
// write gate/up's outputs out and read them back (prompt steps: 12 MB each way at 2,048 rows of SmolLM2).
enum class Act { kNone, kSilu, kGeluTanh };

// W's n packed outputs as a call makes them: one half when plain, two (gate's, then up's) when gated; each half's
// blocks of 16 outputs, and the outputs a row of y holds.
struct Outputs {
  Act act;
  int64_t halves, half_blocks, n_out;
  Outputs(Act act, int64_t n) : act(act), halves(act == Act::kNone ? 1 : 2), half_blocks(n / 16 / halves),
                                n_out(n / halves) {}
};

constexpr int64_t GROUP_OUTPUTS = BLOCKS * 16;

// The outputs of the group whose first block is b0 (nb blocks) for `rows` rows of y (y at their first row):
// `pass(first_block, out, stride)` multiplies the rows by W's group from first_block into out (`stride` a row).
// Gated, gate's group and up's go into `scratch` (a row of each side by side), rounded to T as a linear's outputs
// are, and liteinfer::gate_row makes act(gate) * up from them as gated_activation would (the same bits), into y or,
// `stream`ed (AVX-512, fp32), into a row in L1 that streaming stores then write to y.
template <typename T, typename Pass>
void group_outputs(const Outputs& outputs, int64_t b0, int64_t nb, int64_t rows, T* y, T* scratch,
                   const Pass& pass, bool stream = false) {
  if (outputs.act == Act::kNone) return pass(b0, y + b0 * 16, outputs.n_out);
  pass(b0, scratch, 2 * GROUP_OUTPUTS);
  pass(outputs.half_blocks + b0, scratch + GROUP_OUTPUTS, 2 * GROUP_OUTPUTS);
  const auto gate_row = outputs.act == Act::kSilu ? &liteinfer::gate_row<T, false> : &liteinfer::gate_row<T, true>;
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = scratch + r * 2 * GROUP_OUTPUTS;
    T* out = y + r * outputs.n_out + b0 * 16;
#if defined(LITEINFER_PACKED_AVX512)
    if (stream) {
      alignas(64) T row[GROUP_OUTPUTS];
      gate_row(gate, gate + GROUP_OUTPUTS, row, nb * 16);
      for (int64_t b = 0; b < nb; ++b) store_outputs<T>(out + b * 16, load_row16(row + b * 16), nullptr, true);
      continue;
    }
#endif
    gate_row(gate, gate + GROUP_OUTPUTS, out, nb * 16);
  }
}

#if defined(LITEINFER_AMX)
// CPUs with AMX (Intel Xeon since Sapphire Rapids) multiply bf16 in tiles: one tdpbf16ps adds a 16 x 32 tile of x
// times 32 inputs' weights for 16 outputs into 16 x 16 fp32 sums, 16x the work of a vdpbf16ps. The packed layout is
// already what a tile of W wants: 16 consecutive steps of a block, one 64-byte row each, NB * 64 bytes apart. A
// pass of 16 rows keeps one group's sums in tiles 0..NB-1, x's 16 x 32 slice in tile 3 and the blocks' slices in
// tiles 4..3+NB; every 16 rows re-read the group from L2. Rows are taken 16 at a time, the last 16 from a
// zero-padded copy of x; inputs must come in multiples of 32 (else the AVX-512 tiles serve).

using liteinfer::amx_permitted, liteinfer::kAmxChunkBytes, liteinfer::TileConfig;

constexpr int64_t AMX_ROWS = 16, AMX_INPUTS = 32;

// y[rows valid of 16 padded, 16 * NB outputs] = x[16 rows] . the group of NB blocks at `w` (+ b), through `sums`
// (16 x 16 * NB fp32).
template <int NB>
void amx_pass(const c10::BFloat16* x, int64_t k, const c10::BFloat16* w, const c10::BFloat16* bias,
              c10::BFloat16* y, int64_t n, int64_t rows, float* sums) {
  constexpr int64_t step_bytes = NB * 64;  // a step of the group: NB blocks of 16 outputs' pairs
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  for (int64_t i = 0; i < k; i += AMX_INPUTS) {
    const c10::BFloat16* steps = w + i / 2 * NB * 32;
    _tile_loadd(3, x + i, k * 2);
    _tile_loadd(4, steps, step_bytes);
    _tile_dpbf16ps(0, 3, 4);
    if constexpr (NB > 1) {
      _tile_loadd(5, steps + 32, step_bytes);
      _tile_dpbf16ps(1, 3, 5);
    }
    if constexpr (NB > 2) {
      _tile_loadd(6, steps + 64, step_bytes);
      _tile_dpbf16ps(2, 3, 6);
    }
  }
  _tile_stored(0, sums, step_bytes);
  if constexpr (NB > 1) _tile_stored(1, sums + 16, step_bytes);
  if constexpr (NB > 2) _tile_stored(2, sums + 32, step_bytes);
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < NB; ++b)
      store_outputs(y + r * n + b * 16, _mm512_loadu_ps(sums + r * NB * 16 + b * 16), bias ? bias + b * 16 : nullptr);
}

void amx_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y,
              int64_t m, int64_t k, const Outputs& outputs) {
  using Pass = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*,
                        int64_t, int64_t, float*);
  static constexpr std::array<Pass, BLOCKS + 1> by_blocks = {nullptr, &amx_pass<1>, &amx_pass<2>, &amx_pass<3>};
  // The last 16 rows from a zero-padded copy, so that every tile load reads 16 whole rows.
  const int64_t full = m / AMX_ROWS * AMX_ROWS;
  std::vector<c10::BFloat16> tail(m > full ? AMX_ROWS * k : 0);
  std::copy(x + full * k, x + m * k, tail.begin());
  const int64_t block_size = k * 16, half_blocks = outputs.half_blocks, groups = (half_blocks + BLOCKS - 1) / BLOCKS;
  // A thread's groups in chunks of kAmxChunkBytes, every M block of its rows over one chunk before the next (at
  // 2,048 rows, W from memory once instead of 16 times: 1.75 -> ~2.1 TFLOP/s).
  const int64_t chunk = std::max<int64_t>(1, kAmxChunkBytes / (outputs.halves * BLOCKS * block_size * 2));
  share_out(m, groups, AMX_ROWS, [&](const Share& share) {
    const TileConfig config(4 + BLOCKS);
    _tile_loadconfig(&config);
    alignas(64) float sums[AMX_ROWS * BLOCKS * 16];
    alignas(64) c10::BFloat16 scratch[AMX_ROWS * 2 * GROUP_OUTPUTS];
    for (int64_t c0 = share.group_begin; c0 < share.group_end; c0 += chunk) {
      const int64_t c_end = std::min(share.group_end, c0 + chunk);
      for (int64_t m0 = share.row_begin; m0 < share.row_end; m0 += M_BLOCK) {
        const int64_t m_end = std::min(share.row_end, m0 + M_BLOCK);
        for (int64_t g = c0; g < c_end; ++g) {
          const int64_t b0 = g * BLOCKS, nb = std::min(BLOCKS, half_blocks - b0);
          for (int64_t r0 = m0; r0 < m_end; r0 += AMX_ROWS) {
            const c10::BFloat16* rows_x = r0 < full ? x + r0 * k : tail.data();
            const int64_t rows = std::min(AMX_ROWS, m_end - r0);
            group_outputs(outputs, b0, nb, rows, y + r0 * outputs.n_out, scratch,
                          [&](int64_t first, c10::BFloat16* out, int64_t stride) {
                            by_blocks[nb](rows_x, k, w + first * block_size, bias ? bias + first * 16 : nullptr, out,
                                          stride, rows, sums);
                          });
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

#if defined(LITEINFER_PACKED_AVX512)
using liteinfer::packed::PAIR, liteinfer::packed::TileOutputs, liteinfer::packed::TileRange,
    liteinfer::packed::TileSums, liteinfer::packed::tile_fn;

// From 2 to PASS_TILES tiles of rows (9 to 64 rows) a group is taken PASS_STEPS steps at a time, each pass through
// every tile before the next: the pass's W (64 steps x three blocks x 64 bytes: 12 KB) comes from DRAM once and from
// L1 for the tiles after the first, while the next pass's lines are requested into L2, a line a step of each tile.
// Each tile taking the whole group instead (re-reading it from L2, the thread's next group requested meanwhile), W's
// stream and the arithmetic hardly overlapped: on the Intel Xeon SmolLM2's fp32 linears took 0.77x that time at 16
// rows and 0.88x at 32 in passes (docs/benchmarks.md). Past 64 rows a pass's W, x (64 steps of every row) and the
// tiles' running sums outgrow L1's 48 KB, and passes lost 4-5% at 128 and 512 rows; a lone tile has nothing to share.
// bf16 takes these tiles only on CPUs without AMX (such as AMD's Zen 4 and 5), and there each tile takes the whole
// group: on the AMD Zen 4 (32 KB of L1) SmolLM2's bf16 linears took 0.85-0.87x the time of passes at 16 rows and
// 0.97-0.98x at 24 to 64 (docs/benchmarks.md), the passes' sums stored and reloaded every 64 steps (a tile over 64
// steps in L1 ran ~11% below one over 288).
constexpr int64_t PASS_STEPS = 64, PASS_TILES = 8;

// Whether `rows` rows (one M block) of T take each group in passes: fp32 at 2 to PASS_TILES tiles of rows.
template <typename T>
constexpr bool in_passes(int64_t rows) {
  const int64_t tiles = (rows + ROWS - 1) / ROWS;
  return std::is_same_v<T, float> && tiles > 1 && tiles <= PASS_TILES;
}

// y[rows, 16 * nb outputs] = x[rows] . the group of nb blocks at `w` (+ b), in passes as above or each tile over
// every step; `next` is the group the thread reads after this one (nullptr: none), whose first lines are requested
// by the last pass; `stream`: the outputs by streaming stores. A row's sums are the same operations in the same order
// either way (tile_steps).
template <typename T>
void group_in_passes(const T* x, int64_t k, const T* w, int64_t nb, const T* next, int64_t rows, const T* bias, T* y,
                     int64_t n, TileSums* sums, bool stream) {
  const int64_t steps = k / PAIR<T>, step_size = nb * 16 * PAIR<T>, num_tiles = (rows + ROWS - 1) / ROWS;
  const int64_t pass_steps = in_passes<T>(rows) ? PASS_STEPS : steps;
  // In one pass a tile is done before the next starts, so one set of sums serves every tile (and stays in L1).
  const bool one_pass = pass_steps >= steps;
  for (int64_t s0 = 0; s0 < steps; s0 += pass_steps) {
    const int64_t s1 = std::min(steps, s0 + pass_steps);
    // A step is nb lines; the group after this one has at most nb blocks.
    const T* ahead = s1 < steps ? w + s1 * step_size : next;
    const int64_t ahead_lines = ahead ? std::min(pass_steps, s1 < steps ? steps - s1 : steps) * nb : 0;
    for (int64_t t = 0; t < num_tiles; ++t) {
      const int64_t asked = t * (s1 - s0);  // the lines the tiles before this one asked for
      const int64_t tile_rows = std::min<int64_t>(ROWS, rows - t * ROWS);
      const Prefetch prefetch = asked < ahead_lines
                                    ? Prefetch{reinterpret_cast<const char*>(ahead) + asked * LINE, ahead_lines - asked}
                                    : Prefetch{nullptr, 0};
      TileSums& tile_sums = sums[one_pass ? 0 : t];
      tile_fn<TileRange, T>(nb, tile_rows)(x + t * ROWS * k, k, w, s0, s1, tile_sums, prefetch);
      if (s1 == steps) tile_fn<TileOutputs, T>(nb, tile_rows)(tile_sums, bias, y + t * ROWS * n, n, stream);
    }
  }
}
#endif

template <typename T>
void packed_linear_rows(const T* x, const T* w, const T* bias, T* y, int64_t m, int64_t k, const Outputs& outputs) {
  const int64_t block_size = k * 16, blocks = outputs.half_blocks;  // elements per block; blocks of W or of a half
  const int64_t groups = (blocks + BLOCKS - 1) / BLOCKS;
#if defined(LITEINFER_PACKED_AVX512)
  // Calls taken in passes (2 to PASS_TILES tiles of rows) write fp32 outputs by streaming stores. A plain store to a
  // line that is not in the cache reads it from memory first, and y's lines (memory the allocator hands back, long
  // pushed out of the caches by W's stream) came from DRAM that way, in bursts at each group's end, stalling W's own
  // stream: on the Intel Xeon SmolLM2's fp32 linears took 0.90-0.95x the time at 16 to 64 rows streamed, and a
  // decode step of 32 sequences ~0.97x, the ops after each linear now reading y from memory (docs/benchmarks.md). One
  // row keeps y in the cache for them; past 64 rows streaming took 0-3% off the linears alone.
  const bool stream = in_passes<T>(m) &&
                      reinterpret_cast<uintptr_t>(y) % LINE == 0;  // (each group's row of y then starts a line)
#endif
  // A thread's rows an M block at a time, each block over the thread's groups: one stream through its part of W.
  share_out(m, groups, ROWS, [&](const Share& share) {
    alignas(64) T scratch[M_BLOCK * 2 * GROUP_OUTPUTS];
    const int64_t begin = share.group_begin, end = share.group_end;
    for (int64_t m0 = share.row_begin; m0 < share.row_end; m0 += M_BLOCK) {
      const int64_t m_end = std::min(share.row_end, m0 + M_BLOCK);
#if defined(LITEINFER_PACKED_AVX512)
      TileSums sums[PASS_TILES];
      for (int64_t g = begin; g < end; ++g) {
        const int64_t b0 = g * BLOCKS, nb = std::min(BLOCKS, blocks - b0);
        group_outputs(outputs, b0, nb, m_end - m0, y + m0 * outputs.n_out, scratch, [&](int64_t first, T* out,
                                                                                          int64_t stride) {
          // The thread reads gate's half of a group, then up's, then the next group's gate (gated); or the groups
          // in order.
          const int64_t after = outputs.act != Act::kNone && first < blocks ? first + blocks
                                : g + 1 < end                               ? b0 + nb
                                                                            : -1;
          group_in_passes(x + m0 * k, k, w + first * block_size, nb, after >= 0 ? w + after * block_size : nullptr,
                          m_end - m0, bias ? bias + first * 16 : nullptr, out, stride, sums,
                          stream && outputs.act == Act::kNone);  // (gated, out is the scratch rows)
        }, stream);
      }
      if (stream) _mm_sfence();  // the streamed outputs written before the call returns
#else  // LITEINFER_PACKED_AVX2
      const int64_t lines_per_block = block_size * static_cast<int64_t>(sizeof(T)) / LINE;
      const int64_t num_tiles = (m_end - m0 + ROWS - 1) / ROWS;
      int64_t g = begin;
      // One row: the share's whole groups cut into GROUPS equal parts, read side by side (a stream each,
      // packed_tile.h: row_of_groups), then the groups a cut leaves over as below.
      if (m == 1 && outputs.act == Act::kNone) {
        using liteinfer::packed::GROUPS;
        const int64_t whole = blocks / BLOCKS, part = std::max<int64_t>(0, std::min(end, whole) - begin) / GROUPS;
        for (; g < begin + part; ++g) {
          std::array<const T*, GROUPS> ws, bs;
          std::array<T*, GROUPS> ys;
          for (int j = 0; j < GROUPS; ++j) {
            const int64_t group = g + j * part;
            ws[j] = w + group * BLOCKS * block_size;
            bs[j] = bias ? bias + group * BLOCKS * 16 : nullptr;
            ys[j] = y + group * BLOCKS * 16;
          }
          liteinfer::packed::row_of_groups(x, k, ws, bs, ys);
        }
        g = begin + GROUPS * part;
      }
      for (; g < end; ++g) {
        const int64_t b0 = g * BLOCKS, nb = std::min(BLOCKS, blocks - b0);
        // The thread's next group (gated: in the same half), a line per step of every tile but the last, tile t
        // from the t-th block's worth on: from four tiles (32 rows) up that covers the whole group. A lone tile asks
        // for the whole group (a block's worth in each of its blocks' passes, packed_tile.h).
        const int64_t next_lines = g + 1 < end ? std::min(BLOCKS, blocks - b0 - nb) * lines_per_block : 0;
        for (int64_t t = 0; t < num_tiles; ++t) {
          const int64_t r0 = m0 + t * ROWS, line = t * lines_per_block, rows = std::min<int64_t>(ROWS, m_end - r0);
          const bool last = num_tiles > 1 && t == num_tiles - 1;
          group_outputs(outputs, b0, nb, rows, y + r0 * outputs.n_out, scratch, [&](int64_t first, T* out,
                                                                                    int64_t stride) {
            const T* group = w + first * block_size;
            const Prefetch prefetch{reinterpret_cast<const char*>(group + nb * block_size) + line * LINE,
                                    last ? 0 : std::max<int64_t>(0, next_lines - line)};
            tile_for<T>(nb, rows)(x + r0 * k, k, group, bias ? bias + first * 16 : nullptr, out, stride, prefetch);
          });
        }
      }
#endif
    }
  });
}

bool packed_linear_takes(at::ScalarType dtype) {
  return dtype == at::kBFloat16 || (FLOAT_TILES && dtype == at::kFloat);
}

// Whether bf16 takes the AMX tiles here (built for them, and the kernel grants their state).
bool packed_linear_amx() {
#if defined(LITEINFER_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

// y [rows, n_out] from x [rows, in] and W's `n` outputs packed (`act`: plain, or in halves, n_out = n / 2).
at::Tensor multiply(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, int64_t n,
                    Act act) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "the weight must be contiguous, in x's dtype");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == x.scalar_type()),
              "the bias must be [out], in x's dtype");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k > 0, "x must have at least one input");  // (AMX's chunk of W would divide by its zero size)
  const Outputs outputs(act, n);
  const at::Tensor x_ = x.contiguous(), b = bias ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({m, outputs.n_out}, x.options());
#if defined(LITEINFER_AMX)
  if (x.scalar_type() == at::kBFloat16 && k % AMX_INPUTS == 0 && amx_permitted()) {
    amx_rows(x_.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
             b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(), m, k, outputs);
    return y;
  }
#endif
  auto run = [&](auto type) {
    using T = decltype(type);
    packed_linear_rows<T>(x_.data_ptr<T>(), weight.data_ptr<T>(), b.defined() ? b.data_ptr<T>() : nullptr,
                          y.data_ptr<T>(), m, k, outputs);
  };
#if defined(LITEINFER_PACKED_AVX512)
  x.scalar_type() == at::kBFloat16 ? run(c10::BFloat16{}) : run(float{});
#else
  run(c10::BFloat16{});
#endif
  return y;
}

void check_dtype(const at::Tensor& x, const char* op) {
  TORCH_CHECK(packed_linear_takes(x.scalar_type()), op, " takes ",
              packed_linear_takes(at::kFloat) ? "fp32 or bf16" : "bf16 (fp32 stays oneDNN's on this CPU)", " x");
}

int64_t pair_of(const at::Tensor& x) { return x.scalar_type() == at::kBFloat16 ? 2 : 1; }

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_dtype(x, "packed_linear");
  const int64_t pair = pair_of(x);
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 4 && weight.size(2) == 16 && weight.size(3) == pair &&
                  weight.size(1) * pair == x.size(1),
              "expected x [rows, in] and weight [out / 16, in / pair, 16, pair] (pair: 2 for bf16, 1 for fp32)");
  return multiply(x, weight, bias, weight.size(0) * 16, Act::kNone);
}

at::Tensor packed_gated_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                               c10::string_view act) {
  check_dtype(x, "packed_gated_linear");
  TORCH_CHECK(act == "silu" || act == "gelu_tanh", "packed_gated_linear takes silu or gelu_tanh, not ", act);
  const int64_t pair = pair_of(x);
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 5 && weight.size(0) == 2 && weight.size(3) == 16 &&
                  weight.size(4) == pair && weight.size(2) * pair == x.size(1),
              "expected x [rows, in] and weight [2, size / 16, in / pair, 16, pair] (gate's half, then up's; pair: 2 "
              "for bf16, 1 for fp32)");
  return multiply(x, weight, bias, weight.size(1) * 32, act == "silu" ? Act::kSilu : Act::kGeluTanh);
}

// W's given output rows, packed as pack_weight packs them alone (zero rows after them up to a multiple of 16): each
// (row, step) four bytes (a bf16 pair or an fp32), copied from where its group keeps it. The greedy head
// (layers/greedy_head.py) multiplies its candidates' rows this way, each getting its bits in the full product.
at::Tensor packed_rows(const at::Tensor& weight, const at::Tensor& rows) {
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == 16 && weight.element_size() * weight.size(3) == 4 &&
                  weight.is_contiguous(), "expected weight [out / 16, in / pair, 16, pair] (bf16 pairs or fp32)");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), "expected rows [n] int64");
  const int64_t steps = weight.size(1), out = weight.size(0) * 16, n = rows.numel(), padded = (n + 15) / 16 * 16;
  at::Tensor result = at::zeros({padded / 16, steps, 16, weight.size(3)}, weight.options());
  const uint32_t* from = static_cast<const uint32_t*>(weight.data_ptr());
  uint32_t* to = static_cast<uint32_t*>(result.data_ptr());
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(0 <= row[i] && row[i] < out, "row ", row[i], " out of range");
  // A row's runs lie a group's width apart, each in a cache line of its own: the copy waits on memory, not on
  // arithmetic, so both threads take rows.
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      // A group's runs: step by step, each step its rows side by side (the last group one or two blocks).
      const int64_t group = row[i] - row[i] % GROUP_OUTPUTS, group_size = std::min(GROUP_OUTPUTS, out - group);
      const int64_t new_group = i - i % GROUP_OUTPUTS, new_size = std::min(GROUP_OUTPUTS, padded - new_group);
      const uint32_t* source = from + group * steps + row[i] - group;
      uint32_t* target = to + new_group * steps + i - new_group;
      for (int64_t step = 0; step < steps; ++step) target[step * new_size] = source[step * group_size];
    }
  });
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(liteinfer, m) {
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("packed_rows(Tensor weight, Tensor rows) -> Tensor");
  m.def("packed_gated_linear(Tensor x, Tensor weight, Tensor? bias, str act) -> Tensor");
  m.def("packed_linear_takes(ScalarType dtype) -> bool", &packed_linear_takes);  // no tensor: no dispatch key
  m.def("packed_linear_amx() -> bool", &packed_linear_amx);
}

TORCH_LIBRARY_IMPL(liteinfer, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_gated_linear", &packed_gated_linear);
  m.impl("packed_rows", &packed_rows);
}
#endif
