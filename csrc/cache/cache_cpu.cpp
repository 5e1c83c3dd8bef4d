// CPU kernels of the paged KV cache: writing new tokens into their slots, and
// copying whole blocks (copy-on-write inside a layer, swaps between caches).
//
// These kernels only move bits, so they are written over the element's width
// (uint16_t for bf16/fp16, uint32_t for fp32) rather than its dtype: one
// instantiation per width, and a copy is exact whatever the values are.
//
// Layout (ops.h), x = 16 / element_size so one x-group of a key is 16 bytes:
//   key_cache   [num_blocks, num_kv_heads, head_size / x, block_size, x]
//   value_cache [num_blocks, num_kv_heads, head_size, block_size]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../attention/sizes.h"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "cache_checks.h"

namespace pyllm::cpu {
namespace {

// Work below this many elements per thread is not worth waking a second thread.
constexpr int64_t kGrainElements = 1 << 14;
// Block copies: bytes per thread before splitting pays off.
constexpr int64_t kGrainBytes = 1 << 18;
// The largest of kHeadSizes (sizes.h): one quantized row's scratch.
constexpr int64_t kMaxHeadSize = 256;

// Raises unless every slot is -1 (skip) or inside the cache: a slot past the
// end would be a write outside key_cache/value_cache. One pass over num_tokens
// int64s, negligible next to the copies.
void check_slots(const int64_t* slots, int64_t num_tokens, int64_t num_slots) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                " is outside [-1, ", num_slots, ")");
  }
}

template <typename bits_t>
void scatter_tokens(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, const int64_t* slots) {
  const int64_t num_tokens = key.size(0);
  const int64_t num_kv_heads = value_cache.size(1);
  const int64_t head_size = value_cache.size(2);
  const int64_t block_size = value_cache.size(3);
  constexpr int64_t x = 16 / sizeof(bits_t);
  const int64_t key_stride = key.stride(0);
  const int64_t value_stride = value.stride(0);
  const auto* key_data = static_cast<const bits_t*>(key.data_ptr());
  const auto* value_data = static_cast<const bits_t*>(value.data_ptr());
  auto* key_cache_data = static_cast<bits_t*>(key_cache.data_ptr());
  auto* value_cache_data = static_cast<bits_t*>(value_cache.data_ptr());
  // Both caches hold head_size * block_size elements per (block, head).
  const int64_t head_elems = head_size * block_size;

  const int64_t grain = std::max<int64_t>(1, kGrainElements / (2 * num_kv_heads * head_size));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding token: its slot is not written
      const int64_t block = slot / block_size;
      const int64_t offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const bits_t* k = key_data + t * key_stride + h * head_size;
        const bits_t* v = value_data + t * value_stride + h * head_size;
        // Within (block, head) the key cache is [head_size / x, block_size, x]:
        // each 16-byte group of the key lands block_size * x elements apart.
        bits_t* k_dst = key_cache_data + (block * num_kv_heads + h) * head_elems + offset * x;
        for (int64_t g = 0; g < head_size / x; ++g) {
          std::memcpy(k_dst + g * block_size * x, k + g * x, 16);
        }
        // The value cache is [head_size, block_size]: dimension d of this token
        // sits block_size elements after dimension d - 1.
        bits_t* v_dst = value_cache_data + (block * num_kv_heads + h) * head_elems + offset;
        for (int64_t d = 0; d < head_size; ++d) {
          v_dst[d * block_size] = v[d];
        }
      }
    }
  });
}

// int8 cache: one row of head_size elements quantized symmetrically with a float16
// scale, s = fp16(absmax / 127) (clamped to float16's largest), q = round(x / s) in
// float32 (ties to even as torch.round) clamped to [-127, 127]: dividing by the stored
// scale keeps the round trip exact. A zero row, or one whose scale underflows float16,
// gets s = 0 and zeros. Returns s.
template <typename scalar_t>
c10::Half quantize_row(const scalar_t* x, int64_t n, int8_t* q) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::abs(static_cast<float>(x[i])));
  const c10::Half s(std::min(absmax / 127.0f, kMaxKVScale));
  const float sf = static_cast<float>(s);
  for (int64_t i = 0; i < n; ++i) {
    const float r = std::nearbyint(static_cast<float>(x[i]) / sf);
    q[i] = sf > 0.0f ? static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f)) : 0;
  }
  return s;
}

// Where token (block or tile base, offset) of one kv head goes: the element offsets
// of its key and value rows and of its scale.
struct TokenPlace {
  int64_t key, value, scale;
};

// Writes one token's quantized key and value rows of one kv head at place:
// the key's 16-byte groups `tokens * 16` bytes apart (tokens per block or tile).
template <typename scalar_t>
void write_int8_token(const scalar_t* k, const scalar_t* v, int64_t head_size, int64_t tokens,
                      const TokenPlace& where, int8_t* key_cache, int8_t* value_cache,
                      c10::Half* k_scale, c10::Half* v_scale) {
  int8_t row[kMaxHeadSize];
  k_scale[where.scale] = quantize_row(k, head_size, row);
  for (int64_t g = 0; g < head_size / 16; ++g) {
    std::memcpy(key_cache + where.key + g * tokens * 16, row + g * 16, 16);
  }
  v_scale[where.scale] = quantize_row(v, head_size, row);
  for (int64_t d = 0; d < head_size; ++d) value_cache[where.value + d * tokens] = row[d];
}

// reshape_and_cache into an int8 cache: place(t, h) is token t's TokenPlace for kv head
// h, or key = -1 to skip the token.
template <typename Place>
void scatter_int8(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                  at::Tensor& value_cache, at::Tensor& k_scale, at::Tensor& v_scale,
                  int64_t tokens_per_block, const Place& place) {
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_size = key.size(2);
  auto* kc = key_cache.data_ptr<int8_t>();
  auto* vc = value_cache.data_ptr<int8_t>();
  auto* ks = k_scale.data_ptr<c10::Half>();
  auto* vs = v_scale.data_ptr<c10::Half>();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / (2 * num_kv_heads * head_size));
  PYLLM_DISPATCH_FLOATING_TYPES(key.scalar_type(), "reshape_and_cache_int8", [&] {
    const auto* kd = key.data_ptr<scalar_t>();
    const auto* vd = value.data_ptr<scalar_t>();
    at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const TokenPlace where = place(t, h);
          if (where.key < 0) break;  // padding token: nothing is written
          write_int8_token(kd + t * key.stride(0) + h * head_size,
                           vd + t * value.stride(0) + h * head_size, head_size,
                           tokens_per_block, where, kc, vc, ks, vs);
        }
      }
    });
  });
}

// The largest block number of each column of block_mapping (checked by
// check_block_mapping), so callers can bound-check every cache before a byte moves.
std::pair<int64_t, int64_t> max_blocks(const at::Tensor& block_mapping) {
  const int64_t* pairs = block_mapping.const_data_ptr<int64_t>();
  int64_t max_src = -1, max_dst = -1;
  for (int64_t i = 0; i < block_mapping.size(0); ++i) {
    TORCH_CHECK(pairs[2 * i] >= 0 && pairs[2 * i + 1] >= 0, "block_mapping[", i,
                "] holds a negative block number");
    max_src = std::max(max_src, pairs[2 * i]);
    max_dst = std::max(max_dst, pairs[2 * i + 1]);
  }
  return {max_src, max_dst};
}

// Bytes per block of a cache whose blocks (dim 0) are copied as raw bytes.
int64_t block_bytes(const at::Tensor& cache) {
  return static_cast<int64_t>(cache.nbytes()) / std::max<int64_t>(1, cache.size(0));
}

// Contiguous layout (ops.h): token t of a slot is in tile t / kTokenTile at offset
// t % kTokenTile; a tile of either cache is laid out as a paged block of kTokenTile.
template <typename bits_t>
void write_tokens_contiguous(const at::Tensor& key, const at::Tensor& value,
                             at::Tensor& key_cache, at::Tensor& value_cache,
                             const int64_t* token_slots, const int64_t* positions) {
  const int64_t num_tokens = key.size(0);
  const int64_t num_kv_heads = value_cache.size(1);
  const int64_t head_size = value_cache.size(3);
  constexpr int64_t x = 16 / sizeof(bits_t);
  constexpr int64_t tile = kTokenTile;
  const auto* key_data = static_cast<const bits_t*>(key.data_ptr());
  const auto* value_data = static_cast<const bits_t*>(value.data_ptr());
  auto* key_cache_data = static_cast<bits_t*>(key_cache.data_ptr());
  auto* value_cache_data = static_cast<bits_t*>(value_cache.data_ptr());
  const int64_t grain = std::max<int64_t>(1, kGrainElements / (2 * num_kv_heads * head_size));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = token_slots[t];
      if (slot < 0) continue;  // padding token: nothing is written
      const int64_t pos = positions[t];
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const bits_t* k = key_data + t * key.stride(0) + h * head_size;
        const bits_t* v = value_data + t * value.stride(0) + h * head_size;
        bits_t* k_dst = key_cache_data + slot * key_cache.stride(0) + h * key_cache.stride(1) +
                        (pos / tile) * key_cache.stride(2) + (pos % tile) * x;
        for (int64_t g = 0; g < head_size / x; ++g) {
          std::memcpy(k_dst + g * tile * x, k + g * x, 16);
        }
        bits_t* v_dst = value_cache_data + slot * value_cache.stride(0) +
                        h * value_cache.stride(1) + (pos / tile) * value_cache.stride(2) +
                        pos % tile;
        for (int64_t d = 0; d < head_size; ++d) v_dst[d * tile] = v[d];
      }
    }
  });
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const std::string& kv_cache_dtype,
                       const std::optional<at::Tensor>& k_scale,
                       const std::optional<at::Tensor>& v_scale) {
  const PagedKVShape shape = check_reshape_and_cache(key, value, key_cache, value_cache,
                                                     slot_mapping, kv_cache_dtype, k_scale, v_scale);
  const int64_t num_tokens = key.size(0);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  check_slots(slots, num_tokens, shape.num_blocks * shape.block_size);
  if (key_cache.scalar_type() == at::kChar) {
    const int64_t bs = shape.block_size, kvh = shape.num_kv_heads, d = shape.head_size;
    scatter_int8(key, value, key_cache, value_cache, const_cast<at::Tensor&>(*k_scale),
                 const_cast<at::Tensor&>(*v_scale), bs, [&](int64_t t, int64_t h) {
                   if (slots[t] < 0) return TokenPlace{-1, -1, -1};
                   const int64_t base = (slots[t] / bs * kvh + h), offset = slots[t] % bs;
                   return TokenPlace{base * d * bs + offset * 16, base * d * bs + offset,
                                     base * bs + offset};
                 });
    return;
  }

  if (key.element_size() == 2) {
    scatter_tokens<uint16_t>(key, value, key_cache, value_cache, slots);
  } else {
    scatter_tokens<uint32_t>(key, value, key_cache, value_cache, slots);
  }
}

void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping) {
  check_copy_blocks(key_caches, value_caches, block_mapping);
  const auto [max_src, max_dst] = max_blocks(block_mapping);
  const int64_t num_pairs = block_mapping.size(0);
  if (num_pairs == 0) return;
  // Checked before any byte moves, so a bad call changes nothing.
  const int64_t num_blocks = key_caches[0].size(0);
  TORCH_CHECK(std::max(max_src, max_dst) < num_blocks, "block_mapping refers to block ",
              std::max(max_src, max_dst), " but the caches hold ", num_blocks, " blocks");

  // Every layer's key and value cache is one "cache" here.
  const int64_t num_caches = 2 * static_cast<int64_t>(key_caches.size());
  std::vector<char*> bases(num_caches);
  std::vector<int64_t> strides(num_caches);
  for (int64_t c = 0; c < num_caches; ++c) {
    const at::Tensor& cache = c % 2 ? value_caches[c / 2] : key_caches[c / 2];
    strides[c] = block_bytes(cache);
    bases[c] = static_cast<char*>(cache.data_ptr());
  }

  // The pairs are copied in no particular order (in parallel), so a block must not
  // be both a source and a destination in one call: the block manager copies a
  // shared block into a fresh one.
  const int64_t* pairs = block_mapping.const_data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, strides[0]));
  at::parallel_for(0, num_caches * num_pairs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i / num_pairs, p = i % num_pairs;
      const int64_t bytes = strides[c];
      // memmove: a pair may name the same block twice.
      std::memmove(bases[c] + pairs[2 * p + 1] * bytes, bases[c] + pairs[2 * p] * bytes, bytes);
    }
  });
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  // Copies that touch a CUDA tensor are dispatched to the CUDA implementation.
  check_swap_blocks(src, dst, block_mapping);
  const int64_t bytes = block_bytes(src);
  const auto [max_src, max_dst] = max_blocks(block_mapping);
  TORCH_CHECK(max_src < src.size(0), "block_mapping source block ", max_src,
              " is outside src's ", src.size(0), " blocks");
  TORCH_CHECK(max_dst < dst.size(0), "block_mapping destination block ", max_dst,
              " is outside dst's ", dst.size(0), " blocks");

  const auto* src_data = static_cast<const char*>(src.data_ptr());
  auto* dst_data = static_cast<char*>(dst.data_ptr());
  const int64_t* pairs = block_mapping.const_data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, bytes));
  at::parallel_for(0, block_mapping.size(0), grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      std::memmove(dst_data + pairs[2 * p + 1] * bytes, src_data + pairs[2 * p] * bytes, bytes);
    }
  });
}

void write_kv_contiguous(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                         at::Tensor& value_cache, const at::Tensor& token_slots,
                         const at::Tensor& positions, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale) {
  const char* op = "write_kv_contiguous";
  const ContiguousKVShape shape = check_write_kv_contiguous(key, value, key_cache, value_cache,
                                                            token_slots, positions, k_scale, v_scale);
  const int64_t num_tokens = key.size(0), num_slots = shape.num_slots;
  const int64_t* slots = token_slots.const_data_ptr<int64_t>();
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  // Every write lands inside the views: slot in range (or -1: skipped), position
  // below the slots' capacity. One pass over the tokens, before any byte moves.
  const int64_t capacity = shape.num_tiles * kTokenTile;
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, op, ": token_slots[", t, "] = ",
                slots[t], " is outside [-1, ", num_slots, ")");
    TORCH_CHECK(slots[t] < 0 || (pos[t] >= 0 && pos[t] < capacity), op, ": positions[", t,
                "] = ", pos[t], " is outside [0, ", capacity, ")");
  }
  if (key_cache.scalar_type() == at::kChar) {
    // Tile (slot, h, pos / tile) of either cache at one offset (shared outer strides);
    // the scales are dense [slots, kv heads, tiles, kTokenTile].
    const int64_t kvh = shape.num_kv_heads, tiles = shape.num_tiles;
    scatter_int8(key, value, key_cache, value_cache, const_cast<at::Tensor&>(*k_scale),
                 const_cast<at::Tensor&>(*v_scale), kTokenTile, [&](int64_t t, int64_t h) {
                   if (slots[t] < 0) return TokenPlace{-1, -1, -1};
                   const int64_t tile = pos[t] / kTokenTile, offset = pos[t] % kTokenTile;
                   const int64_t base = slots[t] * key_cache.stride(0) +
                                        h * key_cache.stride(1) + tile * key_cache.stride(2);
                   return TokenPlace{base + offset * 16, base + offset,
                                     ((slots[t] * kvh + h) * tiles + tile) * kTokenTile + offset};
                 });
    return;
  }
  if (key.element_size() == 2) {
    write_tokens_contiguous<uint16_t>(key, value, key_cache, value_cache, slots, pos);
  } else {
    write_tokens_contiguous<uint32_t>(key, value, key_cache, value_cache, slots, pos);
  }
}

}  // namespace pyllm::cpu
