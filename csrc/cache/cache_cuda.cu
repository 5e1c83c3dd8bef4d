// CUDA cache ops: write new keys/values into the paged cache or the contiguous
// arena views, copy blocks within each layer's cache (copy-on-write), and swap
// blocks between devices.
//
// write_kv_contiguous is UNVERIFIED ON A GPU: compiled and linked on a machine
// without one, never run.
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "../attention/kv_addressing.cuh"
#include "../cuda_utils.cuh"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "contiguous_views.h"

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

// key/value [num_tokens, num_kv_heads, head_size]: token stride free, heads packed.
void check_token_rows(const at::Tensor& key, const at::Tensor& value) {
  check_cuda(key, "key");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              "key/value must be [num_tokens, num_kv_heads, head_size] of one shape, got ",
              key.sizes(), " and ", value.sizes());
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->stride(2) == 1 && (key.size(1) == 1 || t->stride(1) == key.size(2)),
                "key/value must have each token's heads packed, got strides ", t->strides());
    TORCH_CHECK(t->device() == key.device() && t->scalar_type() == key.scalar_type(),
                "key/value must share a device and dtype");
  }
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
                       const std::string& kv_cache_dtype) {
  TORCH_CHECK(kv_cache_dtype == "auto", "kv_cache_dtype '", kv_cache_dtype,
              "' is not supported; only 'auto'");
  check_token_rows(key, value);
  const int64_t num_tokens = key.size(0);
  const int64_t num_kv_heads = key.size(1);
  const int64_t head_size = key.size(2);
  const int64_t x = 16 / static_cast<int64_t>(key.element_size());
  TORCH_CHECK(key_cache.dim() == 5 && value_cache.dim() == 4 && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && key_cache.device() == key.device() &&
                  value_cache.device() == key.device() &&
                  key_cache.scalar_type() == key.scalar_type() &&
                  value_cache.scalar_type() == key.scalar_type(),
              "key_cache/value_cache must be contiguous caches on the key's device and dtype");
  TORCH_CHECK(value_cache.size(1) == num_kv_heads && value_cache.size(2) == head_size &&
                  key_cache.size(0) == value_cache.size(0) &&
                  key_cache.size(1) == num_kv_heads && key_cache.size(2) * x == head_size &&
                  key_cache.size(3) == value_cache.size(3) && key_cache.size(4) == x,
              "caches ", key_cache.sizes(), " / ", value_cache.sizes(),
              " do not match key ", key.sizes());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == num_tokens &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.device() == key.device(),
              "slot_mapping must be [num_tokens] int64, contiguous, on ", key.device());
  PagedWrite target{};
  target.slot_mapping = slot_mapping.data_ptr<int64_t>();
  target.block_size = static_cast<int>(value_cache.size(3));
  target.block_stride = num_kv_heads * head_size * value_cache.size(3);
  target.head_stride = head_size * value_cache.size(3);
  launch_write_kv(key, value, key_cache, value_cache, target);
}

void write_kv_contiguous(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                         at::Tensor& value_cache, const at::Tensor& token_slots,
                         const at::Tensor& positions) {
  check_token_rows(key, value);
  const int64_t num_tokens = key.size(0);
  const int64_t num_kv_heads = key.size(1);
  const int64_t head_size = key.size(2);
  const int64_t x = 16 / static_cast<int64_t>(key.element_size());
  // The contiguous views (ops.h): dense inside a tile, free outer strides.
  TORCH_CHECK(key_cache.device() == key.device() && value_cache.device() == key.device() &&
                  key_cache.scalar_type() == key.scalar_type() &&
                  value_cache.scalar_type() == key.scalar_type(),
              "key_cache/value_cache must be on the key's device (", key.device(),
              ") with its dtype (", key.scalar_type(), ")");
  const auto [num_slots, num_tiles] = check_contiguous_views(
      "write_kv_contiguous", key_cache, value_cache, num_kv_heads, head_size, x);
  for (const at::Tensor* t : {&token_slots, &positions}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == num_tokens && t->scalar_type() == at::kLong &&
                    t->is_contiguous() && t->device() == key.device(),
                "token_slots/positions must be [", num_tokens, "] int64, contiguous, on ",
                key.device(), "; got ", t->scalar_type(), " ", t->sizes(), " on ", t->device());
  }
  // Slot and position values stay on the device (reading them here would cost a
  // sync): the kernel drops writes outside the views instead (ContiguousWrite).
  ContiguousWrite target{};
  target.token_slots = token_slots.data_ptr<int64_t>();
  target.positions = positions.data_ptr<int64_t>();
  target.num_slots = num_slots;
  target.capacity = num_tiles * kTokenTile;
  target.key_slot_stride = key_cache.stride(0);
  target.key_head_stride = key_cache.stride(1);
  target.key_tile_stride = key_cache.stride(2);
  target.value_slot_stride = value_cache.stride(0);
  target.value_head_stride = value_cache.stride(1);
  target.value_tile_stride = value_cache.stride(2);
  target.tile_size = static_cast<int>(kTokenTile);
  launch_write_kv(key, value, key_cache, value_cache, target);
}

void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping) {
  TORCH_CHECK(!key_caches.empty() && key_caches.size() == value_caches.size(),
              "key_caches and value_caches must hold the same, non-zero number of layers (got ",
              key_caches.size(), " and ", value_caches.size(), ")");
  TORCH_CHECK(block_mapping.device().is_cpu() && block_mapping.dim() == 2 &&
                  block_mapping.size(1) == 2 && block_mapping.scalar_type() == at::kLong,
              "block_mapping must be a CPU int64 tensor [num_pairs, 2], got ",
              block_mapping.sizes(), " on ", block_mapping.device());
  const at::Tensor& first = key_caches[0];
  check_cuda(first, "key_caches[0]");
  const int64_t num_layers = static_cast<int64_t>(key_caches.size());
  const int64_t block_bytes = first.numel() / std::max<int64_t>(first.size(0), 1) *
                              static_cast<int64_t>(first.element_size());
  for (int64_t i = 0; i < num_layers; ++i) {
    for (const at::Tensor* t : {&key_caches[i], &value_caches[i]}) {
      TORCH_CHECK(t->device() == first.device() && t->scalar_type() == first.scalar_type() &&
                      t->is_contiguous() && t->dim() >= 1 && t->size(0) == first.size(0) &&
                      t->numel() == first.numel(),
                  "layer ", i, ": every key/value cache must be contiguous, on ", first.device(),
                  ", with ", first.scalar_type(), " and ", first.sizes(), "'s block shape");
      check_aligned16(*t, "each cache");
    }
  }
  TORCH_CHECK(block_bytes % 16 == 0, "cache blocks of ", block_bytes,
              " bytes are not a multiple of 16");
  const int64_t num_pairs = block_mapping.size(0);
  if (num_pairs == 0 || block_bytes == 0) return;
  TORCH_CHECK(num_layers <= 65535, "copy_blocks handles at most 65535 layers, got ", num_layers);
  const int64_t num_blocks = first.size(0);
  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();
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
  TORCH_CHECK(src.is_cuda() || dst.is_cuda(), "swap_blocks (CUDA): src or dst must be on CUDA");
  TORCH_CHECK((src.is_cuda() || src.is_cpu()) && (dst.is_cuda() || dst.is_cpu()),
              "swap_blocks: src/dst must be on cpu or cuda, got ", src.device(), " and ",
              dst.device());
  TORCH_CHECK(src.scalar_type() == dst.scalar_type() && src.is_contiguous() &&
                  dst.is_contiguous() && src.dim() >= 1 && dst.dim() == src.dim() &&
                  src.sizes().slice(1).equals(dst.sizes().slice(1)),
              "src ", src.sizes(), " and dst ", dst.sizes(),
              " must be contiguous caches of one dtype and block shape");
  TORCH_CHECK(block_mapping.device().is_cpu() && block_mapping.dim() == 2 &&
                  block_mapping.size(1) == 2 && block_mapping.scalar_type() == at::kLong,
              "block_mapping must be a CPU int64 tensor [num_pairs, 2], got ",
              block_mapping.sizes(), " on ", block_mapping.device());
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

  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();
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
