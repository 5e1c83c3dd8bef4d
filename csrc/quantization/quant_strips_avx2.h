// Strips (quant_strips.h) under AVX2: each 64-byte vector of a strip is read as two
// 32-byte halves, columns 0-7 and 8-15, with one column in each 32-bit lane, so no
// sum crosses lanes here either. vpmaddubsw multiplies a lane's 4 weights by 4
// broadcast int8 inputs into two int16 sums; those add up in int16 over a sub-block
// (the bounds are noted where they are used) and one vpmaddwd by the sub-block's
// scale, or by ones, ends them in int32. The integer sums are the AVX-512 kernels'
// and the float steps are taken in the same order, so both give the same results.
#pragma once

#include <cstring>

#include "quant_strips.h"

namespace pyllm::cpu {
namespace {

constexpr int kHalves = 2;  // 32-byte halves per 64-byte vector
constexpr int kStripHalf = quant::kStripColumns / kHalves;  // columns per half

inline __m256i strip_half(const uint8_t* p, int h) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Words (a, b) per lane to (a, a), or (b, b) where odd: vpmaddwd's scale operand.
inline __m256i spread_word(__m256i words, int odd) {
  const __m256i even_words = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                              0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
  const __m256i odd_words = _mm256_add_epi8(even_words, _mm256_set1_epi8(2));
  return _mm256_shuffle_epi8(words, odd ? odd_words : even_words);
}

inline __m256 half_floats(const uint8_t* p) {  // 8 fp16 values
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 E8M0 bytes as floats 2^(e - 128), as quant_strips_avx512.h's e8m0_halves.
inline __m256 e8m0_eight(const uint8_t* p) {
  const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small));
}

// Fifth bits (Q5_0, Q5_1, Q5_K) into a vector's two nibble halves: bit 0 of each byte
// of `bits` to bit 4 of wl's, bit 1 to wh's; then on to the next vector's bits.
inline void merge_fifth_bits(__m256i& wl, __m256i& wh, __m256i& bits) {
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  wl = _mm256_or_si256(wl, _mm256_and_si256(_mm256_slli_epi32(bits, 4), bit4));
  wh = _mm256_or_si256(wh, _mm256_and_si256(_mm256_slli_epi32(bits, 3), bit4));
  bits = _mm256_srli_epi32(bits, 2);
}

// The passes below take input rows [m0, m0 + R) over both halves of one strip (its
// columns from n), all blocks, into out: the strip streams once. (One half a pass,
// the second reading the strip from cache, kept fewer sums in the 16 vector
// registers but took 1.2x as long at 2-8 rows: TinyLlama Q4_K_M's projections.)

template <typename V, int R>
inline void set_zero(V (&v)[R][kHalves]) {
  for (auto& row : v) {
    for (V& x : row) x = V{};
  }
}

// Row r's sums of the strip's 16 columns to out[r * out_stride + n, + 16).
template <int R>
inline void store_strip(const __m256 (&acc)[R][kHalves], float* out, int64_t out_stride,
                        int64_t n) {
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < kHalves; ++i) {
      _mm256_storeu_ps(out + r * out_stride + n + kStripHalf * i, acc[r][i]);
    }
  }
}

// Q4_K: per sub-block, 8 vpmaddubsw of 4-bit weights (|sum| <= 8 * 2 * 15 * 127 <
// 2^15) summed in int16 and scaled by one vpmaddwd. Q5_K: the fifth bits merged into
// the nibbles, and a vpmaddwd after every 4 vpmaddubsw (4 * 2 * 31 * 127 < 2^15).
template <int R, int64_t T = quant::kQ4_K>
inline void q4k_strips(const uint8_t* strip, const QuantizedRows& x, const int32_t* sums,
                       int64_t m0, int64_t blocks, float* out, int64_t out_stride, int64_t n,
                       const uint8_t* stop) {
  using S = quant::KStrip<T>;
  constexpr bool kFifth = T == quant::kQ5_K;
  constexpr int kFlush = kFifth ? 2 : 4;  // vectors per int16 run
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R][kHalves];
  set_zero(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = strip + b * S::kBytes;
    strip_prefetch<S::kBytes, R>(blk, stop);
    __m256i total[R][kHalves], mins[R][kHalves];
    set_zero(total);
    set_zero(mins);
    for (int p = 0; p < 4; ++p) {
      __m256i scale_words[kHalves];
      for (int i = 0; i < kHalves; ++i) {
        const __m256i bytes = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + S::kScales + 32 * p + 16 * i)));
        scale_words[i] = _mm256_and_si256(bytes, _mm256_set1_epi16(63));
        const __m256i high = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + S::kMinHigh + 16 * p + 8 * i)));
        const __m256i nibbles = _mm256_or_si256(
            _mm256_and_si256(high, _mm256_set1_epi32(0x0F)),
            _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(0xF0)), 12));
        const __m256i min_words =
            _mm256_or_si256(_mm256_srli_epi16(bytes, 6), _mm256_slli_epi16(nibbles, 2));
        for (int r = 0; r < R; ++r) {
          const __m256i pair = _mm256_set1_epi32(sums[(r * blocks + b) * 4 + p]);
          mins[r][i] = _mm256_add_epi32(mins[r][i], _mm256_madd_epi16(min_words, pair));
        }
      }
      for (int odd = 0; odd < 2; ++odd) {
        const int s = 2 * p + odd;
        __m256i part[R][kHalves], scale[kHalves], bits[kHalves] = {};
        set_zero(part);
        for (int i = 0; i < kHalves; ++i) {
          scale[i] = spread_word(scale_words[i], odd);
          if constexpr (kFifth) bits[i] = strip_half(blk + S::fifth(s), i);
        }
        for (int v = 0; v < 4; ++v) {
          __m256i xl[R], xh[R];
          for (int r = 0; r < R; ++r) {
            const int8_t* xq = x.q_row(m0 + r) + b * 256 + 32 * s + 8 * v;
            xl[r] = broadcast4(xq);
            xh[r] = broadcast4(xq + 4);
          }
          for (int i = 0; i < kHalves; ++i) {
            const __m256i wv = strip_half(blk + S::weights(s) + 64 * v, i);
            __m256i wl = _mm256_and_si256(wv, low);
            __m256i wh = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
            if constexpr (kFifth) merge_fifth_bits(wl, wh, bits[i]);
            for (int r = 0; r < R; ++r) {
              part[r][i] = _mm256_add_epi16(
                  part[r][i], _mm256_add_epi16(_mm256_maddubs_epi16(wl, xl[r]),
                                               _mm256_maddubs_epi16(wh, xh[r])));
              if (v % kFlush == kFlush - 1) {
                total[r][i] =
                    _mm256_add_epi32(total[r][i], _mm256_madd_epi16(part[r][i], scale[i]));
                part[r][i] = __m256i{};
              }
            }
          }
        }
      }
    }
    for (int i = 0; i < kHalves; ++i) {
      const __m256 d = half_floats(blk + S::kD + 16 * i);
      const __m256 dmin = half_floats(blk + S::kDmin + 16 * i);
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(x.d[(m0 + r) * blocks + b]);
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r][i]), _mm256_mul_ps(d, dx),
                                    acc[r][i]);
        acc[r][i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins[r][i]), _mm256_mul_ps(dmin, dx),
                                     acc[r][i]);
      }
    }
  }
  store_strip(acc, out, out_stride, n);
}

// Q6_K's four weight vectors of sub-block j's half h (quant_strips_avx512.h's
// q6_vectors): the nibbles OR the high 2 bits moved to bits 4 and 5.
inline void q6_half_vectors(const uint8_t* blk, int j, int h, __m256i (&q)[4]) {
  using S = quant::Q6KStrip;
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const __m256i w0 = strip_half(blk + S::low(j), h), w1 = strip_half(blk + S::low(j) + 64, h);
  const __m256i hv = strip_half(blk + S::high(j), h);
  q[0] = _mm256_or_si256(_mm256_and_si256(w0, low), _mm256_and_si256(_mm256_slli_epi32(hv, 4), top));
  q[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w0, 4), low),
                         _mm256_and_si256(_mm256_slli_epi32(hv, 2), top));
  q[2] = _mm256_or_si256(_mm256_and_si256(w1, low), _mm256_and_si256(hv, top));
  q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w1, 4), low),
                         _mm256_and_si256(_mm256_srli_epi32(hv, 2), top));
}

// Q6_K: 6-bit weights, so only two vpmaddubsw add up in int16 (2 * 2 * 63 * 127 <
// 2^15) before each vpmaddwd by the sub-block's scale; the -32 offset is the scales'
// vpmaddwd with the inputs' sums per 16, as on AVX-512.
template <int R>
inline void q6k_strips(const uint8_t* strip, const QuantizedRows& x, int64_t m0,
                       int64_t blocks, float* out, int64_t out_stride, int64_t n,
                       const uint8_t* stop) {
  using S = quant::Q6KStrip;
  __m256 acc[R][kHalves];
  set_zero(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = strip + b * S::kBytes;
    strip_prefetch<S::kBytes, R>(blk, stop);
    __m256i total[R][kHalves], offset[R][kHalves];
    set_zero(total);
    set_zero(offset);
    for (int p = 0; p < 8; ++p) {
      __m256i words[kHalves];
      for (int i = 0; i < kHalves; ++i) {
        words[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(blk + S::kScales + 32 * p + 16 * i)));
        for (int r = 0; r < R; ++r) {
          int32_t pair;  // the inputs' sums over sub-blocks 2p, 2p + 1 (int16 each)
          std::memcpy(&pair, x.isum_row(m0 + r) + 16 * b + 2 * p, 4);
          offset[r][i] = _mm256_add_epi32(
              offset[r][i], _mm256_madd_epi16(words[i], _mm256_set1_epi32(pair)));
        }
      }
      for (int odd = 0; odd < 2; ++odd) {
        const int j = 2 * p + odd;
        __m256i xv[R][4];
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q_row(m0 + r) + b * 256 + 16 * j;
          for (int v = 0; v < 4; ++v) xv[r][v] = broadcast4(xq + 4 * v);
        }
        for (int i = 0; i < kHalves; ++i) {
          __m256i q[4];
          q6_half_vectors(blk, j, i, q);
          const __m256i scale = spread_word(words[i], odd);
          for (int r = 0; r < R; ++r) {
            const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], xv[r][0]),
                                                 _mm256_maddubs_epi16(q[1], xv[r][1]));
            const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(q[2], xv[r][2]),
                                                 _mm256_maddubs_epi16(q[3], xv[r][3]));
            total[r][i] = _mm256_add_epi32(
                total[r][i], _mm256_add_epi32(_mm256_madd_epi16(p01, scale),
                                              _mm256_madd_epi16(p23, scale)));
          }
        }
      }
    }
    for (int i = 0; i < kHalves; ++i) {
      const __m256 d = half_floats(blk + S::kD + 16 * i);
      for (int r = 0; r < R; ++r) {
        const __m256i sum = _mm256_sub_epi32(total[r][i], _mm256_slli_epi32(offset[r][i], 5));
        const __m256 dx = _mm256_set1_ps(x.d[(m0 + r) * blocks + b]);
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, dx), acc[r][i]);
      }
    }
  }
  store_strip(acc, out, out_stride, n);
}

// A unit's integer sums per row and half for Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 (4
// vectors of 8 nibbles a lane; MXFP4's looked up as values + 12 in `table`; Q5_0's and
// Q5_1's fifth bits, at `fifth`, merged as Q5_K's). Products add up in int16 over 8
// vpmaddubsw for 4-bit weights (8 * 2 * 15 * 127 < 2^15), over 4 for MXFP4's values
// up to 24 and 5-bit weights.
template <int64_t T, int R>
inline void nibble_unit_sums(const uint8_t* w, const QuantizedRows& x, int64_t m0, int64_t k,
                             __m256i table, __m256i (&sum)[R][kHalves],
                             const uint8_t* fifth = nullptr) {
  constexpr bool kFifth = quant::has_fifth_bits(T);
  constexpr int kFlush = T == quant::kMXFP4 || kFifth ? 2 : 4;  // vectors per int16 run
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i part[R][kHalves], bits[kHalves] = {};
  if constexpr (kFifth) {
    for (int i = 0; i < kHalves; ++i) bits[i] = strip_half(fifth, i);
  }
  for (int v = 0; v < 4; ++v) {
    __m256i xl[R], xh[R];
    for (int r = 0; r < R; ++r) {
      xl[r] = broadcast4(x.q_row(m0 + r) + k + 8 * v);
      xh[r] = broadcast4(x.q_row(m0 + r) + k + 8 * v + 4);
    }
    for (int i = 0; i < kHalves; ++i) {
      const __m256i wv = strip_half(w + 64 * v, i);
      __m256i wl = _mm256_and_si256(wv, low), wh = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
      if constexpr (T == quant::kMXFP4) {
        wl = _mm256_shuffle_epi8(table, wl);
        wh = _mm256_shuffle_epi8(table, wh);
      }
      if constexpr (kFifth) merge_fifth_bits(wl, wh, bits[i]);
      for (int r = 0; r < R; ++r) {
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(wl, xl[r]),
                                           _mm256_maddubs_epi16(wh, xh[r]));
        part[r][i] = v % kFlush == 0 ? p : _mm256_add_epi16(part[r][i], p);
        if (v % kFlush == kFlush - 1) {
          sum[r][i] = _mm256_add_epi32(sum[r][i], _mm256_madd_epi16(part[r][i], ones));
        }
      }
    }
  }
}

// The same for Q8_0's 8 vectors of 4 weights a lane, stored + 128: each vpmaddubsw
// takes |w| against the inputs with w's sign (inputs are never -128, so neither
// side overflows) and goes to int32 at once. The sums are of w, not of w + 128.
template <int R>
inline void q8_unit_sums(const uint8_t* w, const QuantizedRows& x, int64_t m0, int64_t k,
                         __m256i (&sum)[R][kHalves]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int v = 0; v < 8; ++v) {
    __m256i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = broadcast4(x.q_row(m0 + r) + k + 4 * v);
    for (int i = 0; i < kHalves; ++i) {
      const __m256i wv = _mm256_xor_si256(strip_half(w + 64 * v, i), _mm256_set1_epi8(-128));
      const __m256i magnitude = _mm256_sign_epi8(wv, wv);
      for (int r = 0; r < R; ++r) {
        const __m256i p = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv[r], wv));
        sum[r][i] = _mm256_add_epi32(sum[r][i], _mm256_madd_epi16(p, ones));
      }
    }
  }
}

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or MXFP4: per unit of 32, the sums less the weights'
// offset times the inputs' sum (Q4_0: 8, Q5_0: 16, MXFP4: 12), scaled; Q4_1 and Q5_1
// plus m times the inputs' sum.
template <int64_t T, int R>
inline void strip32_strips(const uint8_t* strip, const QuantizedRows& x, int64_t m0,
                           int64_t blocks, float* out, int64_t out_stride, int64_t n,
                           const uint8_t* stop) {
  using S = quant::Strip32<T>;
  __m256i table = _mm256_setzero_si256();
  if constexpr (T == quant::kMXFP4) {
    alignas(16) int8_t values[16];
    for (int c = 0; c < 16; ++c) values[c] = static_cast<int8_t>(quant::kMxfp4Values[c] + 12);
    table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(values)));
  }
  __m256 acc[R][kHalves];
  set_zero(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* unit = strip + b * S::kBytes;
    strip_prefetch<S::kBytes, R>(unit, stop);
    __m256i sum[R][kHalves];
    set_zero(sum);
    if constexpr (T == quant::kQ8_0) {
      q8_unit_sums<R>(unit + S::kQs, x, m0, 32 * b, sum);
    } else {
      const uint8_t* fifth = nullptr;
      if constexpr (quant::has_fifth_bits(T)) fifth = unit + S::kQh;
      nibble_unit_sums<T, R>(unit + S::kQs, x, m0, 32 * b, table, sum, fifth);
    }
    for (int i = 0; i < kHalves; ++i) {
      const __m256 d = T == quant::kMXFP4 ? e8m0_eight(unit + S::kD + 8 * i)
                                          : half_floats(unit + S::kD + 16 * i);
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        __m256i total = sum[r][i];
        if constexpr (T == quant::kQ4_0 || T == quant::kQ5_0 || T == quant::kMXFP4) {
          const int16_t* isum = x.isum_row(m) + 2 * b;
          const int offset = T == quant::kQ4_0 ? 8 : T == quant::kQ5_0 ? 16 : 12;
          total = _mm256_sub_epi32(total, _mm256_set1_epi32(offset * (isum[0] + isum[1])));
        }
        const __m256 dx = _mm256_set1_ps(x.d[m * blocks + b]);
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, dx), acc[r][i]);
        if constexpr (quant::has_block_min(T)) {
          const float* s = x.s_row(m) + 2 * b;
          acc[r][i] = _mm256_fmadd_ps(half_floats(unit + S::kM + 16 * i),
                                      _mm256_set1_ps(s[0] + s[1]), acc[r][i]);
        }
      }
    }
  }
  store_strip(acc, out, out_stride, n);
}

// Columns [n0, n1) (whole strips) of strips of type T for input rows [m0, m0 + R);
// nothing at or past `stop` is prefetched (null: no bound). Rows go two at a time
// (four at a time measured the same).
template <int64_t T, int R>
void strip_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
                int64_t K, float* out, int64_t out_stride, int64_t n0, int64_t n1,
                const uint8_t* stop = nullptr) {
  if constexpr (R > 2) {
    strip_rows<T, 2>(w, row_bytes, x, m0, K, out, out_stride, n0, n1, stop);
    strip_rows<T, R - 2>(w, row_bytes, x, m0 + 2, K, out + 2 * out_stride, out_stride, n0, n1,
                         stop);
  } else {
    constexpr bool kMins = T == quant::kQ4_K || T == quant::kQ5_K;
    const int32_t* sums = kMins ? strip_input_sums(x, m0, R, K / 256) : nullptr;
    for (int64_t n = n0; n < n1; n += quant::kStripColumns) {
      const uint8_t* strip = w + n * row_bytes;
      if constexpr (kMins) {
        q4k_strips<R, T>(strip, x, sums, m0, K / 256, out, out_stride, n, stop);
      } else if constexpr (T == quant::kQ6_K) {
        q6k_strips<R>(strip, x, m0, K / 256, out, out_stride, n, stop);
      } else {
        strip32_strips<T, R>(strip, x, m0, K / 32, out, out_stride, n, stop);
      }
    }
  }
}

}  // namespace
}  // namespace pyllm::cpu
