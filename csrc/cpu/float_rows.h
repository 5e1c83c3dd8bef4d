// Row conversions between float32 and the storage dtypes (float, bf16, fp16),
// shared by the CPU kernels that stage rows through float buffers.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pyllm::cpu {

// ---------------------------------------------------------------------------
// Widening to float and rounding back, written so the compiler vectorizes them
// (c10's scalar conversions do not vectorize).

inline void load_floats(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void load_floats(const c10::BFloat16* src, float* dst, int64_t n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(uint32_t{bits[i]} << 16);
}

inline void load_floats(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void store_floats(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void store_floats(const float* src, c10::BFloat16* dst, int64_t n) {
  auto* bits = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    // Round to nearest, ties to even; NaN stays a quiet NaN.
    const uint32_t u = std::bit_cast<uint32_t>(src[i]);
    const auto rounded = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    bits[i] = src[i] != src[i] ? uint16_t{0x7fc0} : rounded;
  }
}

inline void store_floats(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = c10::Half(src[i]);
}

}  // namespace pyllm::cpu
