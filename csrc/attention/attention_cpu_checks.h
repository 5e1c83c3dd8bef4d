// Argument checks of the CPU attention ops and the shapes they read off their arguments.
//
// An internal header of attention_cpu.cpp, its only includer: what it defines stays in
// that translation unit (anonymous namespace), as when it was one file.
#pragma once

#include "../cache/contiguous_views.h"
#include "attention_cpu_kernels.h"

namespace pyllm::cpu {
namespace {

// Argument checks: what a direct torch.ops call could otherwise turn into an
// out-of-bounds access. pyllm/ops.py checks the rest with friendlier messages.

struct AttentionShape {
  int64_t num_tokens, num_heads, head_size, num_kv_heads, block_size, num_blocks;
};

AttentionShape check_attention(const char* op, const at::Tensor& out, const at::Tensor& query,
                               const at::Tensor& key_cache, const at::Tensor& value_cache,
                               int64_t num_kv_heads, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, int64_t block_size,
                               const std::optional<at::Tensor>& alibi_slopes) {
  for (const at::Tensor* t : {&out, &query, &key_cache, &value_cache, &block_tables, &seq_lens}) {
    TORCH_CHECK(t->device().is_cpu(), op, ": all tensors must be on the CPU, got ", t->device());
  }
  TORCH_CHECK(query.dim() == 3, op, ": query must be [num_tokens, num_heads, head_size], got ",
              query.sizes());
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  TORCH_CHECK(
      (num_heads <= 1 || query.stride(1) == head_size) && (head_size <= 1 || query.stride(2) == 1),
      op, ": each query token's [num_heads, head_size] must be packed, got strides ",
      query.strides());
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), op,
              ": out must be contiguous with the query's shape ", query.sizes());
  const auto dtype = query.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype && key_cache.scalar_type() == dtype &&
                  value_cache.scalar_type() == dtype,
              op, ": out, key_cache and value_cache must have the query's dtype ", dtype);
  TORCH_CHECK(is_listed(kHeadSizes, head_size), op, ": unsupported head_size ", head_size,
              " (supported: ", list_text(kHeadSizes), ")");
  TORCH_CHECK(is_listed(kBlockSizes, block_size), op, ": unsupported block_size ", block_size,
              " (supported: ", list_text(kBlockSizes), ")");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, op, ": num_kv_heads ",
              num_kv_heads, " must divide num_heads ", num_heads);
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), op,
              ": key_cache and value_cache must be contiguous");
  TORCH_CHECK(value_cache.dim() == 4 && value_cache.size(1) == num_kv_heads &&
                  value_cache.size(2) == head_size && value_cache.size(3) == block_size,
              op, ": value_cache must be [num_blocks, ", num_kv_heads, ", ", head_size, ", ",
              block_size, "], got ", value_cache.sizes());
  const int64_t num_blocks = value_cache.size(0);
  const int64_t x = 16 / int64_t(query.element_size());
  TORCH_CHECK(key_cache.dim() == 5 && key_cache.size(0) == num_blocks &&
                  key_cache.size(1) == num_kv_heads && key_cache.size(2) == head_size / x &&
                  key_cache.size(3) == block_size && key_cache.size(4) == x,
              op, ": key_cache must be [", num_blocks, ", ", num_kv_heads, ", ", head_size / x,
              ", ", block_size, ", ", x, "], got ", key_cache.sizes());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.is_contiguous(),
              op, ": block_tables must be a contiguous 2-D int32 tensor");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous() && seq_lens.size(0) == block_tables.size(0),
              op, ": seq_lens must be a contiguous int32 [num_seqs] matching block_tables, got ",
              seq_lens.sizes());
  if (alibi_slopes.has_value()) {
    const at::Tensor& a = *alibi_slopes;
    TORCH_CHECK(a.device().is_cpu() && a.scalar_type() == at::kFloat && a.dim() == 1 &&
                    a.size(0) == num_heads && a.is_contiguous(),
                op, ": alibi_slopes must be a contiguous float32 [", num_heads, "] CPU tensor");
  }
  return {num_tokens, num_heads, head_size, num_kv_heads, block_size, num_blocks};
}

// Reads seq_lens and the used block_tables entries once (a few microseconds)
// so that no task can index outside the cache or the outputs.
void check_block_tables(const char* op, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        const AttentionShape& shape, int64_t max_seq_len) {
  const int64_t num_seqs = seq_lens.size(0), max_blocks = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 0 && lens[s] <= max_seq_len && lens[s] <= max_blocks * shape.block_size,
                op, ": seq_lens[", s, "] = ", lens[s], " is outside [0, ",
                std::min(max_seq_len, max_blocks * shape.block_size), "]");
    const int64_t used = (lens[s] + shape.block_size - 1) / shape.block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int32_t block = tables[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < shape.num_blocks, op, ": block_tables[", s, ", ", b,
                  "] = ", block, " is outside [0, ", shape.num_blocks, ")");
    }
  }
}

template <typename scalar_t>
PagedCache<scalar_t> make_cache(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& block_tables, const AttentionShape& shape) {
  return {key_cache.data_ptr<scalar_t>(),
          value_cache.data_ptr<scalar_t>(),
          block_tables.data_ptr<int32_t>(),
          block_tables.size(1),
          int(shape.num_kv_heads),
          int(shape.head_size),
          int(shape.block_size)};
}

// The contiguous layout's addressing: each sequence's slot and the views' outer
// strides (elements). capacity = num_tiles * kTokenTile, the most tokens a slot holds.
struct SlotAddressing {
  const int32_t* seq_slots;
  int64_t num_slots, capacity;
  int64_t slot_stride, head_stride, tile_stride;
};

void check_addressing(const char* op, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      const AttentionShape& shape, int64_t max_seq_len) {
  check_block_tables(op, block_tables, seq_lens, shape, max_seq_len);
}

// Reads seq_slots and seq_lens once so that no task reads outside the views.
void check_addressing(const char* op, const SlotAddressing& slots, const at::Tensor& seq_lens,
                      const AttentionShape&, int64_t max_seq_len) {
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t limit = std::min(max_seq_len, slots.capacity);
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    TORCH_CHECK(slots.seq_slots[s] >= 0 && slots.seq_slots[s] < slots.num_slots, op,
                ": seq_slots[", s, "] = ", slots.seq_slots[s], " is outside [0, ",
                slots.num_slots, ")");
    TORCH_CHECK(lens[s] >= 0 && lens[s] <= limit, op, ": seq_lens[", s, "] = ", lens[s],
                " is outside [0, ", limit, "]");
  }
}

template <typename scalar_t>
PagedCache<scalar_t> make_cache(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const SlotAddressing& slots, const AttentionShape& shape) {
  PagedCache<scalar_t> cache{key_cache.data_ptr<scalar_t>(),
                             value_cache.data_ptr<scalar_t>(),
                             nullptr,
                             0,
                             int(shape.num_kv_heads),
                             int(shape.head_size),
                             int(kTokenTile)};
  cache.seq_slots = slots.seq_slots;
  cache.slot_stride = slots.slot_stride;
  cache.head_stride = slots.head_stride;
  cache.tile_stride = slots.tile_stride;
  return cache;
}

// The contiguous views (ops.h): key_cache [max_num_seqs, num_kv_heads, num_tiles,
// head_size / x, kTokenTile, x], value_cache [max_num_seqs, num_kv_heads, num_tiles,
// head_size, kTokenTile], the inner dimensions dense, the outer strides free but the
// same for both caches (the kernels address one tile of either with one offset).
SlotAddressing check_contiguous_cache(const char* op, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, int64_t num_kv_heads,
                                      int64_t head_size, at::ScalarType dtype,
                                      const at::Tensor& seq_slots) {
  TORCH_CHECK(key_cache.device().is_cpu() && value_cache.device().is_cpu() &&
                  seq_slots.device().is_cpu(),
              op, ": key_cache, value_cache and seq_slots must be CPU tensors");
  TORCH_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype, op,
              ": key_cache and value_cache must have dtype ", dtype);
  const int64_t x = 16 / int64_t(c10::elementSize(dtype));
  const auto [num_slots, num_tiles] =
      check_contiguous_views(op, key_cache, value_cache, num_kv_heads, head_size, x);
  // The kernels address both caches with one set of outer strides.
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(key_cache.stride(d) == value_cache.stride(d), op,
                ": key_cache and value_cache must share their (slot, kv head, tile) strides, got ",
                key_cache.strides(), " and ", value_cache.strides());
  }
  TORCH_CHECK(seq_slots.scalar_type() == at::kInt && seq_slots.dim() == 1 &&
                  seq_slots.is_contiguous(),
              op, ": seq_slots must be a contiguous 1-D int32 tensor, got ", seq_slots.sizes());
  return {seq_slots.data_ptr<int32_t>(), num_slots,      num_tiles * kTokenTile,
          key_cache.stride(0),           key_cache.stride(1), key_cache.stride(2)};
}

// Query, out and seq_lens of the contiguous ops (the caches: check_contiguous_cache).
AttentionShape check_contiguous_attention(const char* op, const at::Tensor& out,
                                          const at::Tensor& query, int64_t num_kv_heads,
                                          const at::Tensor& seq_slots,
                                          const at::Tensor& seq_lens, int64_t num_seqs) {
  TORCH_CHECK(query.dim() == 3, op, ": query must be [num_tokens, num_heads, head_size], got ",
              query.sizes());
  const int64_t x = 16 / int64_t(query.element_size());
  TORCH_CHECK(out.device().is_cpu() && query.device().is_cpu() && seq_lens.device().is_cpu(), op,
              ": all tensors must be on the CPU");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  TORCH_CHECK(
      (num_heads <= 1 || query.stride(1) == head_size) && (head_size <= 1 || query.stride(2) == 1),
      op, ": each query token's [num_heads, head_size] must be packed, got strides ",
      query.strides());
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), op,
              ": out must be contiguous with the query's shape ", query.sizes());
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), op, ": out must have the query's dtype");
  TORCH_CHECK(is_listed(kHeadSizes, head_size), op, ": unsupported head_size ", head_size,
              " (supported: ", list_text(kHeadSizes), ")");
  TORCH_CHECK(head_size % x == 0, op, ": head_size must be a multiple of x = ", x);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, op, ": num_kv_heads ",
              num_kv_heads, " must divide num_heads ", num_heads);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous() && seq_lens.size(0) == num_seqs &&
                  seq_slots.dim() == 1 && seq_slots.size(0) == num_seqs,
              op, ": seq_slots and seq_lens must be contiguous int32 [num_seqs = ", num_seqs,
              "], got ", seq_slots.sizes(), " and ", seq_lens.sizes());
  return {num_tokens, num_heads, head_size, num_kv_heads, kTokenTile, 0};
}


}  // namespace
}  // namespace pyllm::cpu
