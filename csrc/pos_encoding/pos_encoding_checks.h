// rotary_embedding's argument contract, checked first by its CPU and CUDA
// implementations. Structure only: pyllm/ops.py checks the positions' values.
#pragma once

#include <cstdint>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../check_utils.h"

namespace pyllm {

// query or key: [num_tokens, num_heads * head_size] or [num_tokens, num_heads,
// head_size], each token's heads packed (the token stride is free). Returns its
// number of heads.
inline int64_t check_rotary_heads(std::string_view name, const at::Tensor& t, int64_t num_tokens,
                                  int64_t head_size) {
  TORCH_CHECK_VALUE((t.dim() == 2 || t.dim() == 3) && t.size(0) == num_tokens, name,
                    " must be [num_tokens=", num_tokens,
                    ", num_heads * head_size] or [num_tokens, num_heads, head_size], got ",
                    shape_text(t.sizes()));
  TORCH_CHECK_VALUE(t.dim() == 2 || t.size(2) == head_size, name, "'s last dimension ",
                    t.size(-1), " is not head_size ", head_size);
  const int64_t width = t.dim() == 2 ? t.size(1) : t.size(1) * t.size(2);
  TORCH_CHECK_VALUE(width % head_size == 0, name, "'s width ", width,
                    " is not a multiple of head_size ", head_size);
  check_packed_rows(name, t);
  return width / head_size;
}

struct RotaryShape {
  int64_t num_tokens, num_heads, num_kv_heads, rot_dim;
};

inline RotaryShape check_rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                          const at::Tensor& key, int64_t head_size,
                                          const at::Tensor& cos_sin_cache) {
  check_float_dtype("query", query);
  check_device("key", key, query.device());
  check_device("positions", positions, query.device());
  check_device("cos_sin_cache", cos_sin_cache, query.device());
  check_same_dtype("key", key, query.scalar_type());
  check_dtype("positions", positions, at::kLong);
  check_ndim("positions", positions, 1, "[num_tokens]");
  TORCH_CHECK_VALUE(head_size > 0, "head_size must be a positive int, got ", head_size);
  const int64_t num_tokens = positions.size(0);
  const int64_t num_heads = check_rotary_heads("query", query, num_tokens, head_size);
  const int64_t num_kv_heads = check_rotary_heads("key", key, num_tokens, head_size);
  check_ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, rot_dim]");
  check_contiguous("cos_sin_cache", cos_sin_cache);
  TORCH_CHECK_TYPE(cos_sin_cache.scalar_type() == query.scalar_type() ||
                       cos_sin_cache.scalar_type() == at::kFloat,
                   "cos_sin_cache has dtype ", dtype_name(cos_sin_cache.scalar_type()),
                   "; use the query's dtype or float32");
  const int64_t rot_dim = cos_sin_cache.size(1);
  TORCH_CHECK_VALUE(rot_dim >= 2 && rot_dim % 2 == 0 && rot_dim <= head_size,
                    "cos_sin_cache's rot_dim ", rot_dim, " must be even and <= head_size ",
                    head_size);
  return {num_tokens, num_heads, num_kv_heads, rot_dim};
}

}  // namespace pyllm
