// The AVX-512 back end of quant_dot.h (BW + VL + VNNI): 64-byte integer dot
// products, two groups of 32 weights per instruction, over quant_groups_avx2.h's
// 32-byte groups.
#pragma once

#include "quant_groups_avx2.h"

namespace pyllm::cpu {
namespace {

// Output columns taken in one pass over their weight rows: the input rows' vectors
// are loaded once for all of them, and their sums reduced together. One thread, L2-
// resident 1024x2048 weights, 1 / 2 / 4 / 5 rows: Q4_K 54.5 / 73 / 165 / 129 us by one
// column, 52.3 / 69.5 / 114 / 133 by two, 60.5 / 77 / 119 / 136 by four; Q4_0 by one
// 71 / 94 / 170 / 198 us, by two 68 / 87 / 133 / 150. Q6_K's pass (kquant_pass) ran
// at half speed by two: it keeps one.
constexpr int kPassColumns = 2;

// sums[c] = the sum of acc[c]'s lanes, c < NC <= 4, by one tree whatever NC is (lane
// i + lane i + 8, then + i + 4, + i + 2, + i + 1): a column's sum must not depend on
// how many columns shared its pass (batch invariance, ops.h).
template <int NC>
inline void column_sums(const __m512* acc, float* sums) {
  const __m512 zero = _mm512_setzero_ps();
  auto halves = [](__m512 a, __m512 b) {  // [a0 + a2, a1 + a3, b0 + b2, b1 + b3] (128-bit)
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  };
  const __m512 s01 = halves(acc[0], NC > 1 ? acc[1] : zero);
  __m512 t;  // 128-bit lane c (NC > 2) or 2c (else): column c's four partial sums
  if constexpr (NC > 2) {
    const __m512 s23 = halves(acc[2], NC > 3 ? acc[3] : zero);
    t = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
  } else {
    t = _mm512_add_ps(s01, _mm512_shuffle_f32x4(s01, s01, 0xB1));
  }
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
  alignas(64) float v[16];
  _mm512_store_ps(v, t);
  for (int c = 0; c < NC; ++c) sums[c] = v[NC > 2 ? 4 * c : 8 * c];
}

// Columns [n0, n1) by passes of kPassColumns, the last ones one at a time; pass<NC>(n)
// does columns [n, n + NC).
// Columns [n0, n1) by passes of NC, the last ones one at a time; pass(nc, n) does
// columns [n, n + nc).
template <int NC, typename Pass>
inline void column_passes(int64_t n0, int64_t n1, Pass pass) {
  int64_t n = n0;
  for (; n + NC <= n1; n += NC) pass(std::integral_constant<int, NC>{}, n);
  for (; n < n1; ++n) pass(std::integral_constant<int, 1>{}, n);
}

// With AVX-512 VNNI, two groups per instruction: a 64-byte vector holds groups g
// and g + 1 (contiguous in the inputs), and the integer scales per 16 are spread
// over 32 lanes of 16 bits once per block. The offsets gather in a vector and are
// summed once per column. Half the instructions of the 32-byte form (quant_dot_avx2.h), whose
// batch-1 decode was compute-bound (a thread alone streamed half of what two did).
template <int64_t T>
inline __m512i group_pair(const uint8_t* blk, int g) {
  if constexpr (T == kQ4_K) {
    const auto* p = reinterpret_cast<const __m256i*>(Format<T>::nibble_bytes(blk, g));
    const __m256i v = _mm256_loadu_si256(p);
    const __m512i both =
        _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
  } else {
    return _mm512_inserti64x4(_mm512_castsi256_si512(group_vector<T>(blk, g)),
                              group_vector<T>(blk, g + 1), 1);
  }
}

// 16-bit lane l of pair j takes scale word kquant_index<T>()[j][l]: Q6_K has one per
// 16 values, Q4_K / Q5_K one per 32.
template <int64_t T>
inline const std::array<std::array<int16_t, 32>, 4>& kquant_index() {
  alignas(64) static const auto idx = [] {
    std::array<std::array<int16_t, 32>, 4> v{};
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 32; ++l) {
        v[j][l] = static_cast<int16_t>(T == kQ6_K ? 4 * j + l / 8 : 2 * j + l / 16);
      }
    }
    return v;
  }();
  return idx;
}

// Columns [n, n + NC) for input rows [m0, m0 + R).
template <int64_t T, int R, int NC>
inline void kquant_pass(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
                        int64_t blocks, float* out, int64_t out_stride, int64_t n) {
  using F = Format<T>;
  const auto& idx = kquant_index<T>();
  __m512 acc[R][NC] = {};
  __m256 off[R][NC] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i scale16[NC];  // per 16 values, against the inputs' integer sums
    __m512i words[NC];    // the integer scales as 16-bit words
    float d[NC], dmin[NC];
    __m512i iacc[R][NC];
    for (int c = 0; c < NC; ++c) {
      const uint8_t* blk = w + (n + c) * row_bytes + b * F::kBytes;
      prefetch_ahead<F::kBytes>(blk, row_bytes >= kL2PrefetchRowBytes);
      if constexpr (T == kQ6_K) {
        d[c] = half_at(blk + F::kD);
        dmin[c] = 32.0f * d[c];
        const auto* sc = reinterpret_cast<const __m128i*>(blk + F::kScales);
        scale16[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(sc));
        words[c] = _mm512_castsi256_si512(scale16[c]);
      } else {
        const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(blk)));
        d[c] = _mm_cvtss_f32(dd);
        dmin[c] = _mm_cvtss_f32(_mm_movehdup_ps(dd));
        uint64_t scales, mins;
        k_scales_mins(blk + F::kScales, scales, mins);
        const __m128i m8 = _mm_cvtsi64_si128(static_cast<int64_t>(mins));
        scale16[c] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        words[c] = _mm512_castsi128_si512(
            _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(scales))));
      }
      for (int r = 0; r < R; ++r) iacc[r][c] = _mm512_setzero_si512();
    }
    for (int j = 0; j < 4; ++j) {
      __m512i u[NC], scale[NC];
      for (int c = 0; c < NC; ++c) {
        u[c] = group_pair<T>(w + (n + c) * row_bytes + b * F::kBytes, 2 * j);
        scale[c] = _mm512_permutexvar_epi16(_mm512_load_si512(idx[j].data()), words[c]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_loadu_si512(x.q_row(m0 + r) + b * 256 + j * 64);
        for (int c = 0; c < NC; ++c) {
          iacc[r][c] = _mm512_dpwssd_epi32(iacc[r][c], _mm512_maddubs_epi16(u[c], xv), scale[c]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const float dx = x.d[m * blocks + b];
      const __m256i is =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.isum_row(m) + 16 * b));
      for (int c = 0; c < NC; ++c) {
        off[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(scale16[c], is)),
                                    _mm256_set1_ps(-dmin[c] * dx), off[r][c]);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][c]), _mm512_set1_ps(d[c] * dx),
                                    acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float sums[NC];
    column_sums<NC>(acc[r], sums);
    for (int c = 0; c < NC; ++c) out[r * out_stride + n + c] = sums[c] + hsum(off[r][c]);
  }
}

template <int64_t T, int R>
void kquant_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
                 int64_t K, float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  column_passes<1>(n0, n1, [&](auto nc, int64_t n) {
    kquant_pass<T, R, decltype(nc)::value>(w, row_bytes, x, m0, K / 256, out, out_stride, n);
  });
}

// The formats of one group per block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4), eight
// blocks at a time with AVX-512 VNNI: one gather reads the eight blocks' fp16 (or
// E8M0) scales (and mins), two blocks share each 64-byte dot product, and the per-block scales reach
// its lanes by one permute per pair. The one-block-at-a-time form (quant_dot_avx2.h) spent most
// of its instructions on per-block scalars: batch-1 decode of SmolLM2 Q4_1 was
// compute-bound (one thread 6.8 GB/s, two 10.3).
template <int64_t T>
inline void scales8(const uint8_t* blk, __m256& a, __m256& b) {
  using F = Format<T>;
  const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                        _mm256_set1_epi32(F::kBytes));
  const __m256i words = _mm256_i32gather_epi32(reinterpret_cast<const int*>(blk), at, 1);
  if constexpr (T == kMXFP4) {
    // The E8M0 bytes as floats 2^(e - 128) (e8m0_half): exponent field e - 1, or the
    // subnormal 0x00200000 << e for e < 2.
    const __m256i e = _mm256_and_si256(words, _mm256_set1_epi32(0xFF));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    a = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small));
    b = _mm256_setzero_ps();
    return;
  }
  a = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(words));
  if constexpr (T == kQ4_1 || T == kQ5_1) {
    b = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(words, 16)));
  } else if constexpr (T == kQ8_0) {
    b = _mm256_setzero_ps();
  } else {
    b = _mm256_mul_ps(a, _mm256_set1_ps(T == kQ4_0 ? -8.0f : -16.0f));
  }
}

// Lane i: sum of the products of bytes [4i, 4i + 4) (Q8_0's and MXFP4's w signed,
// as dot_s8_s8).
template <int64_t T>
inline __m512i dot64(__m512i u, __m512i x) {
  if constexpr (Format<T>::kSigned) {
    x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(u), _mm512_setzero_si512(), x);
    u = _mm512_abs_epi8(u);
  }
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
}

// Blocks [b0, b1) of one weight row one at a time (the last ones, K not a multiple of
// 256): each input row's sum of them in sums[R].
template <int64_t T, int R>
void tail_blocks(const uint8_t* row, const QuantizedRows& x, int64_t m0, int64_t b0, int64_t b1,
                 float* sums) {
  using F = Format<T>;
  __m256 acc[R];
  float off[R] = {};
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = row + b * F::kBytes;
    float sa[2], sb[2];
    F::scales(blk, sa, sb);
    group_step<T, R>(group_vector<T>(blk, 0), sa[0], sa[1], x, m0, b, acc);
    for (int r = 0; r < R; ++r) {
      const float* s = x.s_row(m0 + r) + 2 * b;
      off[r] += sb[0] * (s[0] + s[1]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = hsum(acc[r]) + off[r];
}

// Columns [n, n + NC) for input rows [m0, m0 + R).
template <int64_t T, int R, int NC>
inline void block32_pass(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
                         int64_t blocks, float* out, int64_t out_stride, int64_t n) {
  using F = Format<T>;
  const int64_t whole = blocks / 8 * 8;
  // Pair j's lanes 0-7 take block 2j's scale, lanes 8-15 block 2j + 1's.
  alignas(64) static const auto idx = [] {
    std::array<std::array<int32_t, 16>, 4> v{};
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 16; ++l) v[j][l] = 2 * j + l / 8;
    }
    return v;
  }();
  const __m512i pair_sums = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[R][NC] = {};
  __m256 off[R][NC] = {};
  for (int64_t b0 = 0; b0 < whole; b0 += 8) {
    __m256 a[NC], b[NC];
    __m512i u[NC][4];
    for (int c = 0; c < NC; ++c) {
      const uint8_t* blk = w + (n + c) * row_bytes + b0 * F::kBytes;
      prefetch_ahead<8 * F::kBytes>(blk, row_bytes >= kL2PrefetchRowBytes);
      scales8<T>(blk, a[c], b[c]);
      for (int j = 0; j < 4; ++j) {
        const uint8_t* pair = blk + 2 * j * F::kBytes;
        u[c][j] = _mm512_inserti64x4(_mm512_castsi256_si512(group_vector<T>(pair, 0)),
                                     group_vector<T>(pair + F::kBytes, 0), 1);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const __m256 dx = _mm256_loadu_ps(&x.d[m * blocks + b0]);
      const int8_t* q = x.q_row(m) + b0 * 32;
      __m512 s32;
      if constexpr (!F::kSigned) {
        // The inputs' scaled sums per 16, added in pairs: one per block.
        const __m512 s16 = _mm512_loadu_ps(x.s_row(m) + 2 * b0);
        s32 = _mm512_permutexvar_ps(pair_sums, _mm512_add_ps(s16, _mm512_permute_ps(s16, 0xB1)));
      }
      for (int j = 0; j < 4; ++j) {
        const __m512i xv = _mm512_loadu_si512(q + 64 * j);
        for (int c = 0; c < NC; ++c) {
          const __m512 scale = _mm512_castps256_ps512(_mm256_mul_ps(a[c], dx));
          const __m512i dot = dot64<T>(u[c][j], xv);
          acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                      _mm512_permutexvar_ps(_mm512_load_si512(idx[j].data()), scale),
                                      acc[r][c]);
        }
      }
      if constexpr (!F::kSigned) {
        for (int c = 0; c < NC; ++c) {
          off[r][c] = _mm256_fmadd_ps(b[c], _mm512_castps512_ps256(s32), off[r][c]);
        }
      }
    }
  }
  float sums[R][NC], tail[NC][R];
  for (int r = 0; r < R; ++r) column_sums<NC>(acc[r], sums[r]);
  for (int c = 0; c < NC; ++c) {
    tail_blocks<T, R>(w + (n + c) * row_bytes, x, m0, whole, blocks, tail[c]);
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NC; ++c) {
      out[r * out_stride + n + c] = sums[r][c] + hsum(off[r][c]) + tail[c][r];
    }
  }
}

template <int64_t T, int R>
void block32_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
                  int64_t K, float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  // Two columns from 4 rows lost a few percent (Q8_0 1024x2048, 1 thread, 1 / 2 / 4 / 5
  // rows: 96 / 128 / 192 / 222 us by one, 82 / 115 / 197 / 225 by two).
  constexpr int kColumns = R < 4 ? kPassColumns : 1;
  column_passes<kColumns>(n0, n1, [&](auto nc, int64_t n) {
    block32_pass<T, R, decltype(nc)::value>(w, row_bytes, x, m0, K / 32, out, out_stride, n);
  });
}

}  // namespace
}  // namespace pyllm::cpu

#include "quant_octets_avx512.h"

namespace pyllm::cpu {
namespace {

// Output columns [n0, n1) for input rows [m0, m0 + R).
template <int64_t T, int R>
void dot_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0, int64_t K,
              float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  if constexpr (T == kQ4_K) {
    q4k_rows<R>(w, row_bytes, x, m0, K, out, out_stride, n0, n1);
  } else if constexpr (Format<T>::kGroups == 8) {
    kquant_rows<T, R>(w, row_bytes, x, m0, K, out, out_stride, n0, n1);
  } else if constexpr (kOctetFormat<T>) {
    octet_rows<T, R>(w, row_bytes, x, m0, K, out, out_stride, n0, n1);
  } else {
    block32_rows<T, R>(w, row_bytes, x, m0, K, out, out_stride, n0, n1);
  }
}

}  // namespace
}  // namespace pyllm::cpu
