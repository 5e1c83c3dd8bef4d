// CUDA cache ops: write new keys/values into the paged cache or the contiguous
// arena views (as stored, or quantized into an int8 cache and its float16 scales),
// copy blocks within each layer's cache (copy-on-write), and swap blocks between
// devices.
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "../attention/kv_addressing.cuh"
#include "../cuda_utils.cuh"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "cache_checks.h"

namespace pyllm::cuda {
namespace {

// One block per token. Element (head h, dim d) of a token goes to
//   key_cache  [tile of h][d / x][offset][d % x]
//   value_cache[tile of h][d][offset]
// where the Target (kv_addressing.cuh) says where the token's tile and offset are:
// block slot / block_size at slot % block_size for the paged cache, tile
// position / kTokenTile of the slot's view for the contiguous one.
template <typename T, typename Target>
__global__ void write_kv_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                T* __restrict__ key_cache, T* __restrict__ value_cache,
                                const Target target, int64_t key_stride, int64_t value_stride,
                                int num_kv_heads, int head_size) {
  const int64_t token = blockIdx.x;
  TokenTarget t;
  if (!target.locate(token, &t)) return;  // padding token (or dropped, see ContiguousWrite)
  constexpr int X = Vec16<T>::kSize;
  const int width = num_kv_heads * head_size;
  const T* key_row = key + token * key_stride;
  const T* value_row = value + token * value_stride;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    const int h = i / head_size;
    const int d = i % head_size;
    key_cache[t.key_base + h * t.key_head_stride + ((d / X) * t.tile_size + t.offset) * X +
              d % X] = key_row[i];
    value_cache[t.value_base + h * t.value_head_stride +
                static_cast<int64_t>(d) * t.tile_size + t.offset] = value_row[i];
  }
}

// int8 cache: one warp per (token, kv head) row pair. A row is quantized as on the
// CPU (cache_cpu.cpp): s = fp16(min(absmax / 127, kMaxKVScale)), q = round(x / s)
// clamped to [-127, 127] (IEEE division and round-to-nearest-even, so both devices
// store the same bytes), s = 0 and zeros where the scale is 0.
template <typename T>
__device__ __forceinline__ void quantize_row_warp(const T* x, int head_size, int8_t* q_base,
                                                  int key_x, int tile_size, __half* scale) {
  const int lane = threadIdx.x % kWarpSize;
  float absmax = 0.f;
  for (int d = lane; d < head_size; d += kWarpSize) absmax = fmaxf(absmax, fabsf(to_float(x[d])));
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) {
    absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, mask));
  }
  const __half s = __float2half_rn(fminf(__fdiv_rn(absmax, 127.f), kMaxKVScale));
  const float sf = __half2float(s);
  for (int d = lane; d < head_size; d += kWarpSize) {
    const float r = rintf(__fdiv_rn(to_float(x[d]), sf));
    const int8_t q = sf > 0.f ? static_cast<int8_t>(fminf(fmaxf(r, -127.f), 127.f)) : 0;
    // Keys: [d / x][tile][x] (key_x = 16); values: [d][tile] (key_x = 0).
    q_base[key_x ? (d / key_x * tile_size) * key_x + d % key_x : d * tile_size] = q;
  }
  if (lane == 0) *scale = s;
}

template <typename T, typename Target>
__global__ void write_kv_int8_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                     int8_t* __restrict__ key_cache,
                                     int8_t* __restrict__ value_cache,
                                     __half* __restrict__ k_scale, __half* __restrict__ v_scale,
                                     const Target target, int64_t key_stride,
                                     int64_t value_stride, int num_kv_heads, int head_size) {
  const int64_t token = blockIdx.x;
  TokenTarget t;
  if (!target.locate(token, &t)) return;  // padding token (or dropped, see ContiguousWrite)
  constexpr int X = Vec16<int8_t>::kSize;
  const int warps = blockDim.x / kWarpSize;
  for (int h = threadIdx.x / kWarpSize; h < num_kv_heads; h += warps) {
    const int64_t scale = t.scale_base + h * t.scale_head_stride + t.offset;
    quantize_row_warp(key + token * key_stride + h * head_size, head_size,
                      key_cache + t.key_base + h * t.key_head_stride + t.offset * X, X,
                      t.tile_size, k_scale + scale);
    quantize_row_warp(value + token * value_stride + h * head_size, head_size,
                      value_cache + t.value_base + h * t.value_head_stride + t.offset, 0,
                      t.tile_size, v_scale + scale);
  }
}

template <typename Target>
void launch_write_kv_int8(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                          at::Tensor& value_cache, const at::Tensor& k_scale,
                          const at::Tensor& v_scale, const Target& target) {
  const int64_t num_tokens = key.size(0);
  const int64_t num_kv_heads = key.size(1);
  const int64_t head_size = key.size(2);
  if (num_tokens == 0 || num_kv_heads * head_size == 0) return;
  const c10::cuda::CUDAGuard device_guard(key.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int threads = static_cast<int>(std::min<int64_t>(num_kv_heads, 8)) * kWarpSize;
  auto* ks = reinterpret_cast<__half*>(k_scale.data_ptr<at::Half>());
  auto* vs = reinterpret_cast<__half*>(v_scale.data_ptr<at::Half>());
  PYLLM_DISPATCH_FLOATING_TYPES(key.scalar_type(), "write_kv_int8", [&] {
    write_kv_int8_kernel<device_t<scalar_t>, Target><<<num_tokens, threads, 0, stream>>>(
        device_ptr<scalar_t>(key), device_ptr<scalar_t>(value), key_cache.data_ptr<int8_t>(),
        value_cache.data_ptr<int8_t>(), ks, vs, target, key.stride(0), value.stride(0),
        static_cast<int>(num_kv_heads), static_cast<int>(head_size));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename Target>
void launch_write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                     at::Tensor& value_cache, const Target& target) {
  const int64_t num_tokens = key.size(0);
  const int64_t num_kv_heads = key.size(1);
  const int64_t head_size = key.size(2);
  if (num_tokens == 0 || num_kv_heads * head_size == 0) return;
  const c10::cuda::CUDAGuard device_guard(key.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int width = static_cast<int>(num_kv_heads * head_size);
  const int threads = width < 512 ? ((width + 31) / 32) * 32 : 512;
  PYLLM_DISPATCH_FLOATING_TYPES(key.scalar_type(), "write_kv", [&] {
    write_kv_kernel<device_t<scalar_t>, Target><<<num_tokens, threads, 0, stream>>>(
        device_ptr<scalar_t>(key), device_ptr<scalar_t>(value), device_ptr<scalar_t>(key_cache),
        device_ptr<scalar_t>(value_cache), target, key.stride(0), value.stride(0),
        static_cast<int>(num_kv_heads), static_cast<int>(head_size));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Writes into a float cache as stored, or into an int8 one quantized.
template <typename Target>
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
              at::Tensor& value_cache, const std::optional<at::Tensor>& k_scale,
              const std::optional<at::Tensor>& v_scale, const Target& target) {
  if (key_cache.scalar_type() == at::kChar) {
    launch_write_kv_int8(key, value, key_cache, value_cache, *k_scale, *v_scale, target);
  } else {
    launch_write_kv(key, value, key_cache, value_cache, target);
  }
}

// Grid (pair, layer): copies one whole block of one layer's key and value cache,
// 16 bytes at a time (a block is num_kv_heads * head_size * block_size
// elements, a multiple of 16 bytes since head_size is a multiple of 16).
__global__ void copy_blocks_kernel(const int64_t* __restrict__ cache_ptrs,
                                   const int64_t* __restrict__ block_mapping, int num_layers,
                                   int64_t vecs_per_block) {
  const int64_t pair = blockIdx.x;
  const int layer = blockIdx.y;
  const int64_t src = block_mapping[2 * pair];
  const int64_t dst = block_mapping[2 * pair + 1];
  for (int which = 0; which < 2; ++which) {  // key cache, then value cache
    uint4* cache = reinterpret_cast<uint4*>(cache_ptrs[which * num_layers + layer]);
    const uint4* from = cache + src * vecs_per_block;
    uint4* to = cache + dst * vecs_per_block;
    for (int64_t i = threadIdx.x; i < vecs_per_block; i += blockDim.x) to[i] = from[i];
  }
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const std::string& kv_cache_dtype,
                       const std::optional<at::Tensor>& k_scale,
                       const std::optional<at::Tensor>& v_scale) {
  const PagedKVShape shape = check_reshape_and_cache(key, value, key_cache, value_cache,
                                                     slot_mapping, kv_cache_dtype, k_scale, v_scale);
  check_cuda(key, "key");
  PagedWrite target{};
  target.slot_mapping = slot_mapping.data_ptr<int64_t>();
  target.block_size = static_cast<int>(shape.block_size);
  target.block_stride = shape.num_kv_heads * shape.head_size * shape.block_size;
  target.head_stride = shape.head_size * shape.block_size;
  target.scale_block_stride = shape.num_kv_heads * shape.block_size;
  write_kv(key, value, key_cache, value_cache, k_scale, v_scale, target);
}

void write_kv_contiguous(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                         at::Tensor& value_cache, const at::Tensor& token_slots,
                         const at::Tensor& positions, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale) {
  const ContiguousKVShape shape = check_write_kv_contiguous(key, value, key_cache, value_cache,
                                                            token_slots, positions, k_scale, v_scale);
  check_cuda(key, "key");
  // Slot and position values stay on the device (reading them here would cost a
  // sync): the kernel drops writes outside the views instead (ContiguousWrite).
  ContiguousWrite target{};
  target.token_slots = token_slots.data_ptr<int64_t>();
  target.positions = positions.data_ptr<int64_t>();
  target.num_slots = shape.num_slots;
  target.capacity = shape.num_tiles * kTokenTile;
  target.key_slot_stride = key_cache.stride(0);
  target.key_head_stride = key_cache.stride(1);
  target.key_tile_stride = key_cache.stride(2);
  target.value_slot_stride = value_cache.stride(0);
  target.value_head_stride = value_cache.stride(1);
  target.value_tile_stride = value_cache.stride(2);
  target.tile_size = static_cast<int>(kTokenTile);
  target.scale_head_stride = shape.num_tiles * kTokenTile;
  target.scale_slot_stride = shape.num_kv_heads * target.scale_head_stride;
  write_kv(key, value, key_cache, value_cache, k_scale, v_scale, target);
}

void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping) {
  check_copy_blocks(key_caches, value_caches, block_mapping);
  const at::Tensor& first = key_caches[0];
  check_cuda(first, "key_caches[0]");
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  const int64_t block_bytes = first.numel() / std::max<int64_t>(first.size(0), 1) *
                              static_cast<int64_t>(first.element_size());
  for (int64_t i = 0; i < num_layers; ++i) {
    check_aligned16(key_caches[i], "each cache");
    check_aligned16(value_caches[i], "each cache");
  }
  TORCH_CHECK(block_bytes % 16 == 0, "cache blocks of ", block_bytes,
              " bytes are not a multiple of 16");
  const int64_t num_pairs = block_mapping.size(0);
  if (num_pairs == 0 || block_bytes == 0) return;
  TORCH_CHECK(num_layers <= 65535, "copy_blocks handles at most 65535 layers, got ", num_layers);
  const int64_t num_blocks = first.size(0);
  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < 2 * num_pairs; ++i) {
    TORCH_CHECK(pairs[i] >= 0 && pairs[i] < num_blocks, "block_mapping holds block ", pairs[i],
                " outside [0, ", num_blocks, ")");
  }

  // One upload of [key cache pointers | value cache pointers | pairs], staged in
  // pinned memory so the copy is asynchronous; torch keeps the pinned buffer
  // alive until the copy has run.
  at::Tensor host = at::empty({2 * num_layers + 2 * num_pairs},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_layers; ++i) {
    h[i] = reinterpret_cast<int64_t>(key_caches[i].data_ptr());
    h[num_layers + i] = reinterpret_cast<int64_t>(value_caches[i].data_ptr());
  }
  std::copy(pairs, pairs + 2 * num_pairs, h + 2 * num_layers);

  const c10::cuda::CUDAGuard device_guard(first.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor device = host.to(first.device(), /*non_blocking=*/true);
  const int64_t* device_ptrs = device.data_ptr<int64_t>();
  copy_blocks_kernel<<<dim3(num_pairs, num_layers), 256, 0, stream>>>(
      device_ptrs, device_ptrs + 2 * num_layers, static_cast<int>(num_layers), block_bytes / 16);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  // Dispatched here when either side is on a GPU: CPU<->CUDA or CUDA<->CUDA.
  check_swap_blocks(src, dst, block_mapping);
  TORCH_CHECK((src.is_cuda() || src.is_cpu()) && (dst.is_cuda() || dst.is_cpu()),
              "swap_blocks copies between cpu and cuda, got ", src.device(), " and ",
              dst.device());
  const int64_t num_pairs = block_mapping.size(0);
  if (num_pairs == 0) return;
  const int64_t block_bytes =
      src.size(0) ? src.numel() / src.size(0) * static_cast<int64_t>(src.element_size()) : 0;

  cudaMemcpyKind kind;
  if (src.is_cuda() && dst.is_cuda()) {
    kind = cudaMemcpyDeviceToDevice;
  } else if (src.is_cuda()) {
    kind = cudaMemcpyDeviceToHost;
  } else {
    kind = cudaMemcpyHostToDevice;
  }
  // The stream of the GPU side (the destination's for device-to-device copies).
  const at::Device gpu = dst.is_cuda() ? dst.device() : src.device();
  const c10::cuda::CUDAGuard device_guard(gpu);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(gpu.index());

  const int64_t* pairs = block_mapping.data_ptr<int64_t>();
  const char* src_bytes = static_cast<const char*>(src.data_ptr());
  char* dst_bytes = static_cast<char*>(dst.data_ptr());
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t s = pairs[2 * i];
    const int64_t d = pairs[2 * i + 1];
    TORCH_CHECK(s >= 0 && s < src.size(0) && d >= 0 && d < dst.size(0), "block_mapping pair (",
                s, ", ", d, ") is outside src [0, ", src.size(0), ") / dst [0, ", dst.size(0),
                ")");
    C10_CUDA_CHECK(cudaMemcpyAsync(dst_bytes + d * block_bytes, src_bytes + s * block_bytes,
                                   block_bytes, kind, stream));
  }
}

}  // namespace pyllm::cuda
