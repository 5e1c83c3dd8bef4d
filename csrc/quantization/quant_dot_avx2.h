// The AVX2 back end of quant_dot.h: 32-byte integer dot products, one group of 32
// weights at a time (vpdpbusd with AVX-VNNI, vpmaddubsw + vpmaddwd without).
#pragma once

#include "quant_groups_avx2.h"

namespace pyllm::cpu {
namespace {

// 16-bit products summed in pairs and scaled: acc + sum over pairs of p * scale.
inline __m256i madd_scaled(__m256i acc, __m256i p, __m256i scale) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, p, scale);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, p, scale);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale));
#endif
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The K formats (see quant_dot.h), one 32-byte group at a time. A block's eight groups
// go to several integer sums per row (four at one input row, two at two), so that
// independent multiply-add chains are in flight: one chain was bound by its latency
// (Q4_K at 1 row streamed 20 GB/s of a 49 GB/s read). The offsets (scales x the
// inputs' sums) stay in vectors until the end: no horizontal sum per block.
template <int64_t T, int R>
void kquant_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
                 int64_t K, float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  using F = Format<T>;
  constexpr int C = R == 1 ? 4 : R == 2 ? 2 : 1;  // integer sums per row
  const int64_t blocks = K / 256;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[R], offset[R];
    for (int r = 0; r < R; ++r) acc[r] = offset[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * F::kBytes;
      prefetch_ahead<F::kBytes>(blk);
      // Per 16 values: the integer scale (offsets use them against the inputs' sums).
      __m256i scale16;
      uint64_t scales = 0;
      float d, dmin = 0.0f;
      if constexpr (T == kQ6_K) {
        d = half_at(blk + F::kD);
        scale16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + F::kScales)));
      } else {
        const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(blk)));
        d = _mm_cvtss_f32(dd);
        dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
        uint64_t mins;
        k_scales_mins(blk + F::kScales, scales, mins);
        // Each group's min for both its halves: the offsets' integer weights per 16.
        const __m128i m8 = _mm_cvtsi64_si128(static_cast<int64_t>(mins));
        scale16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
      }
      __m256i iacc[C][R];
      for (int c = 0; c < C; ++c) {
        for (int r = 0; r < R; ++r) iacc[c][r] = _mm256_setzero_si256();
      }
      for (int g = 0; g < 8; ++g) {
        const __m256i u = group_vector<T>(blk, g);
        // Pair sums 0-7 are the group's first 16 values, 8-15 its second.
        __m256i scale;
        if constexpr (T == kQ6_K) {
          const auto* sc = reinterpret_cast<const int8_t*>(blk + F::kScales);
          scale = _mm256_set_m128i(_mm_set1_epi16(sc[2 * g + 1]), _mm_set1_epi16(sc[2 * g]));
        } else {
          scale = _mm256_set1_epi16(static_cast<int16_t>((scales >> (8 * g)) & 0xFF));
        }
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(x.q_row(m0 + r) + b * 256 + g * 32));
          iacc[g % C][r] = madd_scaled(iacc[g % C][r], _mm256_maddubs_epi16(u, xv), scale);
        }
      }
      const float off_scale = T == kQ6_K ? -32.0f * d : -dmin;
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const float dx = x.d[m * blocks + b];
        const __m256i is =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.isum_row(m) + 16 * b));
        const __m256 low = _mm256_cvtepi32_ps(_mm256_madd_epi16(scale16, is));
        offset[r] = _mm256_fmadd_ps(low, _mm256_set1_ps(off_scale * dx), offset[r]);
        __m256i sum = iacc[0][r];
        for (int c = 1; c < C; ++c) sum = _mm256_add_epi32(sum, iacc[c][r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * dx), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride + n] = hsum(acc[r]) + hsum(offset[r]);
  }
}

// Output columns [n0, n1) for input rows [m0, m0 + R). Blocks of 256 (K-quants)
// take kquant_rows; blocks of 32 alternate between two sets of sums, so that two
// multiply-add chains are in flight, and their offsets (b * dx * sum(qx)) go per
// block, one scalar per row.
template <int64_t T, int R>
void dot_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0, int64_t K,
              float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  using F = Format<T>;
  if constexpr (F::kGroups == 8) {
    kquant_rows<T, R>(w, row_bytes, x, m0, K, out, out_stride, n0, n1);
  } else {
    static_assert(F::kGroups == 1, "blocks of 32 are one group");
    const int64_t blocks = K / F::kBlock;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
      __m256 acc[2][R];
      float offset[2][R];
      for (int r = 0; r < R; ++r) {
        acc[0][r] = acc[1][r] = _mm256_setzero_ps();
        offset[0][r] = offset[1][r] = 0.0f;
      }
      // Within a block of 32 both halves share a and b: b * dx * (sum of both halves).
      auto block = [&](int64_t b, int set) {
        float a[2], off[2];
        const uint8_t* blk = row + b * F::kBytes;
        prefetch_ahead<F::kBytes>(blk);
        F::scales(blk, a, off);
        group_step<T, R>(group_vector<T>(blk, 0), a[0], a[1], x, m0, b, acc[set]);
        if constexpr (!F::kSigned) {
          for (int r = 0; r < R; ++r) {
            const float* s = x.s_row(m0 + r) + 2 * b;
            offset[set][r] += off[0] * (s[0] + s[1]);
          }
        }
      };
      int64_t b = 0;
      for (; b + 2 <= blocks; b += 2) {
        block(b, 0);
        block(b + 1, 1);
      }
      if (b < blocks) block(b, 0);
      for (int r = 0; r < R; ++r) {
        out[r * out_stride + n] =
            hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + (offset[0][r] + offset[1][r]);
      }
    }
  }
}

}  // namespace
}  // namespace pyllm::cpu
