// Where the attention and cache kernels find a sequence's KV tiles, for both cache
// layouts (csrc/ops.h). A "tile" is a paged block of block_size tokens, or
// kTokenTile tokens of a contiguous slot; inside a tile both layouts are the same
// (key [head_size / x][tile][x], value [head_size][tile]), so the kernels' loops are
// shared and only the addressing below differs:
//   paged:      tile i of sequence s  = block block_tables[s][i], heads packed inside
//   contiguous: tile i of sequence s  = key_cache[seq_slots[s]][kv_head][i], any strides
//
// Each addressing type has
//   open(seq, kv_head, seq_len, tile_elems, &tiles)   fills a Seq for one (sequence,
//       kv head); false when the sequence's slot or length would address memory
//       outside the cache views (contiguous only; the kernels then write NaN so the
//       caller's error shows instead of a read out of bounds). tile_elems =
//       head_size * tile tokens, a compile-time constant in the decode kernel.
//   key_step(r), value_step(r)   the offset of tile reference r from the Seq's
//       key_base / value_base (kept on the addressing type, so strides stay kernel
//       parameters rather than per-thread copies)
// and its Seq has
//   key_base, value_base   element offsets of the head's tiles in key_cache /
//       value_cache (the kernels' k_head / v_head)
//   ref(i)   what locating tile i needs; for paged a block-table load, which the
//       decode kernel issues one iteration early because later loads depend on it.
// This shape keeps the paged kernels computing the expressions they computed
// before the contiguous layout existed.
//
// An int8 cache's float16 scales (k_scale / v_scale, shaped like the cache without
// head_size and dense) are found the same way: Seq::scale_base for the head, plus
// scale_step(r) for tile reference r, plus the token's offset in its tile.
#pragma once

#include <cstdint>

namespace pyllm::cuda {

// Paged cache: [num_blocks, num_kv_heads, ...] contiguous, blocks found through
// block_tables. Block tables are trusted as before (pyllm/ops.py checks them).
struct PagedKV {
  const int* block_tables;     // [num_seqs, block_tables_stride]
  int64_t block_tables_stride;
  int64_t block_stride;        // elements per cache block (all kv heads)
  int scale_head_stride;       // int8 scales: block_size
  int64_t scale_block_stride;  // int8 scales: num_kv_heads * block_size

  struct Seq {
    int64_t key_base;
    int64_t value_base;
    int64_t scale_base;
    const int* table;
    __device__ __forceinline__ int64_t ref(int tile) const { return table[tile]; }
  };
  __device__ __forceinline__ int64_t key_step(int64_t physical) const {
    return physical * block_stride;
  }
  __device__ __forceinline__ int64_t value_step(int64_t physical) const {
    return physical * block_stride;
  }
  __device__ __forceinline__ int64_t scale_step(int64_t physical) const {
    return physical * scale_block_stride;
  }

  // The kv heads of a block are packed: head h starts at h * tile_elems.
  __device__ __forceinline__ bool open(int seq, int kv_head, int /*seq_len*/, int64_t tile_elems,
                                       Seq* tiles) const {
    tiles->key_base = kv_head * tile_elems;
    tiles->value_base = tiles->key_base;
    tiles->scale_base = static_cast<int64_t>(kv_head) * scale_head_stride;
    tiles->table = block_tables + seq * block_tables_stride;
    return true;
  }
};

// Contiguous cache (the virtual KV arena): key_cache [max_num_seqs, num_kv_heads,
// num_tiles, head_size / x, kTokenTile, x] and value_cache [max_num_seqs,
// num_kv_heads, num_tiles, head_size, kTokenTile] with free (slot, head, tile)
// strides, possibly different for keys and values.
struct ContiguousKV {
  const int* seq_slots;  // [num_seqs] int32
  int64_t num_slots;     // max_num_seqs
  int64_t capacity;      // tokens per slot: num_tiles * kTokenTile
  int64_t key_slot_stride, key_head_stride, key_tile_stride;
  int64_t value_slot_stride, value_head_stride, value_tile_stride;
  // int8 scales [max_num_seqs, num_kv_heads, num_tiles, kTokenTile], dense.
  int64_t scale_slot_stride, scale_head_stride;
  int scale_tile_stride;

  struct Seq {
    int64_t key_base;
    int64_t value_base;
    int64_t scale_base;
    __device__ __forceinline__ int ref(int tile) const { return tile; }
  };
  __device__ __forceinline__ int64_t key_step(int tile) const { return tile * key_tile_stride; }
  __device__ __forceinline__ int64_t value_step(int tile) const {
    return tile * value_tile_stride;
  }
  __device__ __forceinline__ int64_t scale_step(int tile) const {
    return static_cast<int64_t>(tile) * scale_tile_stride;
  }

  __device__ __forceinline__ bool open(int seq, int kv_head, int seq_len,
                                       int64_t /*tile_elems*/, Seq* tiles) const {
    const int64_t slot = seq_slots[seq];
    if (slot < 0 || slot >= num_slots || seq_len < 0 || seq_len > capacity) return false;
    tiles->key_base = slot * key_slot_stride + kv_head * key_head_stride;
    tiles->value_base = slot * value_slot_stride + kv_head * value_head_stride;
    tiles->scale_base = slot * scale_slot_stride + kv_head * scale_head_stride;
    return true;
  }
};

// Where one new token's key/value go: the element offsets of its tile for kv head
// 0, the stride between kv heads, and its offset inside the tile.
struct TokenTarget {
  int64_t key_base;
  int64_t value_base;
  int64_t key_head_stride;
  int64_t value_head_stride;
  int offset;     // token within the tile
  int tile_size;  // block_size (paged) or kTokenTile (contiguous)
  // int8 cache: the scales of the token's tile for kv head 0, and between kv heads
  // (the token's scale is at scale_base + h * scale_head_stride + offset).
  int64_t scale_base;
  int64_t scale_head_stride;
};

// reshape_and_cache: slot_mapping[t] = block * block_size + offset, -1 = padding.
struct PagedWrite {
  const int64_t* slot_mapping;
  int block_size;
  int64_t block_stride;  // num_kv_heads * head_size * block_size
  int64_t head_stride;   // head_size * block_size
  int64_t scale_block_stride;  // int8 scales: num_kv_heads * block_size

  __device__ __forceinline__ bool locate(int64_t token, TokenTarget* target) const {
    const int64_t slot = slot_mapping[token];
    if (slot < 0) return false;  // padding token
    const int64_t block = slot / block_size;
    const int64_t block_base = block * block_stride;
    *target = TokenTarget{block_base, block_base, head_stride, head_stride,
                          static_cast<int>(slot % block_size), block_size,
                          block * scale_block_stride, block_size};
    return true;
  }
};

// write_kv_contiguous: token t goes to (token_slots[t], positions[t]); a slot of -1
// is padding. Entries that would land outside the views are dropped (no write):
// the kernel cannot raise, and pyllm/ops.py reports such values before the call.
struct ContiguousWrite {
  const int64_t* token_slots;
  const int64_t* positions;
  int64_t num_slots;
  int64_t capacity;  // tokens per slot
  int64_t key_slot_stride, key_head_stride, key_tile_stride;
  int64_t value_slot_stride, value_head_stride, value_tile_stride;
  int tile_size;     // kTokenTile
  int64_t scale_slot_stride, scale_head_stride;  // int8 scales (dense, as ContiguousKV)

  __device__ __forceinline__ bool locate(int64_t token, TokenTarget* target) const {
    const int64_t slot = token_slots[token];
    const int64_t pos = positions[token];
    if (slot < 0 || slot >= num_slots || pos < 0 || pos >= capacity) return false;
    const int64_t tile = pos / tile_size;
    *target = TokenTarget{slot * key_slot_stride + tile * key_tile_stride,
                          slot * value_slot_stride + tile * value_tile_stride,
                          key_head_stride,
                          value_head_stride,
                          static_cast<int>(pos % tile_size),
                          tile_size,
                          slot * scale_slot_stride + tile * tile_size,
                          scale_head_stride};
    return true;
  }
};

}  // namespace pyllm::cuda
