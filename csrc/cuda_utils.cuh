// Device helpers shared by pyllm's CUDA kernels: the device type of each
// supported dtype, float conversions (all arithmetic runs in float32), 16-byte
// vector loads, warp/block reductions, and the host-side launch plumbing.
//
// Only c10/cuda headers are used on purpose: ATen/cuda/CUDAContext.h pulls in
// cuBLAS/cuSPARSE headers that a bare CUDA toolkit may lack, and compiles far
// slower.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace pyllm::cuda {

// ---------------------------------------------------------------------------
// dtype mapping: at::Half / at::BFloat16 have the same bits as __half /
// __nv_bfloat16, so tensor data is reinterpreted, never converted.

template <typename T>
struct DeviceType {
  using type = T;
};
template <>
struct DeviceType<c10::Half> {
  using type = __half;
};
template <>
struct DeviceType<c10::BFloat16> {
  using type = __nv_bfloat16;
};

template <typename scalar_t>
using device_t = typename DeviceType<scalar_t>::type;

template <typename scalar_t>
inline device_t<scalar_t>* device_ptr(at::Tensor& t) {
  return reinterpret_cast<device_t<scalar_t>*>(t.data_ptr<scalar_t>());
}
template <typename scalar_t>
inline const device_t<scalar_t>* device_ptr(const at::Tensor& t) {
  return reinterpret_cast<const device_t<scalar_t>*>(t.data_ptr<scalar_t>());
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// ---------------------------------------------------------------------------
// 16-byte vectors. The key cache stores each head in groups of x = 16 / sizeof(T)
// elements, and the value cache holds block_size consecutive tokens per head
// dimension, so one uint4 load moves a whole x-group (or x tokens) at once.

template <typename T>
struct Vec16 {
  static constexpr int kSize = 16 / sizeof(T);  // elements per 16 bytes ("x")
};

// Unpacks one 16-byte chunk of T into kSize floats.
__device__ __forceinline__ void unpack16(const uint4& raw, float (&out)[4]) {
  out[0] = __uint_as_float(raw.x);
  out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z);
  out[3] = __uint_as_float(raw.w);
}

__device__ __forceinline__ float2 unpack_pair(uint32_t bits, __half) {
  __half2 h;
  *reinterpret_cast<uint32_t*>(&h) = bits;
  return __half22float2(h);
}
__device__ __forceinline__ float2 unpack_pair(uint32_t bits, __nv_bfloat16) {
  __nv_bfloat162 h;
  *reinterpret_cast<uint32_t*>(&h) = bits;
  return __bfloat1622float2(h);
}

template <typename T>
__device__ __forceinline__ void unpack16(const uint4& raw, float (&out)[8]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = unpack_pair(words[i], T());
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// Raw 16-byte load through the read-only path; `ptr` must be 16-byte aligned.
template <typename T>
__device__ __forceinline__ uint4 load16(const T* ptr) {
  return __ldg(reinterpret_cast<const uint4*>(ptr));
}

// One call site for every dtype: float has 4 elements per chunk, 16-bit types 8.
template <typename T>
__device__ __forceinline__ void to_floats(const uint4& raw, float (&out)[Vec16<T>::kSize]) {
  if constexpr (sizeof(T) == 4) {
    unpack16(raw, out);
  } else {
    unpack16<T>(raw, out);
  }
}

template <typename T>
__device__ __forceinline__ void load16_as_float(const T* ptr, float (&out)[Vec16<T>::kSize]) {
  to_floats<T>(load16(ptr), out);
}

// ---------------------------------------------------------------------------
// Reductions.

constexpr int kWarpSize = 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, mask);
  }
  return v;
}

// Sum over the whole thread block; every thread gets the result. `scratch` holds
// one float per warp. Ends with a barrier so scratch may be reused at once.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < num_warps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// ---------------------------------------------------------------------------
// Rows of a token-major tensor whose first dimension may be strided (a view of
// a wider tensor) while everything after it is packed: row r of width `width`
// starts at (r / rows_per_outer) * outer_stride + (r % rows_per_outer) * width.

struct RowLayout {
  int64_t rows_per_outer;
  int64_t outer_stride;
  int64_t width;

  __device__ __forceinline__ int64_t offset(int64_t row) const {
    return (row / rows_per_outer) * outer_stride + (row % rows_per_outer) * width;
  }
};

inline RowLayout row_layout(const at::Tensor& t, int64_t width) {
  const int64_t rows = width ? t.numel() / width : 0;
  if (t.dim() <= 1 || t.size(0) == 0) return RowLayout{rows > 0 ? rows : 1, 0, width};
  return RowLayout{rows / t.size(0) > 0 ? rows / t.size(0) : 1, t.stride(0), width};
}

// ---------------------------------------------------------------------------
// Host-side checks.

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
}

// Kernels load caches in 16-byte vectors.
inline void check_aligned16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must start on a 16-byte boundary (it is a view at an odd offset)");
}

inline unsigned int ceil_div(int64_t a, int64_t b) {
  return static_cast<unsigned int>((a + b - 1) / b);
}

}  // namespace pyllm::cuda
