// The CPU attention ops' own checks, after the shared contract (attention_checks.h):
// one read of seq_lens, block tables and slots so that no task indexes outside the
// cache or the outputs. Also the shapes and addressing the kernels take.
//
// An internal header of attention_cpu.cpp, its only includer: what it defines stays in
// that translation unit (anonymous namespace), as when it was one file.
#pragma once

#include "attention_checks.h"
#include "attention_cpu_kernels.h"

namespace pyllm::cpu {
namespace {

struct AttentionShape {
  int64_t num_tokens, num_heads, head_size, num_kv_heads, block_size, num_blocks;
};

AttentionShape paged_shape(const at::Tensor& query, int64_t num_kv_heads,
                           const PagedKVShape& cache) {
  return {query.size(0),  query.size(1),    query.size(2),
          num_kv_heads,   cache.block_size, cache.num_blocks};
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

// The int8 cache's scales (checked by check_kv_scales), null for a float cache.
struct KVScales {
  const c10::Half* key = nullptr;
  const c10::Half* value = nullptr;
};

KVScales kv_scales(const std::optional<at::Tensor>& k_scale,
                   const std::optional<at::Tensor>& v_scale) {
  if (!k_scale || !v_scale) return {};
  return {k_scale->data_ptr<c10::Half>(), v_scale->data_ptr<c10::Half>()};
}

template <typename scalar_t>
PagedCache<scalar_t> make_cache(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& block_tables, const AttentionShape& shape,
                                const KVScales& scales = {}) {
  PagedCache<scalar_t> cache{key_cache.data_ptr<scalar_t>(),
                             value_cache.data_ptr<scalar_t>(),
                             block_tables.data_ptr<int32_t>(),
                             block_tables.size(1),
                             int(shape.num_kv_heads),
                             int(shape.head_size),
                             int(shape.block_size)};
  cache.key_scale = scales.key;
  cache.value_scale = scales.value;
  return cache;
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
                                const SlotAddressing& slots, const AttentionShape& shape,
                                const KVScales& scales = {}) {
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
  cache.key_scale = scales.key;
  cache.value_scale = scales.value;
  cache.num_tiles = slots.capacity / kTokenTile;
  return cache;
}

// The contiguous views' addressing (the views checked by check_contiguous_kv_cache:
// both caches share their outer strides).
SlotAddressing slot_addressing(const at::Tensor& key_cache, const at::Tensor& seq_slots,
                               const ContiguousKVShape& cache) {
  return {seq_slots.data_ptr<int32_t>(), cache.num_slots,      cache.num_tiles * kTokenTile,
          key_cache.stride(0),           key_cache.stride(1), key_cache.stride(2)};
}

AttentionShape contiguous_shape(const at::Tensor& query, int64_t num_kv_heads) {
  return {query.size(0), query.size(1), query.size(2), num_kv_heads, kTokenTile, 0};
}

}  // namespace
}  // namespace pyllm::cpu
