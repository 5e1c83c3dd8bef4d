// Strips (quant_strips.h) under AVX-512 VNNI: 32-bit lane c of every product is
// column c's, so a 64-byte load of weights takes two ANDs, a shift and one vpdpbusd
// per input row and nibble half, against a broadcast of four of the row's int8
// values, and no sum crosses lanes. Q4_K's sub-block sums take their scales by one
// multiply per row, its mins their inputs' sums by vpdpwssd; Q4_0's and Q4_1's
// block sums become float per block (Q4_0 less 8 times the inputs' sum first, as
// integers; Q4_1 plus m times it); Q8_0's weights are stored plus 128, for
// vpdpbusd's unsigned side, and its sums less 128 times the inputs' sum.
#pragma once

#include <algorithm>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>

#include "quant_strips.h"

namespace pyllm::cpu {
namespace {

// Independent sums per row: a lone row's vpdpbusd chain was latency-bound.
constexpr int strip_chains(int rows) { return rows >= 4 ? 1 : 4 / rows; }

// MXFP4's values + 12 (unsigned, vpdpbusd's unsigned side) per code, in every 128-bit
// lane: a vpshufb table.
inline __m512i mxfp4_table() {
  alignas(16) int8_t values[16];
  for (int c = 0; c < 16; ++c) values[c] = static_cast<int8_t>(quant::kMxfp4Values[c] + 12);
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(values)));
}

// part[r][i] += the products of 32 weights of 16 columns (the 4 vectors at w) with
// inputs [k, k + 32) of row m0 + r, spread over kChains sums. kTable: the nibbles are
// codes, looked up in `table` (MXFP4). kFifth: each nibble gains its fifth bit from
// the vector at `fifth` (Q5_K: bit t of a byte for the t-th nibble half taken).
template <int R, int kChains, bool kTable = false, bool kFifth = false>
inline void strip_dots(const uint8_t* w, const QuantizedRows& x, int64_t m0, int64_t k,
                       __m512i (&part)[R][kChains], __m512i table = __m512i{},
                       const uint8_t* fifth = nullptr) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i bits = kFifth ? _mm512_loadu_si512(fifth) : __m512i{};
  for (int v = 0; v < 4; ++v) {
    const __m512i wv = _mm512_loadu_si512(w + 64 * v);
    __m512i half[2] = {_mm512_and_si512(wv, low),
                       _mm512_and_si512(_mm512_srli_epi16(wv, 4), low)};
    if constexpr (kTable) {
      for (__m512i& h : half) h = _mm512_shuffle_epi8(table, h);
    }
    if constexpr (kFifth) {  // bit 0 of each byte of `bits` to bit 4, then the next bit
      for (__m512i& h : half) {
        h = _mm512_ternarylogic_epi32(h, _mm512_slli_epi32(bits, 4), _mm512_set1_epi8(0x10),
                                      0xF8);  // a | (b & c)
        bits = _mm512_srli_epi32(bits, 1);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = x.q_row(m0 + r) + k + 8 * v;
      for (int i = 0; i < 2; ++i) {
        int32_t x4;
        std::memcpy(&x4, xq + 4 * i, 4);
        __m512i& chain = part[r][(2 * v + i) % kChains];
        chain = _mm512_dpbusd_epi32(chain, half[i], _mm512_set1_epi32(x4));
      }
    }
  }
}

// The same for Q8_0's 8 vectors of 4 weights per lane (weights + 128).
template <int R, int kChains>
inline void strip8_dots(const uint8_t* w, const QuantizedRows& x, int64_t m0, int64_t k,
                        __m512i (&part)[R][kChains]) {
  for (int v = 0; v < 8; ++v) {
    const __m512i wv = _mm512_loadu_si512(w + 64 * v);
    for (int r = 0; r < R; ++r) {
      int32_t x4;
      std::memcpy(&x4, x.q_row(m0 + r) + k + 4 * v, 4);
      __m512i& chain = part[r][v % kChains];
      chain = _mm512_dpbusd_epi32(chain, wv, _mm512_set1_epi32(x4));
    }
  }
}

template <int kChains>
inline __m512i strip_sum(const __m512i (&part)[kChains]) {
  __m512i sum = part[0];
  for (int i = 1; i < kChains; ++i) sum = _mm512_add_epi32(sum, part[i]);
  return sum;
}

// Sub-block pair p's scales (lane c: words sc[2p], sc[2p + 1]) and mins (the same).
inline void strip_scales(const uint8_t* blk, int p, __m512i& scales, __m512i& mins) {
  using S = quant::Q4KStrip;
  const __m512i bytes = _mm512_cvtepu8_epi16(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + S::kScales + 32 * p)));
  scales = _mm512_and_si512(bytes, _mm512_set1_epi16(63));
  const __m512i high = _mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + S::kMinHigh + 16 * p)));
  const __m512i nibbles = _mm512_or_si512(
      _mm512_and_si512(high, _mm512_set1_epi32(0x0F)),
      _mm512_slli_epi32(_mm512_and_si512(high, _mm512_set1_epi32(0xF0)), 12));
  mins = _mm512_or_si512(_mm512_srli_epi16(bytes, 6), _mm512_slli_epi16(nibbles, 2));
}

// Q4_K (or Q5_K: its weights' fifth bits merged into the nibbles) strip columns
// [n, n + 16) for input rows [m0, m0 + R).
template <int R, int64_t T = quant::kQ4_K>
inline void q4k_strip_pass(const uint8_t* strip, const QuantizedRows& x, const int32_t* sums,
                           int64_t m0, int64_t blocks, float* out, int64_t out_stride, int64_t n,
                           const uint8_t* stop) {
  using S = quant::KStrip<T>;
  constexpr bool kFifth = T == quant::kQ5_K;
  constexpr int kChains = strip_chains(R);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = strip + b * S::kBytes;
    strip_prefetch<S::kBytes, R>(blk, stop);
    __m512i total[R], mins[R];
    for (int r = 0; r < R; ++r) total[r] = mins[r] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      __m512i scale_words, min_words;
      strip_scales(blk, p, scale_words, min_words);
      for (int r = 0; r < R; ++r) {
        mins[r] = _mm512_dpwssd_epi32(mins[r], min_words,
                                      _mm512_set1_epi32(sums[(r * blocks + b) * 4 + p]));
      }
      for (int h = 0; h < 2; ++h) {
        const int s = 2 * p + h;
        __m512i part[R][kChains];
        for (int r = 0; r < R; ++r) {
          for (int i = 0; i < kChains; ++i) part[r][i] = _mm512_setzero_si512();
        }
        const uint8_t* fifth = nullptr;
        if constexpr (kFifth) fifth = blk + S::fifth(s);
        strip_dots<R, kChains, false, kFifth>(blk + S::weights(s), x, m0, b * 256 + 32 * s,
                                              part, __m512i{}, fifth);
        const __m512i scale = h ? _mm512_srli_epi32(scale_words, 16)
                                : _mm512_and_si512(scale_words, _mm512_set1_epi32(0xFFFF));
        for (int r = 0; r < R; ++r) {
          const __m512i sum = strip_sum<kChains>(part[r]);
          total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(sum, scale));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + S::kD)));
    const __m512 dmin = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + S::kDmin)));
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x.d[(m0 + r) * blocks + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(d, dx), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[r]), _mm512_mul_ps(dmin, dx), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride + n, acc[r]);
}

// Q6_K's 6-bit weights of sub-block j, half i (0: low nibbles, 1: high) of low
// vector 2j + t: the nibbles OR the high 2 bits (bits 2s, 2s + 1 of each byte of hv,
// s = 2t + i) moved to bits 4 and 5. s is a template argument: a shift by a count
// known only at run time is a slower instruction.
template <int s>
[[gnu::always_inline]] inline __m512i q6_weights(__m512i nibbles, __m512i hv) {
  const __m512i high = s < 2 ? _mm512_slli_epi32(hv, 4 - 2 * s) : _mm512_srli_epi32(hv, 2 * s - 4);
  return _mm512_ternarylogic_epi32(nibbles, high, _mm512_set1_epi8(0x30), 0xF8);  // a | (b & c)
}

// The four weight vectors of a Q6_K sub-block (its low vectors at ql, high bits hv):
// q[2t + i] holds weights 8t + 4i + [0, 4) of each column.
[[gnu::always_inline]] inline void q6_vectors(const uint8_t* ql, __m512i hv, __m512i (&q)[4]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i w0 = _mm512_loadu_si512(ql), w1 = _mm512_loadu_si512(ql + 64);
  q[0] = q6_weights<0>(_mm512_and_si512(w0, low), hv);
  q[1] = q6_weights<1>(_mm512_and_si512(_mm512_srli_epi16(w0, 4), low), hv);
  q[2] = q6_weights<2>(_mm512_and_si512(w1, low), hv);
  q[3] = q6_weights<3>(_mm512_and_si512(_mm512_srli_epi16(w1, 4), low), hv);
}

// part[r][i] += the products of sub-block j's 16 weights of 16 columns (low vectors
// at ql, high bits at qh) with inputs [k, k + 16) of row m0 + r.
template <int R, int kChains>
[[gnu::always_inline]] inline void q6_dots(const uint8_t* ql, const uint8_t* qh,
                                           const QuantizedRows& x, int64_t m0, int64_t k,
                                           __m512i (&part)[R][kChains]) {
  __m512i q[4];
  q6_vectors(ql, _mm512_loadu_si512(qh), q);
  for (int v = 0; v < 4; ++v) {
    for (int r = 0; r < R; ++r) {
      int32_t x4;
      std::memcpy(&x4, x.q_row(m0 + r) + k + 4 * v, 4);
      __m512i& chain = part[r][v % kChains];
      chain = _mm512_dpbusd_epi32(chain, q[v], _mm512_set1_epi32(x4));
    }
  }
}

// Sub-block 2p + h's scales of a Q6_K strip (lane c: words sc[2p], sc[2p + 1]) as
// int32 per lane.
inline __m512i q6_scale(__m512i words, int h) {
  return h ? _mm512_srai_epi32(words, 16) : _mm512_srai_epi32(_mm512_slli_epi32(words, 16), 16);
}

inline __m512i q6_scale_words(const uint8_t* blk, int p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(blk + quant::Q6KStrip::kScales + 32 * p)));
}

// Q6_K strip columns [n, n + 16) for input rows [m0, m0 + R): per sub-block j,
// scale_j * (the 6-bit weights' sum - 32 * the inputs' sum), the second part for
// every j at once by vpdpwssd of the scales with the inputs' sums per 16. (Products
// summed in int16 pairs and scaled by vpdpwssd for 1-2 rows measured no faster.)
template <int R>
inline void q6k_strip_pass(const uint8_t* strip, const QuantizedRows& x, int64_t m0,
                           int64_t blocks, float* out, int64_t out_stride, int64_t n,
                           const uint8_t* stop) {
  using S = quant::Q6KStrip;
  constexpr int kChains = strip_chains(R);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = strip + b * S::kBytes;
    strip_prefetch<S::kBytes, R>(blk, stop);
    __m512i total[R], offset[R];
    for (int r = 0; r < R; ++r) total[r] = offset[r] = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p) {
      const __m512i words = q6_scale_words(blk, p);
      for (int r = 0; r < R; ++r) {
        int32_t sums;  // the inputs' sums over sub-blocks 2p, 2p + 1 (int16 each)
        std::memcpy(&sums, x.isum_row(m0 + r) + 16 * b + 2 * p, 4);
        offset[r] = _mm512_dpwssd_epi32(offset[r], words, _mm512_set1_epi32(sums));
      }
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * p + h;
        __m512i part[R][kChains];
        for (int r = 0; r < R; ++r) {
          for (int i = 0; i < kChains; ++i) part[r][i] = _mm512_setzero_si512();
        }
        q6_dots<R, kChains>(blk + S::low(j), blk + S::high(j), x, m0, b * 256 + 16 * j, part);
        const __m512i scale = q6_scale(words, h);
        for (int r = 0; r < R; ++r) {
          const __m512i sum = strip_sum<kChains>(part[r]);
          total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(sum, scale));
        }
      }
    }
    const __m512 d =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + S::kD)));
    for (int r = 0; r < R; ++r) {
      const __m512i sum = _mm512_sub_epi32(total[r], _mm512_slli_epi32(offset[r], 5));
      const __m512 dx = _mm512_set1_ps(x.d[(m0 + r) * blocks + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, dx), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride + n, acc[r]);
}

// 16 E8M0 bytes as floats 2^(e - 128) (e8m0_half): exponent field e - 1, or the
// subnormal 0x00200000 << e for e < 2.
inline __m512 e8m0_halves(const uint8_t* p) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  const __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
  const __mmask16 small = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, subnormal));
}

// A strip unit's scales per column: fp16 d, or MXFP4's E8M0 bytes.
template <int64_t T>
inline __m512 strip32_scales(const uint8_t* unit) {
  if constexpr (T == quant::kMXFP4) return e8m0_halves(unit + quant::Strip32<T>::kD);
  return _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + quant::Strip32<T>::kD)));
}

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or MXFP4 strip columns [n, n + 16) for input rows
// [m0, m0 + R).
template <int64_t T, int R>
inline void strip32_pass(const uint8_t* strip, const QuantizedRows& x, int64_t m0,
                         int64_t blocks, float* out, int64_t out_stride, int64_t n,
                         const uint8_t* stop) {
  using S = quant::Strip32<T>;
  constexpr int kChains = strip_chains(R);
  const __m512i table = T == quant::kMXFP4 ? mxfp4_table() : __m512i{};
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* unit = strip + b * S::kBytes;
    strip_prefetch<S::kBytes, R>(unit, stop);
    __m512i part[R][kChains];
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < kChains; ++i) part[r][i] = _mm512_setzero_si512();
    }
    if constexpr (T == quant::kQ8_0) {
      strip8_dots<R, kChains>(unit + S::kQs, x, m0, 32 * b, part);
    } else if constexpr (T == quant::kMXFP4) {
      strip_dots<R, kChains, true>(unit + S::kQs, x, m0, 32 * b, part, table);
    } else if constexpr (quant::has_fifth_bits(T)) {
      strip_dots<R, kChains, false, true>(unit + S::kQs, x, m0, 32 * b, part, __m512i{},
                                          unit + S::kQh);
    } else {
      strip_dots<R, kChains>(unit + S::kQs, x, m0, 32 * b, part);
    }
    const __m512 d = strip32_scales<T>(unit);
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      __m512i sum = strip_sum<kChains>(part[r]);
      if constexpr (!quant::has_block_min(T)) {  // the weights' offset
        const int16_t* isum = x.isum_row(m) + 2 * b;
        const int offset = T == quant::kQ4_0 ? 8 : T == quant::kMXFP4 ? 12
                           : T == quant::kQ5_0 ? 16 : 128;
        sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(offset * (isum[0] + isum[1])));
      }
      const __m512 dx = _mm512_set1_ps(x.d[m * blocks + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, dx), acc[r]);
      if constexpr (quant::has_block_min(T)) {
        const __m512 mins = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + S::kM)));
        const float* s = x.s_row(m) + 2 * b;
        acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(s[0] + s[1]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride + n, acc[r]);
}

// Columns [n0, n1) (whole strips: n0, n1 multiples of 16) of strips of type T for
// input rows [m0, m0 + R); nothing at or past `stop` is prefetched (null: no bound).
template <int64_t T, int R>
void strip_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
                int64_t K, float* out, int64_t out_stride, int64_t n0, int64_t n1,
                const uint8_t* stop = nullptr) {
  if constexpr (T == quant::kQ4_K || T == quant::kQ5_K) {
    const int64_t blocks = K / 256;
    const int32_t* sums = strip_input_sums(x, m0, R, blocks);
    for (int64_t n = n0; n < n1; n += quant::kStripColumns) {
      q4k_strip_pass<R, T>(w + n * row_bytes, x, sums, m0, blocks, out, out_stride, n, stop);
    }
  } else if constexpr (T == quant::kQ6_K) {
    for (int64_t n = n0; n < n1; n += quant::kStripColumns) {
      q6k_strip_pass<R>(w + n * row_bytes, x, m0, K / 256, out, out_stride, n, stop);
    }
  } else {
    for (int64_t n = n0; n < n1; n += quant::kStripColumns) {
      strip32_pass<T, R>(w + n * row_bytes, x, m0, K / 32, out, out_stride, n, stop);
    }
  }
}

// Values k0..k0+7 of a strip's 16 columns (y[t]: value k0 + t per lane) into a
// panel block of packed_linear's layout: word i of column c at panel[16 i + c], a
// word being one float32, or bf16 values 2i and 2i + 1 (k0 even).
template <typename S>
inline void store_panel_words(uint32_t* dst, int64_t k0, const __m512 (&y)[8]) {
  if constexpr (std::is_same_v<S, float>) {
    for (int t = 0; t < 8; ++t) _mm512_storeu_ps(reinterpret_cast<float*>(dst + (k0 + t) * 16), y[t]);
  } else {
    for (int t = 0; t < 8; t += 2) {
      __m512i pair[2];  // the bf16 bits of values k0 + t, k0 + t + 1 per lane
      for (int i = 0; i < 2; ++i) {
#ifdef __AVX512BF16__
        pair[i] = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y[t + i])));
#else
        alignas(64) float f[16];
        alignas(64) uint32_t bits[16];
        _mm512_store_ps(f, y[t + i]);
        for (int c = 0; c < 16; ++c) bits[c] = c10::BFloat16(f[c]).x;
        pair[i] = _mm512_load_si512(bits);
#endif
      }
      _mm512_storeu_si512(dst + (k0 + t) / 2 * 16,
                          _mm512_or_si512(pair[0], _mm512_slli_epi32(pair[1], 16)));
    }
  }
}

// 32 values (the 4 weight vectors at w; kFifth: and the vector of their fifth bits
// after them) of a strip's columns, a * q + off per lane, into the panel from value k0.
template <typename S, bool kFifth = false>
inline void dequantize_strip_group(const uint8_t* w, __m512 a, __m512 off, int64_t k0,
                                   uint32_t* dst) {
  const __m512i nibble = _mm512_set1_epi32(0x0F), bit4 = _mm512_set1_epi32(0x10);
  const __m512i fifth = kFifth ? _mm512_loadu_si512(w + 256) : _mm512_setzero_si512();
  for (int v = 0; v < 4; ++v) {
    const __m512i wv = _mm512_loadu_si512(w + 64 * v);
    __m512 y[8];  // value 8v + t of each column
    for (int t = 0; t < 8; ++t) {
      __m512i q = _mm512_and_si512(_mm512_srli_epi32(wv, 8 * (t % 4) + 4 * (t / 4)), nibble);
      if constexpr (kFifth) {  // value 8v + t's fifth bit: byte t % 4, bit 2v + t / 4
        const int at = 8 * (t % 4) + 2 * v + t / 4;
        const __m512i high = at >= 4 ? _mm512_srli_epi32(fifth, at - 4)
                                     : _mm512_slli_epi32(fifth, 4 - at);
        q = _mm512_ternarylogic_epi32(q, high, bit4, 0xF8);  // q | (high & bit4)
      }
      y[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), a, off);
    }
    store_panel_words<S>(dst, k0 + 8 * v, y);
  }
}

// Q6_K strips into a panel block (dequantize_strip_panel): a = d * scale, value
// a * q - 32 a, as Format<kQ6_K>::scales and the row decoders compute it.
template <typename S>
void dequantize_q6k_strip_panel(const uint8_t* strip, int64_t K, uint32_t* dst) {
  using L = quant::Q6KStrip;
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = strip + b * L::kBytes;
    const __m512 d =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L::kD)));
    for (int j = 0; j < 16; ++j) {
      const __m512i scale = q6_scale(q6_scale_words(blk, j / 2), j % 2);
      const __m512 a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(scale));
      const __m512 off = _mm512_mul_ps(a, _mm512_set1_ps(-32.0f));
      __m512i q[4];
      q6_vectors(blk + L::low(j), _mm512_loadu_si512(blk + L::high(j)), q);
      for (int t = 0; t < 2; ++t) {
        __m512 y[8];  // value 16j + 8t + u of each column: byte u % 4 of q[2t + u / 4]
        for (int u = 0; u < 8; ++u) {
          const __m512i v = _mm512_and_si512(_mm512_srli_epi32(q[2 * t + u / 4], 8 * (u % 4)),
                                             _mm512_set1_epi32(0x3F));
          y[u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), a, off);
        }
        store_panel_words<S>(dst, b * 256 + 16 * j + 8 * t, y);
      }
    }
  }
}

// A strip's 16 columns dequantized straight into a panel block: lane c of every
// vector is already column c. Each value is a * q + b with Format<T>'s a and b (Q4_K:
// d * scale, -dmin * min), as dequantize_row_* compute it, so the panels match those
// of the GGUF layout bit for bit.
template <int64_t T, typename S>
void dequantize_strip_panel(const uint8_t* strip, int64_t K, S* panel) {
  auto* dst = reinterpret_cast<uint32_t*>(panel);
  auto half16 = [](const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  if constexpr (T == quant::kQ8_0) {
    using L = quant::Strip32<T>;
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* unit = strip + b * L::kBytes;
      const __m512 d = half16(unit + L::kD);
      for (int h = 0; h < 4; ++h) {  // vectors 2h, 2h + 1: values 8h..8h+7
        __m512 y[8];
        for (int t = 0; t < 8; ++t) {
          const __m512i wv = _mm512_loadu_si512(unit + L::kQs + 64 * (2 * h + t / 4));
          const __m512i q = _mm512_srai_epi32(
              _mm512_slli_epi32(_mm512_xor_si512(wv, _mm512_set1_epi8(-128)), 24 - 8 * (t % 4)), 24);
          y[t] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);
        }
        store_panel_words<S>(dst, 32 * b + 8 * h, y);
      }
    }
    return;
  } else if constexpr (T == quant::kQ6_K) {
    dequantize_q6k_strip_panel<S>(strip, K, dst);
    return;
  } else if constexpr (T == quant::kMXFP4) {
    using L = quant::Strip32<T>;
    alignas(64) float values[16];
    for (int c = 0; c < 16; ++c) values[c] = quant::kMxfp4Values[c];
    const __m512 table = _mm512_load_ps(values);
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* unit = strip + b * L::kBytes;
      const __m512 a = e8m0_halves(unit + L::kD);
      for (int v = 0; v < 4; ++v) {
        const __m512i wv = _mm512_loadu_si512(unit + L::kQs + 64 * v);
        __m512 y[8];  // value 8v + t of each column: its code looked up, times a
        for (int t = 0; t < 8; ++t) {
          const __m512i code = _mm512_and_si512(_mm512_srli_epi32(wv, 8 * (t % 4) + 4 * (t / 4)),
                                                _mm512_set1_epi32(0x0F));
          y[t] = _mm512_mul_ps(_mm512_permutexvar_ps(code, table), a);
        }
        store_panel_words<S>(dst, 32 * b + 8 * v, y);
      }
    }
    return;
  } else if constexpr (T != quant::kQ4_K && T != quant::kQ5_K) {
    using L = quant::Strip32<T>;
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* unit = strip + b * L::kBytes;
      const __m512 d = half16(unit + L::kD);
      const __m512 off = quant::has_block_min(T)
                             ? half16(unit + L::kM)
                             : _mm512_mul_ps(d, _mm512_set1_ps(T == quant::kQ5_0 ? -16.0f : -8.0f));
      dequantize_strip_group<S, quant::has_fifth_bits(T)>(unit + L::kQs, d, off, 32 * b, dst);
    }
    return;
  }
  using L = quant::KStrip<T>;
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* blk = strip + b * L::kBytes;
    const __m512 d = half16(blk + L::kD), dmin = half16(blk + L::kDmin);
    for (int p = 0; p < 4; ++p) {
      __m512i scale_words, min_words;
      strip_scales(blk, p, scale_words, min_words);
      for (int h = 0; h < 2; ++h) {
        auto word = [&](__m512i words) {
          return h ? _mm512_srli_epi32(words, 16)
                   : _mm512_and_si512(words, _mm512_set1_epi32(0xFFFF));
        };
        const __m512 a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(word(scale_words)));
        const __m512 off = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), dmin),
                                         _mm512_cvtepi32_ps(word(min_words)));
        const int s = 2 * p + h;
        dequantize_strip_group<S, T == quant::kQ5_K>(blk + L::weights(s), a, off,
                                                     b * 256 + 32 * s, dst);
      }
    }
  }
}

}  // namespace
}  // namespace pyllm::cpu
