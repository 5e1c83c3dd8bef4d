// The cache ops' argument contracts, checked first by their CPU and CUDA
// implementations (and the KV cache layouts the attention ops check too). Structure
// only: the values of index tensors are pyllm/ops.py's to check.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../attention/sizes.h"
#include "../check_utils.h"
#include "../ops.h"

namespace pyllm {

inline void check_head_size(int64_t head_size) {
  TORCH_CHECK_VALUE(is_listed(kHeadSizes, head_size), "head_size ", head_size,
                    " is not supported; supported: (", list_text(kHeadSizes), ")");
}

inline void check_block_size(int64_t block_size) {
  TORCH_CHECK_VALUE(is_listed(kBlockSizes, block_size), "block_size ", block_size,
                    " is not supported; supported: (", list_text(kBlockSizes), ")");
}

// key and value [num_tokens, num_kv_heads, head_size]: token stride free, each
// token's heads packed (row views of a fused projection).
inline void check_token_rows(const at::Tensor& key, const at::Tensor& value) {
  check_float_dtype("key", key);
  check_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_size]");
  check_like("value", value, key);
  check_shape("value", value, key.sizes(), "(same as key)");
  check_packed_rows("key", key);
  check_packed_rows("value", value);
}

// key_cache's shape as value_cache's implies (the message is built only on failure).
inline void check_key_cache_shape(std::string_view name, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, at::ScalarType dtype,
                                  at::IntArrayRef shape) {
  TORCH_CHECK_VALUE(key_cache.sizes() == shape, name, " must have shape ", shape_text(shape),
                    " (x = ", kv_cache_x(dtype), " for ", dtype_name(dtype),
                    ", matching value_cache ", shape_text(value_cache.sizes()), "), got ",
                    shape_text(key_cache.sizes()));
}

// The KV cache's element type: the model's dtype, or int8 (a quantized cache whose
// float16 scales, one per token and kv head for keys and one for values, come as
// k_scale / v_scale; x = 16 then).
inline at::ScalarType kv_element_dtype(const at::Tensor& key_cache, at::ScalarType model_dtype) {
  return key_cache.scalar_type() == at::kChar ? at::kChar : model_dtype;
}

// An int8 cache's largest scale: float16's largest finite value (a row whose absmax / 127
// is beyond it saturates at +-127 instead of storing inf).
inline constexpr float kMaxKVScale = 65504.0f;

// An int8 cache's scales: float16 of shape (the cache's shape without head_size),
// contiguous, on device. A float cache takes none.
inline void check_kv_scales(const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale, const at::Tensor& key_cache,
                            at::IntArrayRef shape, std::string_view layout,
                            const at::Device& device) {
  const bool quantized = key_cache.scalar_type() == at::kChar;
  for (const auto& [name, t] : {std::pair<const char*, const std::optional<at::Tensor>*>{
                                    "k_scale", &k_scale},
                                {"v_scale", &v_scale}}) {
    if (!quantized) {
      TORCH_CHECK_VALUE(!t->has_value(), name, " is only for an int8 KV cache, but key_cache has ",
                        dtype_name(key_cache.scalar_type()));
      continue;
    }
    TORCH_CHECK_VALUE(t->has_value(), "an int8 KV cache needs ", name, " (float16 ", layout, ")");
    check_device(name, **t, device);
    check_dtype(name, **t, at::kHalf);
    check_shape(name, **t, shape, layout);
    check_contiguous(name, **t);
  }
}

struct PagedKVShape {
  int64_t num_blocks, num_kv_heads, head_size, block_size;
};

// key_cache [num_blocks, num_kv_heads, head_size / x, block_size, x], value_cache
// [num_blocks, num_kv_heads, head_size, block_size], contiguous, of dtype and device.
inline PagedKVShape check_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   at::ScalarType dtype, const at::Device& device,
                                   std::string_view key_name = "key_cache",
                                   std::string_view value_name = "value_cache") {
  check_device(key_name, key_cache, device);
  check_device(value_name, value_cache, device);
  check_same_dtype(key_name, key_cache, dtype);
  check_same_dtype(value_name, value_cache, dtype);
  check_ndim(key_name, key_cache, 5, "[num_blocks, num_kv_heads, head_size // x, block_size, x]");
  check_ndim(value_name, value_cache, 4, "[num_blocks, num_kv_heads, head_size, block_size]");
  check_contiguous(key_name, key_cache);
  check_contiguous(value_name, value_cache);
  const PagedKVShape s{value_cache.size(0), value_cache.size(1), value_cache.size(2),
                       value_cache.size(3)};
  const int64_t x = kv_cache_x(dtype);
  check_key_cache_shape(key_name, key_cache, value_cache, dtype,
                        {s.num_blocks, s.num_kv_heads, s.head_size / x, s.block_size, x});
  check_head_size(s.head_size);
  check_block_size(s.block_size);
  return s;
}

struct ContiguousKVShape {
  int64_t num_slots, num_kv_heads, num_tiles, head_size;
};

// The contiguous views (ops.h): key_cache [max_num_seqs, num_kv_heads, num_tiles,
// head_size / x, kTokenTile, x], value_cache [max_num_seqs, num_kv_heads, num_tiles,
// head_size, kTokenTile], dense inside a tile, with the same non-negative outer
// strides (the kernels address one tile of either with one offset).
inline ContiguousKVShape check_contiguous_kv_cache(const at::Tensor& key_cache,
                                                   const at::Tensor& value_cache,
                                                   at::ScalarType dtype,
                                                   const at::Device& device) {
  check_device("key_cache", key_cache, device);
  check_device("value_cache", value_cache, device);
  check_same_dtype("key_cache", key_cache, dtype);
  check_same_dtype("value_cache", value_cache, dtype);
  check_ndim("key_cache", key_cache, 6,
             "[max_num_seqs, num_kv_heads, num_tiles, head_size // x, TOKEN_TILE, x]");
  check_ndim("value_cache", value_cache, 5,
             "[max_num_seqs, num_kv_heads, num_tiles, head_size, TOKEN_TILE]");
  TORCH_CHECK_VALUE(value_cache.size(4) == kTokenTile,
                    "value_cache's last dimension must be TOKEN_TILE = ", kTokenTile);
  const ContiguousKVShape s{value_cache.size(0), value_cache.size(1), value_cache.size(2),
                            value_cache.size(3)};
  const int64_t x = kv_cache_x(dtype);
  check_key_cache_shape("key_cache", key_cache, value_cache, dtype,
                        {s.num_slots, s.num_kv_heads, s.num_tiles, s.head_size / x, kTokenTile, x});
  check_head_size(s.head_size);
  TORCH_CHECK_VALUE(key_cache.stride(3) == kTokenTile * x && key_cache.stride(4) == x &&
                        key_cache.stride(5) == 1 && value_cache.stride(3) == kTokenTile &&
                        value_cache.stride(4) == 1,
                    "key_cache and value_cache must be dense inside each tile, got strides ",
                    shape_text(key_cache.strides()), " and ", shape_text(value_cache.strides()));
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK_VALUE(key_cache.stride(d) == value_cache.stride(d) && key_cache.stride(d) >= 0,
                      "key_cache and value_cache must share their (slot, kv head, tile) "
                      "strides, got ",
                      shape_text(key_cache.strides()), " and ", shape_text(value_cache.strides()));
  }
  return s;
}

inline void check_paged_kv_scales(const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale,
                                  const at::Tensor& key_cache, const PagedKVShape& s,
                                  const at::Device& device) {
  check_kv_scales(k_scale, v_scale, key_cache, {s.num_blocks, s.num_kv_heads, s.block_size},
                  "[num_blocks, num_kv_heads, block_size]", device);
}

inline void check_contiguous_kv_scales(const std::optional<at::Tensor>& k_scale,
                                       const std::optional<at::Tensor>& v_scale,
                                       const at::Tensor& key_cache, const ContiguousKVShape& s,
                                       const at::Device& device) {
  check_kv_scales(k_scale, v_scale, key_cache, {s.num_slots, s.num_kv_heads, s.num_tiles, kTokenTile},
                  "[max_num_seqs, num_kv_heads, num_tiles, TOKEN_TILE]", device);
}

// The key rows' [num_kv_heads, head_size] against the cache's.
inline void check_key_heads(const at::Tensor& key, int64_t num_kv_heads, int64_t head_size) {
  TORCH_CHECK_VALUE(key.size(1) == num_kv_heads && key.size(2) == head_size, "key has (",
                    key.size(1), ", ", key.size(2),
                    ") [num_kv_heads, head_size] per token but the cache holds (", num_kv_heads,
                    ", ", head_size, ")");
}

// An index tensor [num_tokens] of dtype, contiguous, on device.
inline void check_index(std::string_view name, const at::Tensor& t, at::ScalarType dtype,
                        int64_t length, std::string_view layout, const at::Device& device) {
  check_device(name, t, device);
  check_dtype(name, t, dtype);
  check_shape(name, t, {length}, layout);
  check_contiguous(name, t);
}

inline PagedKVShape check_reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                                            const at::Tensor& key_cache,
                                            const at::Tensor& value_cache,
                                            const at::Tensor& slot_mapping,
                                            const std::string& kv_cache_dtype,
                                            const std::optional<at::Tensor>& k_scale,
                                            const std::optional<at::Tensor>& v_scale) {
  check_token_rows(key, value);
  TORCH_CHECK_VALUE(kv_cache_dtype == "auto" || kv_cache_dtype == "int8", "kv_cache_dtype '",
                    kv_cache_dtype, "' is not supported; choices: 'auto' (the model's dtype), 'int8'");
  const at::ScalarType dtype = kv_cache_dtype == "int8" ? at::kChar : key.scalar_type();
  const PagedKVShape s = check_kv_cache(key_cache, value_cache, dtype, key.device());
  check_paged_kv_scales(k_scale, v_scale, key_cache, s, key.device());
  check_key_heads(key, s.num_kv_heads, s.head_size);
  check_index("slot_mapping", slot_mapping, at::kLong, key.size(0), "[num_tokens]", key.device());
  return s;
}

inline ContiguousKVShape check_write_kv_contiguous(const at::Tensor& key, const at::Tensor& value,
                                                   const at::Tensor& key_cache,
                                                   const at::Tensor& value_cache,
                                                   const at::Tensor& token_slots,
                                                   const at::Tensor& positions,
                                                   const std::optional<at::Tensor>& k_scale,
                                                   const std::optional<at::Tensor>& v_scale) {
  check_token_rows(key, value);
  const ContiguousKVShape s = check_contiguous_kv_cache(
      key_cache, value_cache, kv_element_dtype(key_cache, key.scalar_type()), key.device());
  check_contiguous_kv_scales(k_scale, v_scale, key_cache, s, key.device());
  check_key_heads(key, s.num_kv_heads, s.head_size);
  check_index("token_slots", token_slots, at::kLong, key.size(0), "[num_tokens]", key.device());
  check_index("positions", positions, at::kLong, key.size(0), "[num_tokens]", key.device());
  return s;
}

// [num_pairs, 2] int64 rows of (src, dst) block numbers, on the CPU.
inline void check_block_mapping(const at::Tensor& block_mapping) {
  TORCH_CHECK_VALUE(block_mapping.device().is_cpu(), "block_mapping must be a CPU tensor, got ",
                    block_mapping.device());
  check_dtype("block_mapping", block_mapping, at::kLong);
  check_ndim("block_mapping", block_mapping, 2, "[num_pairs, 2] of (src, dst) block numbers");
  TORCH_CHECK_VALUE(block_mapping.size(1) == 2,
                    "block_mapping must have shape [num_pairs, 2], got ",
                    shape_text(block_mapping.sizes()));
  check_contiguous("block_mapping", block_mapping);
}

// Every layer's pair of caches alike: layer 0's dtype, device and shape.
inline void check_copy_blocks(const std::vector<at::Tensor>& key_caches,
                              const std::vector<at::Tensor>& value_caches,
                              const at::Tensor& block_mapping) {
  TORCH_CHECK_VALUE(key_caches.size() == value_caches.size(), "key_caches has ",
                    key_caches.size(), " layers but value_caches has ", value_caches.size());
  TORCH_CHECK_VALUE(!key_caches.empty(), "key_caches must hold at least one layer");
  const at::Tensor& first = key_caches[0];
  if (first.scalar_type() != at::kChar) check_float_dtype("key_caches[0]", first);
  for (size_t i = 0; i < key_caches.size(); ++i) {
    const PagedKVShape s =
        check_kv_cache(key_caches[i], value_caches[i], first.scalar_type(), first.device(),
                       c10::str("layer ", i, ": key_cache"), c10::str("layer ", i, ": value_cache"));
    TORCH_CHECK_VALUE(key_caches[i].sizes() == first.sizes() && s.num_blocks == first.size(0),
                      "layer ", i, "'s cache shape differs from layer 0's");
  }
  check_block_mapping(block_mapping);
}

// src and dst: one key or value cache each, alike but for the number of blocks, on
// the same or different devices.
inline void check_swap_blocks(const at::Tensor& src, const at::Tensor& dst,
                              const at::Tensor& block_mapping) {
  if (src.scalar_type() != at::kChar) check_float_dtype("src", src);  // int8: a quantized cache
  check_same_dtype("dst", dst, src.scalar_type());
  check_contiguous("src", src);
  check_contiguous("dst", dst);
  TORCH_CHECK_VALUE(src.dim() >= 2 && dst.dim() == src.dim() &&
                        src.sizes().slice(1) == dst.sizes().slice(1),
                    "src ",
                    shape_text(src.sizes()), " and dst ", shape_text(dst.sizes()),
                    " must have the same block shape");
  check_block_mapping(block_mapping);
}

}  // namespace pyllm
