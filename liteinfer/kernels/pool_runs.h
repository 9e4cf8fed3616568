// Where the K/V pools keep each (block, KV head)'s rows, shared by the K/V writes (pointwise.cpp) and both attention
// kernels (paged_attention.cpp). A pool is indexed [blocks, kv_heads, ...] (the rest one block's rows for one head,
// contiguous: a run), and its runs lie block-major (a contiguous tensor) or head-major (a view, permuted to that
// indexing, of a contiguous [kv_heads, blocks, ...] tensor: cache/kv_cache.py lays CPU pools out so).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace liteinfer {

// Run (block, head) is run number block * block_step + head * head_step of the pool.
struct PoolRuns {
  int64_t block_step, head_step;

  // A pool's runs, checked: each run contiguous, the runs laid out block-major or head-major.
  static PoolRuns of(const at::Tensor& pool) {
    TORCH_CHECK(pool.dim() >= 3, "expected a pool [blocks, kv_heads, ...]");
    int64_t run = 1;
    for (int64_t d = pool.dim() - 1; d >= 2; --d) {
      TORCH_CHECK(pool.stride(d) == run, "each block's rows for one KV head must be contiguous in the pool");
      run *= pool.size(d);
    }
    const int64_t blocks = pool.size(0), heads = pool.size(1);
    const PoolRuns runs{pool.stride(0) / run, pool.stride(1) / run};
    const bool block_major = (blocks == 1 || pool.stride(0) == heads * run) && (heads == 1 || pool.stride(1) == run);
    const bool head_major = (blocks == 1 || pool.stride(0) == run) && (heads == 1 || pool.stride(1) == blocks * run);
    TORCH_CHECK(block_major || head_major, "a pool's runs must lie block-major ([blocks, kv_heads, ...] contiguous) "
                "or head-major (a [kv_heads, blocks, ...] tensor, permuted)");
    return runs;
  }

  // The first element of run (block, head), in a pool whose runs hold `run` elements each.
  int64_t start(int64_t block, int64_t head, int64_t run) const {
    return (block * block_step + head * head_step) * run;
  }

  bool operator==(const PoolRuns& other) const {
    return block_step == other.block_step && head_step == other.head_step;
  }
};

}  // namespace liteinfer
