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

// Lane i: the sum of the eight int32 lanes of p[i]. Unpacks and adds (21 one-uop
// instructions for eight blocks), so that the float conversion and scaling run once
// per eight blocks, not once per block.
inline __m256i block_sums(const __m256i (&p)[8]) {
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    // Per 128-bit half: (a0 + a2, b0 + b2, a1 + a3, b1 + b3).
    const __m256i a = p[2 * i], b = p[2 * i + 1];
    q[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
  }
  // Per 128-bit half, the four blocks' sums of that half.
  const __m256i lo = _mm256_add_epi32(_mm256_unpacklo_epi64(q[0], q[1]),
                                      _mm256_unpackhi_epi64(q[0], q[1]));
  const __m256i hi = _mm256_add_epi32(_mm256_unpacklo_epi64(q[2], q[3]),
                                      _mm256_unpackhi_epi64(q[2], q[3]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                          _mm256_permute2x128_si256(lo, hi, 0x31));
}

// Lane i: s[2i] + s[2i + 1] (a block's two sums per 16 values).
inline __m256 pair_sums(const float* s) {
  const __m256 h = _mm256_hadd_ps(_mm256_loadu_ps(s), _mm256_loadu_ps(s + 8));
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0xD8));
}

// Blocks of 32, eight at a time: the weights' integers and scales are decoded once
// for all R rows; per row, the eight blocks' integer products are summed across lanes
// into one vector (block_sums) and scaled by the weights' and the inputs' scales in
// one multiply-add. A float conversion, scale broadcast and multiply-add per block and
// row had been about 45% of the time at 8-32 rows (Q8_0, measured by leaving them
// out). The offsets of unsigned formats (b * dx * sum(qx)) go the same way.
template <int64_t T, int R>
void block32_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
                  int64_t K, float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  using F = Format<T>;
  const int64_t blocks = K / F::kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[R], offset[R];
    for (int r = 0; r < R; ++r) acc[r] = offset[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8) {
      alignas(32) float a8[8], off8[8];
      __m256i u[8], mag[8];  // mag: |u| for the signed formats' dot_s8_s8
      for (int i = 0; i < 8; ++i) {
        const uint8_t* blk = row + (b + i) * F::kBytes;
        prefetch_ahead<F::kBytes>(blk);
        float a[2], off[2];
        F::scales(blk, a, off);
        a8[i] = a[0];
        off8[i] = off[0];
        u[i] = group_vector<T>(blk, 0);
        mag[i] = F::kSigned ? _mm256_sign_epi8(u[i], u[i]) : u[i];
      }
      const __m256 wa = _mm256_load_ps(a8);
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const int8_t* q = x.q_row(m) + b * 32;
        __m256i p[8];
        for (int i = 0; i < 8; ++i) {
          __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * i));
          if constexpr (F::kSigned) xv = _mm256_sign_epi8(xv, u[i]);  // dot_s8_s8, |u| hoisted
          p[i] = dot_u8_s8(mag[i], xv);
        }
        const __m256 dx = x.span_shift == 0 ? _mm256_loadu_ps(&x.d[m * (K / 32) + b])
                                            : _mm256_set1_ps(x.dx(m, b));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums(p)), _mm256_mul_ps(wa, dx),
                                 acc[r]);
        if constexpr (!F::kSigned) {
          offset[r] = _mm256_fmadd_ps(_mm256_load_ps(off8), pair_sums(x.s_row(m) + 2 * b),
                                      offset[r]);
        }
      }
    }
    float tail[R] = {};
    for (; b < blocks; ++b) {  // fewer than eight blocks left
      float a[2], off[2];
      const uint8_t* blk = row + b * F::kBytes;
      F::scales(blk, a, off);
      group_step<T, R>(group_vector<T>(blk, 0), a[0], a[1], x, m0, b, acc);
      if constexpr (!F::kSigned) {
        for (int r = 0; r < R; ++r) {
          const float* s = x.s_row(m0 + r) + 2 * b;
          tail[r] += off[0] * (s[0] + s[1]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      out[r * out_stride + n] = hsum(_mm256_add_ps(acc[r], offset[r])) + tail[r];
    }
  }
}

// Output columns [n0, n1) for input rows [m0, m0 + R): blocks of 256 (K-quants) by
// kquant_rows, blocks of 32 by block32_rows.
template <int64_t T, int R>
void dot_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0, int64_t K,
              float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  if constexpr (Format<T>::kGroups == 8) {
    kquant_rows<T, R>(w, row_bytes, x, m0, K, out, out_stride, n0, n1);
  } else {
    static_assert(Format<T>::kGroups == 1, "blocks of 32 are one group");
    block32_rows<T, R>(w, row_bytes, x, m0, K, out, out_stride, n0, n1);
  }
}

}  // namespace
}  // namespace pyllm::cpu
