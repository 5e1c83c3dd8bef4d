// Loading cache chunks as floats for every cache element type the kernels read:
// the float types (16-byte chunks, cuda_utils.cuh) and the int8 KV cache's int8
// (16 elements per 16-byte chunk, or 8-byte chunks of 8 where a value row of a
// block of 8 tokens is only 8 bytes). Kept apart from cuda_utils.cuh, which every
// CUDA file includes, since only the attention and cache kernels read int8.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../cuda_utils.cuh"

namespace pyllm::cuda {

// N int8 elements (4 per 32-bit word) as floats.
template <int N>
__device__ __forceinline__ void int8_to_floats(const uint32_t (&words)[N / 4], float (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    out[i] = static_cast<float>(static_cast<int8_t>((words[i / 4] >> (8 * (i % 4))) & 0xffu));
  }
}

// A raw chunk of N elements of T: 16 bytes, or 8 for int8 chunks of 8.
template <typename T, int N>
using Chunk = std::conditional_t<N * sizeof(T) == 16, uint4, uint2>;

template <typename T, int N>
__device__ __forceinline__ Chunk<T, N> load_chunk(const T* ptr) {
  static_assert(N * sizeof(T) == 16 || (sizeof(T) == 1 && N == 8), "a chunk is 16 or 8 bytes");
  return __ldg(reinterpret_cast<const Chunk<T, N>*>(ptr));
}

template <typename T, int N>
__device__ __forceinline__ void chunk_to_floats(const Chunk<T, N>& raw, float (&out)[N]) {
  if constexpr (sizeof(T) == 1 && N == 16) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    int8_to_floats<16>(words, out);
  } else if constexpr (sizeof(T) == 1) {
    const uint32_t words[2] = {raw.x, raw.y};
    int8_to_floats<8>(words, out);
  } else {
    to_floats<T>(raw, out);
  }
}

// N consecutive cache elements as floats; ptr aligned to the chunk's bytes.
template <typename T, int N>
__device__ __forceinline__ void load_as_float(const T* ptr, float (&out)[N]) {
  chunk_to_floats<T, N>(load_chunk<T, N>(ptr), out);
}

}  // namespace pyllm::cuda
