// CPU kernels over GGUF-quantized weights: quant_linear (out = input . W^T + bias
// with W kept in its file's blocks) and dequantize_rows (the embedding lookup).
//
// quant_linear quantizes each input row once to int8 in groups of 32 (one float
// scale per group, and the scaled sum of each 16 values), then takes integer dot
// products of the weights' small unsigned integers with those int8 values, 32 at a
// time (gguf_blocks.h: every format reads as groups of 32 with a scale and offset
// per 16). The integer product is exact; per group it is scaled into float32 sums:
//   sum_k w_k x_k ~= sum_halves dx * (a * sum(u * qx) + b * sum(qx)).
// Decoding a group's integers costs a few vector instructions, so each decoded
// group meets up to kTileRows input rows before the next one is decoded. Integer
// dot products need 8 bits per activation instead of 32, and one instruction does
// 32 multiply-adds (vpdpbusd with AVX512-VNNI or AVX-VNNI; vpmaddubsw + vpmaddwd on
// AVX2; a plain loop elsewhere). Each thread takes a contiguous range of output
// columns and streams its rows of W once per tile of input rows.
//
// Many rows (a prompt chunk, a large batch) go instead through float products of
// dequantized panels of W: AMX tiles for bf16 inputs where the build targets them
// (from 16 rows), else packed_linear's register tile (from 32 rows, where it is
// vectorized), else (float32 on AVX2) chunks through ATen's GEMM (from 64 rows).
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/Parallel.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PYLLM_QUANT_AVX2 1
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PYLLM_QUANT_ZMM 1  // 64-byte integer dot products
#endif
#endif

#include "../cpu/packed_tile.h"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "gguf_blocks.h"

namespace pyllm::cpu {
namespace {

using namespace pyllm::quant;

// Input rows per register tile: each decoded group of 32 weights is used this many times.
constexpr int kTileRows = 8;
// Weights per thread below which a second thread costs more than it saves.
constexpr int64_t kGrainWeights = 1 << 16;

// ---------------------------------------------------------------------------
// Activations, quantized per row in spans of G values (32; 256 for the K formats,
// whose integer sums run over a whole block): q[K] int8 in [-127, 127], d[K / G] the
// span's scale, and per 16 values the sum of q (isum) and the scaled sum d * isum (s).

struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> s;
  std::vector<int16_t> isum;  // |sum| <= 16 * 127
  int64_t K = 0, G = 32;
  int span_shift = 0;  // log2(G / 32)
  const int8_t* q_row(int64_t m) const { return q.data() + m * K; }
  // The scale of group `group` (of 32) of row m.
  float dx(int64_t m, int64_t group) const { return d[m * (K / G) + (group >> span_shift)]; }
  const float* s_row(int64_t m) const { return s.data() + m * (K / 16); }
  const int16_t* isum_row(int64_t m) const { return isum.data() + m * (K / 16); }
};

template <typename scalar_t>
void quantize_span(const scalar_t* x, int64_t G, int8_t* q, float* d, float* s, int16_t* isum) {
  float amax = 0.0f;
  for (int64_t i = 0; i < G; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float scale = amax / 127.0f;
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t h = 0; h < G / 16; ++h) {
    int32_t sum = 0;
    for (int64_t i = 16 * h; i < 16 * h + 16; ++i) {
      const int qi = static_cast<int>(std::nearbyint(static_cast<float>(x[i]) * inv));
      q[i] = static_cast<int8_t>(qi);
      sum += qi;
    }
    isum[h] = static_cast<int16_t>(sum);
    s[h] = scale * float(sum);
  }
  *d = scale;
}

template <typename scalar_t>
QuantizedRows quantize_rows(const scalar_t* x, int64_t x_stride, int64_t M, int64_t K,
                            int64_t G) {
  QuantizedRows r;
  r.K = K;
  r.G = G;
  r.span_shift = G == 256 ? 3 : 0;
  r.q.resize(M * K);
  r.d.resize(M * K / G);
  r.s.resize(M * K / 16);
  r.isum.resize(M * K / 16);
  at::parallel_for(0, M * (K / G), std::max<int64_t>(1, 8192 / G), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t m = g / (K / G), k = (g % (K / G)) * G;
      const int64_t h = m * (K / 16) + k / 16;
      quantize_span(x + m * x_stride + k, G, r.q.data() + m * K + k, r.d.data() + g,
                    r.s.data() + h, r.isum.data() + h);
    }
  });
  return r;
}

// ---------------------------------------------------------------------------
// One group's integers as a vector of 32 bytes, per format (AVX2 and up).
#ifdef PYLLM_QUANT_AVX2

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

// The same for signed w (Q8_0): |w| times x with w's sign (x is never -128).
inline __m256i dot_s8_s8(__m256i w, __m256i x) {
  return dot_u8_s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// The weight stream runs this far ahead of the block being decoded (a strip's rows
// are contiguous, so it runs on across rows). The hardware prefetchers alone left
// batch-1 decode latency-bound: all of TinyLlama Q4_K_M's projections, 2 threads,
// 10.6 GB/s; 1 KiB ahead 12.0, 4 KiB 16.5, 8 KiB 17.4, 16 KiB 16.9 (the machine
// reads 26-30 GB/s with 2 threads; benchmarks/quant_linear.py).
constexpr int kPrefetchBytes = 8192;

template <int kBytes>
inline void prefetch_ahead(const uint8_t* blk) {
  for (int line = 0; line < kBytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + line), _MM_HINT_T0);
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

// The K formats (blocks of 256 with small integer sub-block scales), against inputs
// quantized with one scale per 256: the sub-block scales multiply the 16-bit pair
// sums as integers, so a whole block's products stay in one int32 accumulator and
// become float once per block. Offsets: mins (or Q6_K's -32) times the inputs'
// integer sums per 16, also once per block.
// Q4_K / Q5_K's 12 scale bytes as 8 scales and 8 mins (bytes), with 32-bit word
// operations instead of 16 six-bit extractions.
inline void k_scales_mins(const uint8_t* s, uint64_t& scales, uint64_t& mins) {
  uint32_t u0, u1, u2;
  std::memcpy(&u0, s, 4);
  std::memcpy(&u1, s + 4, 4);
  std::memcpy(&u2, s + 8, 4);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  const uint32_t sc_hi = (u2 & k4) | (((u0 >> 6) & k2) << 4);
  const uint32_t m_hi = ((u2 >> 4) & k4) | (((u1 >> 6) & k2) << 4);
  scales = uint64_t(u0 & k6) | (uint64_t(sc_hi) << 32);
  mins = uint64_t(u1 & k6) | (uint64_t(m_hi) << 32);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

#ifdef PYLLM_QUANT_ZMM
// With AVX-512 VNNI, two groups per instruction: a 64-byte vector holds groups g
// and g + 1 (contiguous in the inputs), and the integer scales per 16 are spread
// over 32 lanes of 16 bits once per block. The offsets gather in a vector and are
// summed once per column. Half the instructions of the 32-byte form below, whose
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

template <int64_t T, int R>
void kquant_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
                 int64_t K, float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  using F = Format<T>;
  const int64_t blocks = K / 256;
  // 16-bit lane l of pair j takes scale word idx[j][l]: Q6_K has one per 16 values,
  // Q4_K / Q5_K one per 32.
  alignas(64) static const auto idx = [] {
    std::array<std::array<int16_t, 32>, 4> v{};
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 32; ++l) {
        v[j][l] = static_cast<int16_t>(T == kQ6_K ? 4 * j + l / 8 : 2 * j + l / 16);
      }
    }
    return v;
  }();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m512 acc[R];
    __m256 off[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_setzero_ps();
      off[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * F::kBytes;
      prefetch_ahead<F::kBytes>(blk);
      __m256i scale16;  // per 16 values, against the inputs' integer sums
      __m512i words;    // the integer scales as 16-bit words
      float d, dmin;
      if constexpr (T == kQ6_K) {
        d = half_at(blk + 208);
        dmin = 32.0f * d;
        const auto* sc = reinterpret_cast<const __m128i*>(blk + 192);
        scale16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(sc));
        words = _mm512_castsi256_si512(scale16);
      } else {
        const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(blk)));
        d = _mm_cvtss_f32(dd);
        dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
        uint64_t scales, mins;
        k_scales_mins(blk + 4, scales, mins);
        const __m128i m8 = _mm_cvtsi64_si128(static_cast<int64_t>(mins));
        scale16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        words = _mm512_castsi128_si512(
            _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(scales))));
      }
      __m512i iacc[R];
      for (int r = 0; r < R; ++r) iacc[r] = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        const __m512i u = group_pair<T>(blk, 2 * j);
        const __m512i scale = _mm512_permutexvar_epi16(_mm512_load_si512(idx[j].data()), words);
        for (int r = 0; r < R; ++r) {
          const __m512i xv = _mm512_loadu_si512(x.q_row(m0 + r) + b * 256 + j * 64);
          iacc[r] = _mm512_dpwssd_epi32(iacc[r], _mm512_maddubs_epi16(u, xv), scale);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const float dx = x.d[m * blocks + b];
        const __m256i is =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.isum_row(m) + 16 * b));
        off[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(scale16, is)),
                                 _mm256_set1_ps(-dmin * dx), off[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r]), _mm512_set1_ps(d * dx), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      out[r * out_stride + n] = _mm512_reduce_add_ps(acc[r]) + hsum(off[r]);
    }
  }
}
#else
template <int64_t T, int R>
void kquant_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
                 int64_t K, float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  using F = Format<T>;
  const int64_t blocks = K / 256;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    float offset[R] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * F::kBytes;
      prefetch_ahead<F::kBytes>(blk);
      // Per 16 values: the integer scale (offsets use them against the inputs' sums).
      __m256i scale16;
      uint64_t scales = 0;
      float d, dmin = 0.0f;
      if constexpr (T == kQ6_K) {
        d = half_at(blk + 208);
        scale16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      } else {
        const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(blk)));
        d = _mm_cvtss_f32(dd);
        dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
        uint64_t mins;
        k_scales_mins(blk + 4, scales, mins);
        // Each group's min for both its halves: the offsets' integer weights per 16.
        const __m128i m8 = _mm_cvtsi64_si128(static_cast<int64_t>(mins));
        scale16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
      }
      __m256i iacc[R];
      for (int r = 0; r < R; ++r) iacc[r] = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        const __m256i u = group_vector<T>(blk, g);
        // Pair sums 0-7 are the group's first 16 values, 8-15 its second.
        __m256i scale;
        if constexpr (T == kQ6_K) {
          const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
          scale = _mm256_set_m128i(_mm_set1_epi16(sc[2 * g + 1]), _mm_set1_epi16(sc[2 * g]));
        } else {
          scale = _mm256_set1_epi16(static_cast<int16_t>((scales >> (8 * g)) & 0xFF));
        }
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(x.q_row(m0 + r) + b * 256 + g * 32));
          iacc[r] = madd_scaled(iacc[r], _mm256_maddubs_epi16(u, xv), scale);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const float dx = x.d[m * blocks + b];
        const __m256i is =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.isum_row(m) + 16 * b));
        const int32_t low = hsum_epi32(_mm256_madd_epi16(scale16, is));
        offset[r] -= (T == kQ6_K ? 32.0f * d : dmin) * dx * float(low);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_set1_ps(d * dx), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride + n] = hsum(acc[r]) + offset[r];
  }
}

#endif

#ifdef PYLLM_QUANT_ZMM
// The formats of one group per block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), eight blocks
// at a time with AVX-512 VNNI: one gather reads the eight blocks' fp16 scales (and
// mins), two blocks share each 64-byte dot product, and the per-block scales reach
// its lanes by one permute per pair. The one-block-at-a-time form below spent most
// of its instructions on per-block scalars: batch-1 decode of SmolLM2 Q4_1 was
// compute-bound (one thread 6.8 GB/s, two 10.3).
template <int64_t T>
inline void scales8(const uint8_t* blk, __m256& a, __m256& b) {
  using F = Format<T>;
  const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                        _mm256_set1_epi32(F::kBytes));
  const __m256i words = _mm256_i32gather_epi32(reinterpret_cast<const int*>(blk), at, 1);
  a = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(words));
  if constexpr (T == kQ4_1 || T == kQ5_1) {
    b = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(words, 16)));
  } else if constexpr (T == kQ8_0) {
    b = _mm256_setzero_ps();
  } else {
    b = _mm256_mul_ps(a, _mm256_set1_ps(T == kQ4_0 ? -8.0f : -16.0f));
  }
}

// Lane i: sum of the products of bytes [4i, 4i + 4) (Q8_0's w signed, as dot_s8_s8).
template <int64_t T>
inline __m512i dot64(__m512i u, __m512i x) {
  if constexpr (Format<T>::kSigned) {
    x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(u), _mm512_setzero_si512(), x);
    u = _mm512_abs_epi8(u);
  }
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
}

template <int64_t T, int R>
void block32_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
                  int64_t K, float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  using F = Format<T>;
  const int64_t blocks = K / 32, whole = blocks / 8 * 8;
  // Pair j's lanes 0-7 take block 2j's scale, lanes 8-15 block 2j + 1's.
  alignas(64) static const auto idx = [] {
    std::array<std::array<int32_t, 16>, 4> v{};
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 16; ++l) v[j][l] = 2 * j + l / 8;
    }
    return v;
  }();
  const __m512i pair_sums = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m512 acc[R];
    __m256 off[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_setzero_ps();
      off[r] = _mm256_setzero_ps();
    }
    for (int64_t b0 = 0; b0 < whole; b0 += 8) {
      const uint8_t* blk = row + b0 * F::kBytes;
      prefetch_ahead<8 * F::kBytes>(blk);
      __m256 a, b;
      scales8<T>(blk, a, b);
      __m512i u[4];
      for (int j = 0; j < 4; ++j) {
        const uint8_t* pair = blk + 2 * j * F::kBytes;
        u[j] = _mm512_inserti64x4(_mm512_castsi256_si512(group_vector<T>(pair, 0)),
                                  group_vector<T>(pair + F::kBytes, 0), 1);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const __m512 scale =
            _mm512_castps256_ps512(_mm256_mul_ps(a, _mm256_loadu_ps(&x.d[m * blocks + b0])));
        const int8_t* q = x.q_row(m) + b0 * 32;
        for (int j = 0; j < 4; ++j) {
          const __m512i dot = dot64<T>(u[j], _mm512_loadu_si512(q + 64 * j));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                   _mm512_permutexvar_ps(_mm512_load_si512(idx[j].data()), scale),
                                   acc[r]);
        }
        if constexpr (!F::kSigned) {
          // The inputs' scaled sums per 16, added in pairs: one per block.
          const __m512 s16 = _mm512_loadu_ps(x.s_row(m) + 2 * b0);
          const __m512 s32 = _mm512_permutexvar_ps(
              pair_sums, _mm512_add_ps(s16, _mm512_permute_ps(s16, 0xB1)));
          off[r] = _mm256_fmadd_ps(b, _mm512_castps512_ps256(s32), off[r]);
        }
      }
    }
    // The last blocks (K not a multiple of 256) one at a time.
    __m256 tail[R];
    float tail_off[R] = {};
    for (int r = 0; r < R; ++r) tail[r] = _mm256_setzero_ps();
    for (int64_t b = whole; b < blocks; ++b) {
      const uint8_t* blk = row + b * F::kBytes;
      float sa[2], sb[2];
      F::scales(blk, sa, sb);
      group_step<T, R>(group_vector<T>(blk, 0), sa[0], sa[1], x, m0, b, tail);
      for (int r = 0; r < R; ++r) {
        const float* s = x.s_row(m0 + r) + 2 * b;
        tail_off[r] += sb[0] * (s[0] + s[1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      out[r * out_stride + n] =
          _mm512_reduce_add_ps(acc[r]) + hsum(off[r]) + hsum(tail[r]) + tail_off[r];
    }
  }
}
#endif

// Output columns [n0, n1) for input rows [m0, m0 + R). Groups alternate between
// two sets of sums, so that two multiply-add chains are in flight. The offsets
// (b * dx * sum(qx)) go per block: one scalar per row for a block of 32, two 8-lane
// products per row for the 16 halves of a block of 256.
template <int64_t T, int R>
void dot_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0, int64_t K,
              float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  using F = Format<T>;
  if constexpr (F::kGroups == 8) {
    kquant_rows<T, R>(w, row_bytes, x, m0, K, out, out_stride, n0, n1);
    return;
  }
#ifdef PYLLM_QUANT_ZMM
  block32_rows<T, R>(w, row_bytes, x, m0, K, out, out_stride, n0, n1);
  return;
#endif
  const int64_t blocks = K / F::kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[2][R];
    float offset[2][R];
    for (int r = 0; r < R; ++r) {
      acc[0][r] = acc[1][r] = _mm256_setzero_ps();
      offset[0][r] = offset[1][r] = 0.0f;
    }
    if constexpr (F::kGroups == 1) {
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
    } else {
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = row + b * F::kBytes;
        prefetch_ahead<F::kBytes>(blk);
        alignas(32) float a[16], off[16];
        F::scales(blk, a, off);
        for (int g = 0; g < 8; g += 2) {
          const int64_t group = b * 8 + g;
          group_step<T, R>(group_vector<T>(blk, g), a[2 * g], a[2 * g + 1], x, m0, group,
                           acc[0]);
          group_step<T, R>(group_vector<T>(blk, g + 1), a[2 * g + 2], a[2 * g + 3], x, m0,
                           group + 1, acc[1]);
        }
        const __m256 off_lo = _mm256_load_ps(off), off_hi = _mm256_load_ps(off + 8);
        for (int r = 0; r < R; ++r) {
          const float* s = x.s_row(m0 + r) + 16 * b;
          acc[0][r] = _mm256_fmadd_ps(off_lo, _mm256_loadu_ps(s), acc[0][r]);
          acc[1][r] = _mm256_fmadd_ps(off_hi, _mm256_loadu_ps(s + 8), acc[1][r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      out[r * out_stride + n] =
          hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + (offset[0][r] + offset[1][r]);
    }
  }
}

#else  // portable

template <int64_t T, int R>
void dot_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0, int64_t K,
              float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  using F = Format<T>;
  const int64_t blocks = K / F::kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float acc[R] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * F::kBytes;
      float a[2 * F::kGroups], off[2 * F::kGroups];
      F::scales(blk, a, off);
      for (int g = 0; g < F::kGroups; ++g) {
        const int64_t group = b * F::kGroups + g;
        uint8_t u[32];
        group_quants<T>(blk, g, u);
        for (int r = 0; r < R; ++r) {
          const int8_t* q = x.q_row(m0 + r) + group * 32;
          int32_t dot[2] = {0, 0};
          for (int l = 0; l < 32; ++l) {
            const int32_t wv = F::kSigned ? int32_t(int8_t(u[l])) : int32_t(u[l]);
            dot[l / 16] += wv * int32_t(q[l]);
          }
          const float dx = x.dx(m0 + r, group);
          const float* s = x.s_row(m0 + r) + 2 * group;
          acc[r] += dx * (a[2 * g] * float(dot[0]) + a[2 * g + 1] * float(dot[1])) +
                    off[2 * g] * s[0] + off[2 * g + 1] * s[1];
        }
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride + n] = acc[r];
  }
}

#endif

template <int64_t T>
void dot_tile(int rows, const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
              int64_t K, float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  switch (rows) {
    case 1: dot_rows<T, 1>(w, row_bytes, x, m0, K, out, out_stride, n0, n1); break;
    case 2: dot_rows<T, 2>(w, row_bytes, x, m0, K, out, out_stride, n0, n1); break;
    case 3: dot_rows<T, 3>(w, row_bytes, x, m0, K, out, out_stride, n0, n1); break;
    case 4: dot_rows<T, 4>(w, row_bytes, x, m0, K, out, out_stride, n0, n1); break;
    case 5: dot_rows<T, 5>(w, row_bytes, x, m0, K, out, out_stride, n0, n1); break;
    case 6: dot_rows<T, 6>(w, row_bytes, x, m0, K, out, out_stride, n0, n1); break;
    case 7: dot_rows<T, 7>(w, row_bytes, x, m0, K, out, out_stride, n0, n1); break;
    default: dot_rows<T, kTileRows>(w, row_bytes, x, m0, K, out, out_stride, n0, n1); break;
  }
}

// Float32 results [M, N] for all rows. Threads take strips of columns from a shared
// counter, each running every row tile over its strip (small enough for its weight
// bytes to stay in L2 between tiles). A fixed half each left one thread waiting for
// the other at the end of every call on a virtual machine's shared cores: two
// single-threaded processes streamed 13.6 GB/s together where one call split in
// halves made 9.5.
template <int64_t T>
void quant_matmul(const uint8_t* w, int64_t N, int64_t K, const QuantizedRows& x, int64_t M,
                  float* out, int64_t out_stride) {
  using F = Format<T>;
  const int64_t row_bytes = K / F::kBlock * F::kBytes;
  const int64_t strip = std::clamp<int64_t>((64 << 10) / std::max<int64_t>(row_bytes, 1), 1, N);
  const int64_t threads = N * K < kGrainWeights ? 1 : at::get_num_threads();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t n0 = next.fetch_add(strip); n0 < N; n0 = next.fetch_add(strip)) {
      const int64_t n1 = std::min(N, n0 + strip);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        dot_tile<T>(rows, w, row_bytes, x, m0, K, out + m0 * out_stride, out_stride, n0, n1);
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Dequantization of whole rows (portable: it runs once per looked-up token).

template <int64_t T, typename scalar_t>
void dequantize_row(const uint8_t* row, int64_t K, scalar_t* y) {
  using F = Format<T>;
  for (int64_t b = 0; b < K / F::kBlock; ++b) {
    const uint8_t* blk = row + b * F::kBytes;
    float a[2 * F::kGroups], off[2 * F::kGroups];
    F::scales(blk, a, off);
    for (int g = 0; g < F::kGroups; ++g) {
      uint8_t u[32];
      group_quants<T>(blk, g, u);
      scalar_t* yg = y + b * F::kBlock + g * 32;
      for (int l = 0; l < 32; ++l) {
        const float q = F::kSigned ? float(int8_t(u[l])) : float(u[l]);
        yg[l] = static_cast<scalar_t>(a[2 * g + l / 16] * q + off[2 * g + l / 16]);
      }
    }
  }
}

// Float32 values of one row: vectorized where group_vector exists.
template <int64_t T>
void dequantize_row_f32(const uint8_t* row, int64_t K, float* y) {
#ifdef PYLLM_QUANT_AVX2
  using F = Format<T>;
  for (int64_t b = 0; b < K / F::kBlock; ++b) {
    const uint8_t* blk = row + b * F::kBytes;
    float a[2 * F::kGroups], off[2 * F::kGroups];
    F::scales(blk, a, off);
    for (int g = 0; g < F::kGroups; ++g) {
      const __m256i u = group_vector<T>(blk, g);
      const __m128i halves[2] = {_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)};
      float* yg = y + b * F::kBlock + g * 32;
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = _mm256_set1_ps(a[2 * g + h]), offset = _mm256_set1_ps(off[2 * g + h]);
        const __m128i lo = halves[h], hi = _mm_srli_si128(halves[h], 8);
        const __m256i q0 = F::kSigned ? _mm256_cvtepi8_epi32(lo) : _mm256_cvtepu8_epi32(lo);
        const __m256i q1 = F::kSigned ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi);
        _mm256_storeu_ps(yg + 16 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), scale, offset));
        _mm256_storeu_ps(yg + 16 * h + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), scale, offset));
      }
    }
  }
#else
  dequantize_row<T>(row, K, y);
#endif
}

// ---------------------------------------------------------------------------
// Many rows: the int8 tiles above decode each group once per 8 rows, which leaves
// the arithmetic well below the float units' peak. Where packed_linear's register
// tile runs for the input dtype (AVX-512: float32 FMA, bf16 vdpbf16ps), each thread
// instead dequantizes a panel of 16 * NB columns into its word-packed layout in a
// buffer that stays in L2, and runs the tile over all input rows: the weight is
// decoded once per call, and the products are packed_linear's.

// Input rows from which the panel path is taken: decoding a panel costs about as
// much as 16 rows of products (benchmarks/quant_linear.py, SmolLM2 Q4_1 and Q4_K:
// 16 rows 48-52 ms by panels against about 45 by int8 tiles, 64 rows 79-81 ms).
constexpr int64_t kPanelMinRows = 32;

template <int64_t T, typename S>
void dequantize_panel(const uint8_t* w, int64_t row_bytes, int64_t n0, int nb, int64_t K,
                      float* row, S* row_words, S* panel) {
  constexpr int E = vec::WordOps<S>::kElems;
  for (int c = 0; c < nb * vec::kLanes; ++c) {
    dequantize_row_f32<T>(w + (n0 + c) * row_bytes, K, row);
    const S* words = reinterpret_cast<const S*>(row);
    if constexpr (!std::is_same_v<S, float>) {
      for (int64_t k = 0; k < K; k += vec::kLanes) vec::Vec16::load(row + k).store(row_words + k);
      words = row_words;
    }
    // Word k / E of column c goes to block c / 16, word k / E, lane c % 16.
    const auto* src = reinterpret_cast<const uint32_t*>(words);
    auto* dst = reinterpret_cast<uint32_t*>(panel + (c / vec::kLanes) * K * vec::kLanes) +
                c % vec::kLanes;
    for (int64_t i = 0; i < K / E; ++i) dst[i * vec::kLanes] = src[i];
  }
}

template <typename S, int NB>
void panel_rows(const S* x, int64_t x_stride, int64_t M, const S* panel, int64_t K,
                const S* bias, S* out, int64_t ld) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows) {
    packed_tile<S, kTileRows, NB>(x + m * x_stride, x_stride, panel, K, bias, out + m * ld, ld,
                                  nullptr, 0);
  }
  auto tail = [&](auto rows) {
    packed_tile<S, decltype(rows)::value, NB>(x + m * x_stride, x_stride, panel, K, bias,
                                              out + m * ld, ld, nullptr, 0);
  };
  switch (M - m) {
    case 1: tail(std::integral_constant<int, 1>{}); break;
    case 2: tail(std::integral_constant<int, 2>{}); break;
    case 3: tail(std::integral_constant<int, 3>{}); break;
    case 4: tail(std::integral_constant<int, 4>{}); break;
    case 5: tail(std::integral_constant<int, 5>{}); break;
    case 6: tail(std::integral_constant<int, 6>{}); break;
    case 7: tail(std::integral_constant<int, 7>{}); break;
    default: break;
  }
}

// Columns [0, N / 16 * 16) of out = x . W^T (+ bias), in x's dtype S.
template <int64_t T, typename S>
void panel_matmul(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const S* x,
                  int64_t x_stride, int64_t M, const S* bias, S* out, int64_t ld) {
  constexpr int NB = tile_blocks(kTileRows);
  const int64_t panels = (N / vec::kLanes + NB - 1) / NB;
  // Panels from a shared counter, as quant_matmul's strips.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(panels, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    std::vector<float> row(K);
    std::vector<S> row_words(K), panel(NB * vec::kLanes * K);
    for (int64_t p = next++; p < panels; p = next++) {
      const int64_t n0 = p * NB * vec::kLanes;
      const int nb = static_cast<int>(std::min<int64_t>(NB, N / vec::kLanes - p * NB));
      dequantize_panel<T>(w, row_bytes, n0, nb, K, row.data(), row_words.data(), panel.data());
      const S* b = bias ? bias + n0 : nullptr;
      if (nb == NB) {
        panel_rows<S, NB>(x, x_stride, M, panel.data(), K, b, out + n0, ld);
      } else if (nb == 2) {
        panel_rows<S, 2>(x, x_stride, M, panel.data(), K, b, out + n0, ld);
      } else {
        panel_rows<S, 1>(x, x_stride, M, panel.data(), K, b, out + n0, ld);
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Many rows on CPUs with AMX (a build whose -march names one): the tile unit
// multiplies bf16 at several times the vector units' rate. Its B operand must hold
// pairs of K for 16 columns per 64-byte row, so the roles are swapped: the weight
// (32 of its rows at a time, dequantized to bf16 in a buffer that stays in L1/L2)
// is the A operand, as it lies; the inputs, rearranged once per call into such
// pairs for 16 rows at a time, are B; each 16 x 16 float32 tile of sums is
// out^T. For bf16 inputs only: rounding float32 inputs and weights to bf16 moved
// SmolLM2's float32 logits visibly (correlation with the widened model's down to
// 0.9975 against >= 0.999 for the float32 panels), so float32 keeps float products.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PYLLM_QUANT_AMX 1

// Input rows from which the tile unit takes over from the int8 tiles.
constexpr int64_t kAmxMinRows = 16;

// Linux hands out the tile registers' state only on request, once per process.
bool amx_ready() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// Tiles 0-3: four 16 x 16 float32 sums; 4, 5: 16 weight rows each; 6, 7: 16 input
// rows each. Every tile is 16 rows of 64 bytes.
void load_tile_config() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// One weight row as bf16.
template <int64_t T>
void dequantize_row_bf16(const uint8_t* row, int64_t K, c10::BFloat16* y) {
  using F = Format<T>;
  for (int64_t b = 0; b < K / F::kBlock; ++b) {
    const uint8_t* blk = row + b * F::kBytes;
    float a[2 * F::kGroups], off[2 * F::kGroups];
    F::scales(blk, a, off);
    for (int g = 0; g < F::kGroups; ++g) {
      const __m256i u = group_vector<T>(blk, g);
      __m512 half[2];
      for (int h = 0; h < 2; ++h) {
        const __m128i q = h ? _mm256_extracti128_si256(u, 1) : _mm256_castsi256_si128(u);
        const __m512i i = F::kSigned ? _mm512_cvtepi8_epi32(q) : _mm512_cvtepu8_epi32(q);
        half[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(a[2 * g + h]),
                                  _mm512_set1_ps(off[2 * g + h]));
      }
      _mm512_storeu_si512(y + b * F::kBlock + g * 32,
                          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(half[1], half[0])));
    }
  }
}

// Rows [0, M) of x as bf16 pairs of K for 16 rows at a time: word k / 2 of row m
// at [m / 16][k / 2][m % 16]; rows past M are zero, up to a multiple of 32.
template <typename S>
std::vector<uint32_t> pair_inputs(const S* x, int64_t x_stride, int64_t M, int64_t K) {
  const int64_t rows = (M + 31) / 32 * 32, words = K / 2;
  std::vector<uint32_t> pairs(rows * words, 0);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<c10::BFloat16> row(K);
    for (int64_t m = m0; m < m1; ++m) {
      const S* src = x + m * x_stride;
      for (int64_t k = 0; k < K; k += vec::kLanes) vec::Vec16::load(src + k).store(row.data() + k);
      const auto* word = reinterpret_cast<const uint32_t*>(row.data());
      uint32_t* dst = pairs.data() + (m / 16) * words * 16 + m % 16;
      for (int64_t i = 0; i < words; ++i) dst[i * 16] = word[i];
    }
  });
  return pairs;
}

// sums[n][m] (32 x 32) = weight rows [0, 32) (bf16 rows of K) . input rows [0, 32).
inline void amx_chunk(const c10::BFloat16* wrows, const uint32_t* pairs, int64_t K, float* sums) {
  const int64_t w_bytes = K * 2, words = K / 2;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, wrows + k, w_bytes);
    _tile_loadd(5, wrows + 16 * K + k, w_bytes);
    _tile_loadd(6, pairs + k / 2 * 16, 64);
    _tile_loadd(7, pairs + (words + k / 2) * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, sums, 128);
  _tile_stored(1, sums + 16, 128);
  _tile_stored(2, sums + 16 * 32, 128);
  _tile_stored(3, sums + 16 * 32 + 16, 128);
}

// Columns [0, N / 32 * 32) of out = x . W^T (+ bias); returns how many.
template <int64_t T, typename S>
int64_t amx_matmul(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const S* x,
                   int64_t x_stride, int64_t M, const S* bias, S* out, int64_t ld) {
  const int64_t panels = N / 32;
  const std::vector<uint32_t> pairs = pair_inputs(x, x_stride, M, K);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(panels, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    load_tile_config();
    std::vector<c10::BFloat16> wrows(32 * K);
    alignas(64) float sums[32 * 32];
    for (int64_t p = next++; p < panels; p = next++) {
      const int64_t n0 = p * 32;
      for (int n = 0; n < 32; ++n) {
        dequantize_row_bf16<T>(w + (n0 + n) * row_bytes, K, wrows.data() + n * K);
      }
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        amx_chunk(wrows.data(), pairs.data() + m0 * K / 2, K, sums);
        for (int64_t m = m0; m < std::min(M, m0 + 32); ++m) {
          S* o = out + m * ld + n0;
          for (int n = 0; n < 32; ++n) {
            o[n] = static_cast<S>(sums[n * 32 + (m - m0)] +
                                  (bias ? static_cast<float>(bias[n0 + n]) : 0.0f));
          }
        }
      }
    }
    _tile_release();
  });
  return panels * 32;
}
#endif

// ---------------------------------------------------------------------------
// Many float32 rows where neither AMX nor packed_linear's tile runs (AVX2 and
// portable builds): W in chunks dequantized to float32 (about 2 MiB each, so that
// a chunk stays in L2 while it is multiplied), each multiplied by ATen's matmul,
// the GEMM that float weights take on these CPUs.
constexpr int64_t kGemmMinRows = 64;

template <int64_t T>
void gemm_matmul(const at::Tensor& input, const uint8_t* w, int64_t row_bytes, int64_t N,
                 const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t K = input.size(1);
  const int64_t chunk = std::clamp<int64_t>((2 << 20) / (4 * K) / 16 * 16, 16, N);
  at::Tensor dense = at::empty({chunk, K}, input.options());
  float* d = dense.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t c = std::min(chunk, N - n0);
    at::parallel_for(0, c, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        dequantize_row_f32<T>(w + (n0 + r) * row_bytes, K, d + r * K);
      }
    });
    at::Tensor part = out.narrow(1, n0, c);
    const at::Tensor wt = dense.narrow(0, 0, c).t();
    if (bias.has_value()) {
      at::addmm_out(part, bias->narrow(0, n0, c), input, wt);
    } else {
      at::mm_out(part, input, wt);
    }
  }
}

int64_t block_size_of(int64_t type) {
  int64_t size = 0;
  dispatch_type(type, [&](auto t) { size = Format<decltype(t)::value>::kBlock; });
  return size;
}

int64_t block_bytes_of(int64_t type) {
  int64_t bytes = 0;
  dispatch_type(type, [&](auto t) { bytes = Format<decltype(t)::value>::kBytes; });
  return bytes;
}

// qweight [N, row_bytes] uint8 for K input features of type qtype; returns N.
int64_t check_qweight(const at::Tensor& qweight, int64_t qtype, int64_t K) {
  TORCH_CHECK(block_size_of(qtype) != 0, "qtype ", qtype,
              " is not a supported GGML quantization type");
  TORCH_CHECK(K % block_size_of(qtype) == 0, "in_features (", K,
              ") must be a multiple of the block size ", block_size_of(qtype));
  TORCH_CHECK(qweight.device().is_cpu() && qweight.dim() == 2 && qweight.is_contiguous() &&
                  qweight.scalar_type() == at::kByte &&
                  qweight.size(1) == K / block_size_of(qtype) * block_bytes_of(qtype),
              "qweight must be a contiguous CPU uint8 tensor [out_features, ",
              K / block_size_of(qtype) * block_bytes_of(qtype), "], got ", qweight.sizes());
  return qweight.size(0);
}

}  // namespace

void quant_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& qweight,
                  int64_t qtype, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu() && input.dim() == 2 &&
                  (input.size(1) <= 1 || input.stride(1) == 1),
              "input must be a CPU tensor [rows, in_features] with packed rows, got ",
              input.sizes());
  const int64_t M = input.size(0), K = input.size(1);
  const int64_t N = check_qweight(qweight, qtype, K);
  const auto dtype = input.scalar_type();
  // out's rows may be strided: a fused projection writes each part into its columns.
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == dtype && out.dim() == 2 &&
                  out.size(0) == M && out.size(1) == N && (N <= 1 || out.stride(1) == 1),
              "out must be a CPU tensor [", M, ", ", N, "] with packed rows in input's dtype");
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N &&
                    bias->is_contiguous() && bias->scalar_type() == dtype,
                "bias must be a contiguous CPU tensor [", N, "] in input's dtype");
  }
  if (M == 0 || N == 0) return;
  PYLLM_DISPATCH_FLOATING_TYPES(dtype, "quant_linear", [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    const uint8_t* w = qweight.const_data_ptr<uint8_t>();
    const int64_t row_bytes = qweight.size(1);
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t ld = out.stride(0);
    const scalar_t* b = bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr;
    // Columns the panel path takes (whole blocks of 16); the int8 tiles do the rest.
    int64_t n_panel = 0;
#ifdef PYLLM_QUANT_AMX
    if (std::is_same_v<scalar_t, c10::BFloat16> && M >= kAmxMinRows && amx_ready()) {
      dispatch_type(qtype, [&](auto t) {
        n_panel = amx_matmul<decltype(t)::value>(w, row_bytes, N, K, in, input.stride(0), M, b,
                                                 o, ld);
      });
    }
#endif
    if constexpr (kPackedLinearVectorized<scalar_t>) {
      if (n_panel == 0 && M >= kPanelMinRows) {
        n_panel = N / vec::kLanes * vec::kLanes;
        dispatch_type(qtype, [&](auto t) {
          panel_matmul<decltype(t)::value>(w, row_bytes, N, K, in, input.stride(0), M, b, o,
                                           ld);
        });
      }
    }
    if constexpr (std::is_same_v<scalar_t, float> && !kPackedLinearVectorized<scalar_t>) {
      if (n_panel == 0 && M >= kGemmMinRows) {
        dispatch_type(qtype, [&](auto t) {
          gemm_matmul<decltype(t)::value>(input, w, row_bytes, N, bias, out);
        });
        return;
      }
    }
    const int64_t rest = N - n_panel;
    if (rest == 0) return;
    const QuantizedRows x = quantize_rows(in, input.stride(0), M, K, block_size_of(qtype));
    // float32 out is written in place; other dtypes through a float32 buffer.
    constexpr bool kFloat = std::is_same_v<scalar_t, float>;
    std::vector<float> buffer(kFloat ? 0 : M * rest);
    float* y = kFloat ? reinterpret_cast<float*>(o + n_panel) : buffer.data();
    const int64_t y_ld = kFloat ? ld : rest;
    dispatch_type(qtype, [&](auto t) {
      quant_matmul<decltype(t)::value>(w + n_panel * row_bytes, rest, K, x, M, y, y_ld);
    });
    if (b != nullptr || !kFloat) {
      at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m) {
          for (int64_t n = 0; n < rest; ++n) {
            const float v = y[m * y_ld + n] + (b ? static_cast<float>(b[n_panel + n]) : 0.0f);
            o[m * ld + n_panel + n] = static_cast<scalar_t>(v);
          }
        }
      });
    }
  });
}

void dequantize_rows(at::Tensor& out, const at::Tensor& qweight, int64_t qtype,
                     const std::optional<at::Tensor>& rows) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.is_contiguous(),
              "out must be a contiguous CPU tensor [rows, in_features], got ", out.sizes());
  const int64_t K = out.size(1);
  const int64_t N = check_qweight(qweight, qtype, K);
  const int64_t R = out.size(0);
  const int64_t* index = nullptr;
  if (rows.has_value()) {
    TORCH_CHECK(rows->device().is_cpu() && rows->dim() == 1 && rows->is_contiguous() &&
                    rows->scalar_type() == at::kLong && rows->size(0) == R,
                "rows must be a contiguous CPU int64 tensor [", R, "] (one per row of out)");
    index = rows->const_data_ptr<int64_t>();
    for (int64_t i = 0; i < R; ++i) {
      TORCH_CHECK(index[i] >= 0 && index[i] < N, "rows[", i, "] = ", index[i],
                  " is outside [0, ", N, ")");
    }
  } else {
    TORCH_CHECK(R == N, "out must have one row per qweight row (", N, ") when rows is None");
  }
  const int64_t row_bytes = qweight.size(1);
  const uint8_t* w = qweight.const_data_ptr<uint8_t>();
  PYLLM_DISPATCH_FLOATING_TYPES(out.scalar_type(), "dequantize_rows", [&] {
    scalar_t* y = out.data_ptr<scalar_t>();
    dispatch_type(qtype, [&](auto t) {
      at::parallel_for(0, R, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(K, 1)),
                       [&](int64_t r0, int64_t r1) {
                         for (int64_t r = r0; r < r1; ++r) {
                           const int64_t src = index ? index[r] : r;
                           dequantize_row<decltype(t)::value>(w + src * row_bytes, K, y + r * K);
                         }
                       });
    });
  });
}

}  // namespace pyllm::cpu
