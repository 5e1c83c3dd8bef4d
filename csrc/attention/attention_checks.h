// The attention ops' argument contracts, paged and contiguous, checked first by their
// CPU and CUDA implementations. Structure only: pyllm/ops.py checks the values of
// seq_lens, block_tables, seq_slots and query_start_loc (reading them on CUDA would
// cost a device sync).
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../cache/cache_checks.h"
#include "../check_utils.h"
#include "../ops.h"
#include "sizes.h"

namespace pyllm {

struct AttentionDims {
  int64_t num_tokens, num_heads, head_size;
};

// out and query [num_tokens, num_heads, head_size]: query's heads packed (its token
// stride free), out contiguous; num_kv_heads divides num_heads.
inline AttentionDims check_attention_io(const at::Tensor& out, const at::Tensor& query,
                                        int64_t num_kv_heads) {
  check_float_dtype("query", query);
  check_ndim("query", query, 3, "[num_tokens, num_heads, head_size]");
  check_packed_rows("query", query);
  check_like("out", out, query);
  check_shape("out", out, query.sizes(), "(same as query)");
  check_contiguous("out", out);
  const AttentionDims d{query.size(0), query.size(1), query.size(2)};
  check_head_size(d.head_size);
  TORCH_CHECK_VALUE(num_kv_heads > 0, "num_kv_heads must be a positive int, got ", num_kv_heads);
  TORCH_CHECK_VALUE(d.num_heads % num_kv_heads == 0, "num_kv_heads (", num_kv_heads,
                    ") must divide the query's num_heads (", d.num_heads, ")");
  return d;
}

// The caller's num_kv_heads and the query's head size against the cache's.
inline void check_cache_heads(int64_t num_kv_heads, int64_t cache_kv_heads, int64_t head_size,
                              int64_t cache_head_size) {
  TORCH_CHECK_VALUE(cache_kv_heads == num_kv_heads, "num_kv_heads is ", num_kv_heads,
                    " but the cache holds ", cache_kv_heads, " kv heads");
  TORCH_CHECK_VALUE(cache_head_size == head_size, "query head_size ", head_size,
                    " does not match the cache's head_size ", cache_head_size);
}

inline void check_scale(double scale) {
  TORCH_CHECK_VALUE(std::isfinite(scale), "scale must be finite, got ", scale);
}

// 0: no window; otherwise a query attends to the last sliding_window positions.
inline void check_sliding_window(int64_t sliding_window) {
  TORCH_CHECK_VALUE(sliding_window >= 0 && sliding_window <= INT32_MAX,
                    "sliding_window must be 0 (none) or a positive int32, got ", sliding_window);
}

// A float32 [num_heads] tensor of per-head values (alibi_slopes, sinks).
inline void check_head_values(const char* name, const std::optional<at::Tensor>& t,
                              int64_t num_heads, const at::Device& device) {
  if (!t.has_value()) return;
  check_device(name, *t, device);
  check_dtype(name, *t, at::kFloat);
  check_shape(name, *t, {num_heads}, "[num_heads]");
  check_contiguous(name, *t);
}

// sinks: one logit per query head that joins each softmax with no value (gpt-oss),
// float32 [num_heads] on the query's device, or none.
inline void check_sinks(const std::optional<at::Tensor>& sinks, const at::Tensor& query) {
  check_head_values("sinks", sinks, query.size(1), query.device());
}

inline void check_positive(const char* name, int64_t value) {
  TORCH_CHECK_VALUE(value > 0, name, " must be a positive int, got ", value);
}

// Per-sequence int32 tensors [num_seqs] (seq_lens, seq_slots).
inline void check_seq_tensor(const char* name, const at::Tensor& t, int64_t num_seqs,
                             const at::Device& device) {
  check_index(name, t, at::kInt, num_seqs, "[num_seqs]", device);
}

// query_start_loc [num_seqs + 1] int32; returns num_seqs.
inline int64_t check_query_start_loc(const at::Tensor& query_start_loc, const at::Device& device) {
  check_device("query_start_loc", query_start_loc, device);
  check_dtype("query_start_loc", query_start_loc, at::kInt);
  check_ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]");
  check_contiguous("query_start_loc", query_start_loc);
  TORCH_CHECK_VALUE(query_start_loc.size(0) > 0,
                    "query_start_loc must hold num_seqs + 1 offsets, got an empty tensor");
  return query_start_loc.size(0) - 1;
}

// The paged ops' shared arguments: out, query, the cache pair, num_kv_heads,
// block_size, scale and alibi_slopes. Returns the cache's shape.
inline PagedKVShape check_paged_common(const AttentionDims& d, const at::Tensor& query,
                                       const at::Tensor& key_cache, const at::Tensor& value_cache,
                                       int64_t num_kv_heads, double scale, int64_t block_size,
                                       const std::optional<at::Tensor>& alibi_slopes) {
  const PagedKVShape cache = check_kv_cache(
      key_cache, value_cache, kv_element_dtype(key_cache, query.scalar_type()), query.device());
  check_cache_heads(num_kv_heads, cache.num_kv_heads, d.head_size, cache.head_size);
  check_block_size(block_size);
  TORCH_CHECK_VALUE(block_size == cache.block_size, "block_size is ", block_size,
                    " but the cache's blocks hold ", cache.block_size, " tokens");
  check_scale(scale);
  check_head_values("alibi_slopes", alibi_slopes, d.num_heads, query.device());
  return cache;
}

// block_tables [num_seqs, max_num_blocks_per_seq] and seq_lens [num_seqs], int32.
inline void check_block_tables_layout(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                      int64_t num_seqs, const at::Device& device) {
  check_device("block_tables", block_tables, device);
  check_device("seq_lens", seq_lens, device);
  check_dtype("block_tables", block_tables, at::kInt);
  check_dtype("seq_lens", seq_lens, at::kInt);
  check_ndim("block_tables", block_tables, 2, "[num_seqs, max_num_blocks_per_seq]");
  check_contiguous("block_tables", block_tables);
  check_contiguous("seq_lens", seq_lens);
  check_shape("seq_lens", seq_lens, {num_seqs}, "[num_seqs]");
  TORCH_CHECK_VALUE(block_tables.size(0) == num_seqs, "block_tables has ", block_tables.size(0),
                    " rows but there are ", num_seqs, " sequences");
}

inline PagedKVShape check_paged_attention_v1(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
    int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
    int64_t sliding_window, const std::optional<at::Tensor>& sinks) {
  const AttentionDims d = check_attention_io(out, query, num_kv_heads);
  const PagedKVShape cache = check_paged_common(d, query, key_cache, value_cache, num_kv_heads,
                                                scale, block_size, alibi_slopes);
  check_block_tables_layout(block_tables, seq_lens, d.num_tokens, query.device());
  check_positive("max_seq_len", max_seq_len);
  check_sliding_window(sliding_window);
  check_sinks(sinks, query);
  return cache;
}

// v2's workspace: exp_sums and max_logits [num_seqs, num_heads, >= num_partitions]
// float32, tmp_out [num_seqs, num_heads, >= num_partitions, head_size] in the query's
// dtype, contiguous.
inline void check_v2_workspace(const at::Tensor& exp_sums, const at::Tensor& max_logits,
                               const at::Tensor& tmp_out, const at::Tensor& query,
                               int64_t max_seq_len) {
  const int64_t partitions = (max_seq_len + kPartitionSize - 1) / kPartitionSize;
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const auto check = [&](const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t dim) {
    check_device(name, t, query.device());
    check_dtype(name, t, dtype);
    check_contiguous(name, t);
    const bool ok = t.dim() == dim && t.size(0) == num_seqs && t.size(1) == num_heads &&
                    t.size(2) >= partitions && (dim == 3 || t.size(3) == head_size);
    TORCH_CHECK_VALUE(ok, name, " must have shape (", num_seqs, ", ", num_heads, ", ",
                      partitions, dim == 4 ? c10::str(", ", head_size) : "",
                      ") (num_partitions = ceil(max_seq_len / ", kPartitionSize, ") = ",
                      partitions, "), got ", shape_text(t.sizes()));
  };
  check("exp_sums", exp_sums, at::kFloat, 3);
  check("max_logits", max_logits, at::kFloat, 3);
  check("tmp_out", tmp_out, query.scalar_type(), 4);
}

inline PagedKVShape check_paged_attention_v2(
    const at::Tensor& out, const at::Tensor& exp_sums, const at::Tensor& max_logits,
    const at::Tensor& tmp_out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
    int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
    int64_t sliding_window, const std::optional<at::Tensor>& sinks) {
  const PagedKVShape cache = check_paged_attention_v1(out, query, key_cache, value_cache,
                                                      num_kv_heads, scale, block_tables, seq_lens,
                                                      block_size, max_seq_len, alibi_slopes,
                                                      sliding_window, sinks);
  check_v2_workspace(exp_sums, max_logits, tmp_out, query, max_seq_len);
  return cache;
}

inline PagedKVShape check_paged_attention_prefill(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    int64_t block_size, int64_t max_query_len, const std::optional<at::Tensor>& alibi_slopes,
    int64_t sliding_window, const std::optional<at::Tensor>& sinks) {
  const AttentionDims d = check_attention_io(out, query, num_kv_heads);
  const PagedKVShape cache = check_paged_common(d, query, key_cache, value_cache, num_kv_heads,
                                                scale, block_size, alibi_slopes);
  const int64_t num_seqs = check_query_start_loc(query_start_loc, query.device());
  check_block_tables_layout(block_tables, seq_lens, num_seqs, query.device());
  check_positive("max_query_len", max_query_len);
  check_sliding_window(sliding_window);
  check_sinks(sinks, query);
  return cache;
}

// The contiguous ops' shared arguments; num_seqs < 0 means one sequence per query
// token (decode).
inline ContiguousKVShape check_contiguous_common(const at::Tensor& out, const at::Tensor& query,
                                                 const at::Tensor& key_cache,
                                                 const at::Tensor& value_cache,
                                                 int64_t num_kv_heads, double scale,
                                                 const at::Tensor& seq_slots,
                                                 const at::Tensor& seq_lens, int64_t num_seqs) {
  const AttentionDims d = check_attention_io(out, query, num_kv_heads);
  const ContiguousKVShape cache = check_contiguous_kv_cache(
      key_cache, value_cache, kv_element_dtype(key_cache, query.scalar_type()), query.device());
  check_cache_heads(num_kv_heads, cache.num_kv_heads, d.head_size, cache.head_size);
  check_scale(scale);
  if (num_seqs < 0) num_seqs = d.num_tokens;
  check_seq_tensor("seq_slots", seq_slots, num_seqs, query.device());
  check_seq_tensor("seq_lens", seq_lens, num_seqs, query.device());
  return cache;
}

inline ContiguousKVShape check_contiguous_attention_decode(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
    const at::Tensor& seq_slots, const at::Tensor& seq_lens, int64_t max_seq_len,
    int64_t sliding_window, const std::optional<at::Tensor>& sinks) {
  const ContiguousKVShape cache = check_contiguous_common(
      out, query, key_cache, value_cache, num_kv_heads, scale, seq_slots, seq_lens, -1);
  check_positive("max_seq_len", max_seq_len);
  check_sliding_window(sliding_window);
  check_sinks(sinks, query);
  return cache;
}

inline ContiguousKVShape check_contiguous_attention_prefill(
    const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
    const at::Tensor& seq_slots, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
    int64_t max_query_len, int64_t sliding_window, const std::optional<at::Tensor>& sinks) {
  check_attention_io(out, query, num_kv_heads);
  const int64_t num_seqs = check_query_start_loc(query_start_loc, query.device());
  const ContiguousKVShape cache = check_contiguous_common(
      out, query, key_cache, value_cache, num_kv_heads, scale, seq_slots, seq_lens, num_seqs);
  check_positive("max_query_len", max_query_len);
  check_sliding_window(sliding_window);
  check_sinks(sinks, query);
  return cache;
}

}  // namespace pyllm
