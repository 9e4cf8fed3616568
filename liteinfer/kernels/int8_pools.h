// The int8 K/V pools' layout (kv_cache_dtype="int8"; kernels/__init__.py gives the contract), shared by the K/V
// write (pointwise.cpp) and both attention kernels (paged_attention.cpp): K uint8 (k + 128) [blocks, kv_heads,
// dim / 4, block_size, 4] (four elements of a key side by side, the block's keys after each other: 16 keys' products
// with four query elements are one vpdpbusd, a key's score one lane), V int8 [blocks, kv_heads, block_size / 4, dim,
// 4] (four keys' elements side by side, as vpdpbusd multiplies four bytes a lane), each row's scale fp32 [blocks,
// kv_heads, block_size]; all four with their runs laid out alike (pool_runs.h).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "pool_runs.h"

namespace liteinfer {

// Where element d of key row r lies among its block's K bytes for one KV head.
inline int64_t k_byte(int64_t r, int64_t d, int64_t block_size) { return (d / 4 * block_size + r) * 4 + d % 4; }

// Where element d of value row r lies among its block's V bytes for one KV head.
inline int64_t v_byte(int64_t r, int64_t d, int64_t dim) { return (r / 4 * dim + d) * 4 + r % 4; }

// The pools' block size and head size, checked against the layout above.
struct Int8Pools {
  int64_t block_size, dim;
};

inline Int8Pools check_int8_pools(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_scales,
                                  const at::Tensor& v_scales) {
  TORCH_CHECK(k_cache.scalar_type() == at::kByte && v_cache.scalar_type() == at::kChar,
              "int8 pools (scales given) hold K as uint8 and V as int8");
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(4) == 4,
              "an int8 K pool is [blocks, kv_heads, dim / 4, block_size, 4]");
  const int64_t block_size = k_cache.size(3), dim = k_cache.size(2) * 4;
  TORCH_CHECK(block_size % 4 == 0 && v_cache.sizes() == at::IntArrayRef({k_cache.size(0), k_cache.size(1),
                                                                         block_size / 4, dim, 4}),
              "an int8 V pool is [blocks, kv_heads, block_size / 4, dim, 4]");
  for (const at::Tensor* s : {&k_scales, &v_scales})
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->sizes() == at::IntArrayRef({k_cache.size(0), k_cache.size(1),
                                                                                  block_size}),
                "the pools' scales must be fp32 [blocks, kv_heads, block_size]");
  const PoolRuns runs = PoolRuns::of(k_cache);
  for (const at::Tensor* pool : {&v_cache, &k_scales, &v_scales})
    TORCH_CHECK(PoolRuns::of(*pool) == runs, "the int8 pools' and their scales' runs must lie alike (pool_runs.h)");
  return {block_size, dim};
}

}  // namespace liteinfer
