// CPU rotary position embedding, applied in place to query and key.
//
// For a token at position p, cos_sin_cache[p] holds cos(p * theta_i) in its
// first rot_dim / 2 columns and sin(p * theta_i) in the rest. Pair i of each
// head, (a, b), becomes (a cos - b sin, b cos + a sin). The pairs are
//   neox style:  (i, i + rot_dim / 2)   -- the halves of the rotated part
//   GPT-J style: (2i, 2i + 1)           -- neighbours
// and dimensions from rot_dim to head_size are left as they are.
//
// query/key are [num_tokens, num_heads * head_size] or [num_tokens, num_heads,
// head_size] with a free token stride (the model passes the q and k parts of one
// fused qkv projection), so each token is found through stride(0).
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "../cpu/float_rows.h"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "pos_encoding_checks.h"

namespace pyllm::cpu {
namespace {

// Rotations per token and thread below which a second thread costs more than it saves.
constexpr int64_t kGrainElements = 1 << 14;
// Pairs rotated per pass: the cos/sin of one pass and one head's values fit in
// stack buffers; rot_dim <= 256 (every supported head size) takes a single pass.
constexpr int64_t kPairChunk = 128;

// ---------------------------------------------------------------------------
// One head, pairs [first, first + n) of its rotated part.

template <typename scalar_t>
void rotate_neox(scalar_t* head, int64_t half, int64_t first, int64_t n, const float* cos,
                 const float* sin) {
  alignas(64) float x1[kPairChunk], x2[kPairChunk];
  load_floats(head + first, x1, n);
  load_floats(head + half + first, x2, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float a = x1[i], b = x2[i];
    x1[i] = a * cos[i] - b * sin[i];
    x2[i] = b * cos[i] + a * sin[i];
  }
  store_floats(x1, head + first, n);
  store_floats(x2, head + half + first, n);
}

template <typename scalar_t>
void rotate_gptj(scalar_t* head, int64_t first, int64_t n, const float* cos, const float* sin) {
  alignas(64) float x[2 * kPairChunk];
  load_floats(head + 2 * first, x, 2 * n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * cos[i] - b * sin[i];
    x[2 * i + 1] = b * cos[i] + a * sin[i];
  }
  store_floats(x, head + 2 * first, 2 * n);
}

// query/key of one call, seen as rows of packed heads.
template <typename scalar_t>
struct HeadRows {
  scalar_t* data;
  int64_t token_stride;
  int64_t num_heads;
};

template <typename scalar_t, typename cache_t>
void rotate_tokens(const at::Tensor& positions, HeadRows<scalar_t> query, HeadRows<scalar_t> key,
                   int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  const int64_t num_tokens = positions.size(0);
  const int64_t position_stride = positions.stride(0);
  const int64_t* position_data = positions.const_data_ptr<int64_t>();
  const cache_t* cache_data = cos_sin_cache.const_data_ptr<cache_t>();
  const int64_t rot_dim = cos_sin_cache.size(1);
  const int64_t half = rot_dim / 2;

  const int64_t work_per_token = (query.num_heads + key.num_heads) * rot_dim;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, work_per_token));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float cos[kPairChunk], sin[kPairChunk];
    for (int64_t t = begin; t < end; ++t) {
      const cache_t* cos_sin = cache_data + position_data[t * position_stride] * rot_dim;
      for (int64_t first = 0; first < half; first += kPairChunk) {
        const int64_t n = std::min(kPairChunk, half - first);
        load_floats(cos_sin + first, cos, n);
        load_floats(cos_sin + half + first, sin, n);
        for (const HeadRows<scalar_t>* rows : {&query, &key}) {
          scalar_t* token = rows->data + t * rows->token_stride;
          for (int64_t h = 0; h < rows->num_heads; ++h) {
            scalar_t* head = token + h * head_size;
            if (is_neox) {
              rotate_neox(head, half, first, n, cos, sin);
            } else {
              rotate_gptj(head, first, n, cos, sin);
            }
          }
        }
      }
    }
  });
}

}  // namespace

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  const auto [num_tokens, num_heads, num_kv_heads, rot_dim] =
      check_rotary_embedding(positions, query, key, head_size, cos_sin_cache);
  const auto dtype = query.scalar_type();
  // A position past the cache would read outside it: one pass over the positions.
  const int64_t max_position = cos_sin_cache.size(0);
  const int64_t* position_data = positions.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t p = position_data[t * positions.stride(0)];
    TORCH_CHECK(p >= 0 && p < max_position, "positions[", t, "] = ", p, " is outside [0, ",
                max_position, ")");
  }

  PYLLM_DISPATCH_FLOATING_TYPES(dtype, "rotary_embedding", [&] {
    const HeadRows<scalar_t> q{query.data_ptr<scalar_t>(), query.stride(0), num_heads};
    const HeadRows<scalar_t> k{key.data_ptr<scalar_t>(), key.stride(0), num_kv_heads};
    if (cos_sin_cache.scalar_type() == at::kFloat) {
      rotate_tokens<scalar_t, float>(positions, q, k, head_size, cos_sin_cache, is_neox);
    } else {
      rotate_tokens<scalar_t, scalar_t>(positions, q, k, head_size, cos_sin_cache, is_neox);
    }
  });
}

}  // namespace pyllm::cpu
