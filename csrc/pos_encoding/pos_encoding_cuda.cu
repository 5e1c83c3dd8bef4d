// CUDA rotary position embedding, applied in place to query and key.
#include <algorithm>
#include <type_traits>

#include "../cuda_utils.cuh"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "pos_encoding_checks.h"

namespace pyllm::cuda {
namespace {

// Rotates pair `r` of one head: neox style pairs (r, r + rot_dim/2), GPT-J style
// pairs (2r, 2r + 1); both use cos/sin column r of the position's cache row.
template <typename T, bool IS_NEOX>
__device__ __forceinline__ void rotate_pair(T* head, int r, int half_rot, float cos, float sin) {
  const int a = IS_NEOX ? r : 2 * r;
  const int b = IS_NEOX ? r + half_rot : 2 * r + 1;
  const float x = to_float(head[a]);
  const float y = to_float(head[b]);
  head[a] = from_float<T>(x * cos - y * sin);
  head[b] = from_float<T>(y * cos + x * sin);
}

// One block per token; threads take (head, pair) items of the query heads, then
// of the key heads. cos_sin_cache row = [cos(rot_dim/2) | sin(rot_dim/2)].
template <typename T, typename CacheT, bool IS_NEOX>
__global__ void rotary_embedding_kernel(const int64_t* __restrict__ positions, T* query, T* key,
                                        const CacheT* __restrict__ cos_sin_cache, int rot_dim,
                                        int64_t query_stride, int64_t key_stride, int num_heads,
                                        int num_kv_heads, int head_size) {
  const int64_t token = blockIdx.x;
  const int half_rot = rot_dim / 2;
  const CacheT* cos_row = cos_sin_cache + positions[token] * rot_dim;
  const CacheT* sin_row = cos_row + half_rot;
  T* query_row = query + token * query_stride;
  T* key_row = key + token * key_stride;
  for (int i = threadIdx.x; i < num_heads * half_rot; i += blockDim.x) {
    const int r = i % half_rot;
    rotate_pair<T, IS_NEOX>(query_row + (i / half_rot) * head_size, r, half_rot,
                            to_float(cos_row[r]), to_float(sin_row[r]));
  }
  for (int i = threadIdx.x; i < num_kv_heads * half_rot; i += blockDim.x) {
    const int r = i % half_rot;
    rotate_pair<T, IS_NEOX>(key_row + (i / half_rot) * head_size, r, half_rot,
                            to_float(cos_row[r]), to_float(sin_row[r]));
  }
}

}  // namespace

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                      int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  const auto [num_tokens, num_heads, num_kv_heads, rot_dim] =
      check_rotary_embedding(positions, query, key, head_size, cos_sin_cache);
  check_cuda(query, "query");
  // The kernel reads positions[token].
  TORCH_CHECK(positions.is_contiguous(), "positions must be contiguous on CUDA");
  if (num_tokens == 0) return;

  const c10::cuda::CUDAGuard device_guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t items = std::max(num_heads, num_kv_heads) * (rot_dim / 2);
  const int threads = static_cast<int>(std::min<int64_t>(512, ((items + 31) / 32) * 32));
  const bool float_cache = cos_sin_cache.scalar_type() == at::kFloat;

  PYLLM_DISPATCH_FLOATING_TYPES(query.scalar_type(), "rotary_embedding", [&] {
    using T = device_t<scalar_t>;
    auto launch = [&](auto cache_ptr, auto neox) {
      using CacheT = std::remove_const_t<std::remove_pointer_t<decltype(cache_ptr)>>;
      rotary_embedding_kernel<T, CacheT, decltype(neox)::value>
          <<<num_tokens, threads, 0, stream>>>(
              positions.data_ptr<int64_t>(), device_ptr<scalar_t>(query),
              device_ptr<scalar_t>(key), cache_ptr, static_cast<int>(rot_dim), query.stride(0),
              key.stride(0), static_cast<int>(num_heads), static_cast<int>(num_kv_heads),
              static_cast<int>(head_size));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    auto with_cache = [&](auto neox) {
      // float32 is always accepted; the query's own dtype is the other choice
      // (for float32 queries both are the same instantiation).
      if (float_cache || std::is_same_v<scalar_t, float>) {
        launch(cos_sin_cache.data_ptr<float>(), neox);
      } else {
        launch(device_ptr<scalar_t>(cos_sin_cache), neox);
      }
    };
    if (is_neox) {
      with_cache(std::true_type{});
    } else {
      with_cache(std::false_type{});
    }
  });
}

}  // namespace pyllm::cuda
