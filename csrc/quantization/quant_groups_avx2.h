// One group of 32 weights' integers as a 32-byte vector, per format, and the
// 32-byte dot products over it: what the AVX2 and AVX-512 back ends of quant_dot.h
// share (the AVX-512 one puts two such groups in one 64-byte vector).
#pragma once

#include <immintrin.h>

#include "quant_dot.h"

namespace pyllm::cpu {
namespace {

inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i high_nibbles(__m256i v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}
// 16 bytes of nibbles -> the 16 low nibbles, then the 16 high ones.
inline __m256i split_nibbles(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}
// Bit l of bits -> 0x10 in byte l (0 elsewhere).
inline __m256i bits_to_fifth_bit(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                       3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// MXFP4 codes (one per byte) -> their int8 values (kMxfp4Values): a byte shuffle
// looks each up in the 16-entry table, held once in each 128-bit lane.
inline __m256i mxfp4_values(__m256i codes) {
  const __m256i table = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
  return _mm256_shuffle_epi8(table, codes);
}

template <int64_t T>
inline __m256i group_vector(const uint8_t* blk, int g) {
  using F = Format<T>;
  if constexpr (T == kQ4_0 || T == kQ4_1) {
    return split_nibbles(F::nibbles(blk, g));
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    return _mm256_or_si256(split_nibbles(F::nibbles(blk, g)),
                           bits_to_fifth_bit(F::high_bits(blk)));
  } else if constexpr (T == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(F::values(blk, g)));
  } else if constexpr (T == kMXFP4) {
    return mxfp4_values(split_nibbles(F::nibbles(blk, g)));
  } else if constexpr (T == kQ4_K) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(F::nibble_bytes(blk, g)));
    return g % 2 ? high_nibbles(v) : low_nibbles(v);
  } else if constexpr (T == kQ5_K) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(F::nibble_bytes(blk, g)));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(F::high_bytes(blk)));
    const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << g));
    const __m256i fifth =
        _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(g % 2 ? high_nibbles(v) : low_nibbles(v), fifth);
  } else {
    static_assert(T == kQ6_K);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(F::low_bytes(blk, g)));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(F::high_bytes(blk, g)));
    // Bits 2j, 2j + 1 of each byte to bits 4, 5 (16-bit shifts; the mask drops
    // what crossed from the neighbouring byte).
    const __m256i top = _mm256_and_si256(
        _mm256_slli_epi16(_mm256_srli_epi16(h, F::high_shift(g)), 4), _mm256_set1_epi8(0x30));
    return _mm256_or_si256(F::upper_nibble(g) ? high_nibbles(v) : low_nibbles(v), top);
  }
}

// Eight int32 lanes, lane i = sum of products of bytes [4i, 4i + 4): u unsigned
// (< 64, so vpmaddubsw's 16-bit pair sums cannot saturate), x signed.
inline __m256i dot_u8_s8(__m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

// The same for signed w (Q8_0, MXFP4): |w| times x with w's sign (x is never -128).
inline __m256i dot_s8_s8(__m256i w, __m256i x) {
  return dot_u8_s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Multiply-adds one group of 32 weights (integers u, scales a0, a1 of its halves)
// into the sums of R input rows; the offsets are added per block (dot_rows).
template <int64_t T, int R>
inline void group_step(__m256i u, float a0, float a1, const QuantizedRows& x, int64_t m0,
                       int64_t group, __m256* acc) {
  using F = Format<T>;
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    const __m256i xv =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q_row(m) + group * 32));
    const __m256i dot = F::kSigned ? dot_s8_s8(u, xv) : dot_u8_s8(u, xv);
    const float dx = x.dx(m, group);
    // Lanes 0-3 sum the first half of the group, lanes 4-7 the second.
    const __m256 scale = T == kQ6_K
                             ? _mm256_set_m128(_mm_set1_ps(a1 * dx), _mm_set1_ps(a0 * dx))
                             : _mm256_set1_ps(a0 * dx);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
  }
}

}  // namespace
}  // namespace pyllm::cpu
