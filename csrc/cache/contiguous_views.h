// The contiguous KV layout's views (ops.h), checked the same way by the CPU and CUDA
// attention and cache ops: key_cache [num_slots, num_kv_heads, num_tiles,
// head_size / x, kTokenTile, x] and value_cache [num_slots, num_kv_heads, num_tiles,
// head_size, kTokenTile], dense inside a tile, with free non-negative outer strides.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../ops.h"

namespace pyllm {

struct ContiguousViews {
  int64_t num_slots;
  int64_t num_tiles;
};

// x: elements per 16 bytes. Ops add their own stride rules (shared key/value strides,
// 16-byte multiples) after this.
inline ContiguousViews check_contiguous_views(const char* op, const at::Tensor& key_cache,
                                              const at::Tensor& value_cache,
                                              int64_t num_kv_heads, int64_t head_size,
                                              int64_t x) {
  TORCH_CHECK(value_cache.dim() == 5 && value_cache.size(1) == num_kv_heads &&
                  value_cache.size(3) == head_size && value_cache.size(4) == kTokenTile,
              op, ": value_cache must be [max_num_seqs, ", num_kv_heads, ", num_tiles, ",
              head_size, ", ", kTokenTile, "], got ", value_cache.sizes());
  const int64_t num_slots = value_cache.size(0);
  const int64_t num_tiles = value_cache.size(2);
  TORCH_CHECK(key_cache.dim() == 6 && key_cache.size(0) == num_slots &&
                  key_cache.size(1) == num_kv_heads && key_cache.size(2) == num_tiles &&
                  key_cache.size(3) * x == head_size && key_cache.size(4) == kTokenTile &&
                  key_cache.size(5) == x,
              op, ": key_cache must be [", num_slots, ", ", num_kv_heads, ", ", num_tiles, ", ",
              head_size / x, ", ", kTokenTile, ", ", x, "] to match value_cache, got ",
              key_cache.sizes());
  TORCH_CHECK(key_cache.stride(5) == 1 && key_cache.stride(4) == x &&
                  key_cache.stride(3) == kTokenTile * x && value_cache.stride(4) == 1 &&
                  value_cache.stride(3) == kTokenTile,
              op, ": each tile of key_cache and value_cache must be dense, got strides ",
              key_cache.strides(), " and ", value_cache.strides());
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(key_cache.stride(d) >= 0 && value_cache.stride(d) >= 0, op,
                ": negative key_cache/value_cache strides are not supported, got ",
                key_cache.strides(), " and ", value_cache.strides());
  }
  return {num_slots, num_tiles};
}

}  // namespace pyllm
