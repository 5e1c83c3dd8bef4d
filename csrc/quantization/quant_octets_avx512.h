// The 4-bit formats with 16 nibble bytes per block of 32 (Q4_0, Q4_1, MXFP4) under
// AVX-512 VNNI, eight blocks (an octet, 256 weights) at a time, with every product
// of the octet summed in one int32 vector per input row.
//
// block32_rows gives each 64-byte dot product two blocks, so every pair needs its
// own float conversion, scale permute and multiply-add per input row: batch-1 decode
// of 4-bit weights was compute-bound (Q4_0 2880x2880, 2 threads, 20 GB/s where Q8_0
// streams 30), and 8 rows ran at 6 GB/s. Here the octet's weights are rearranged so
// that 32-bit lane l of all four of its dot products holds weights of block l % 8:
//   lanes 0-7:  dword i of blocks 0-7,   lanes 8-15: dword i + 1 of blocks 0-7,
// for (i, nibble) = (0, low), (0, high), (2, low), (2, high), where dword i of a
// block's nibble bytes holds weights 4i..4i+3 (low nibbles) and 16+4i.. (high). The
// four products then share one per-lane scale vector and add as integers, leaving
// one conversion and one multiply-add per row per octet. The input rows are
// rearranged to match once per call (a few percent of the products' work).
//
// Offsets are integers added to each row's sums before the products: Q4_0's codes
// are unsigned with -8 (each row's sums start at -8 times its inputs' lane sums);
// MXFP4's values are looked up as value + 12 (unsigned, vpdpbusd's unsigned side)
// and start at -12 times the lane sums, so its results stay exact at every scale.
// Q4_1's min adds min * dx * (the inputs' lane sums) per octet.
//
// With VBMI, MXFP4 (17-byte blocks: an octet is 136 bytes) takes its codes by byte
// permutes from four 64-byte loads and its values from a 64-entry table that needs
// no nibble masks; its E8M0 scales become each row's scale by one vscalefps.
#pragma once

#include <array>
#include <vector>

#include "quant_groups_avx2.h"

namespace pyllm::cpu {
namespace {

constexpr bool is_octet_format(int64_t type) {
  return type == kQ4_0 || type == kQ4_1 || type == kMXFP4;
}
template <int64_t T>
inline constexpr bool kOctetFormat = is_octet_format(T);

// Lane l of rearranged vector v (0-3): the dword (of the 8 of its block of 32) it
// holds. Q4_K's groups are plain runs of 32 nibbles, taken in order.
template <int64_t T>
constexpr int octet_dword(int v, int l) {
  return T == kQ4_K ? 2 * v + l / 8 : (v / 2) * 2 + l / 8 + (v % 2) * 4;
}

// MXFP4's values + this are unsigned.
constexpr int kMxfp4Offset = 12;

// Input rows [m0, m0 + R), their whole octets rearranged: per row and octet four
// 64-byte vectors, then the 16 lane sums (int32 times the offset for Q4_0 and MXFP4;
// float x * dx for Q4_1 and Q4_K).
struct OctetRows {
  uint8_t* q = nullptr;
  int32_t* sums = nullptr;
  int64_t octets = 0;
  const uint8_t* vectors(int r, int64_t o) const { return q + (r * octets + o) * 256; }
  const int32_t* lane_sums(int r, int64_t o) const { return sums + (r * octets + o) * 16; }
};

template <int64_t T>
OctetRows rearrange_rows(const QuantizedRows& x, int64_t m0, int R, int64_t octets) {
  thread_local std::vector<uint8_t> storage;
  const size_t bytes = static_cast<size_t>(R * octets) * (256 + 64) + 64;
  if (storage.size() < bytes) storage.resize(bytes);
  OctetRows out;
  const auto base = reinterpret_cast<uintptr_t>(storage.data());
  out.q = reinterpret_cast<uint8_t*>((base + 63) & ~uintptr_t{63});
  out.sums = reinterpret_cast<int32_t*>(out.q + R * octets * 256);
  out.octets = octets;
  // Vector v, lane l: block b = l % 8 lives in source vector b / 2, at dword
  // (b % 2) * 8 + octet_dword(v, l); the second source of each permute is +16.
  alignas(64) static const auto index = [] {
    std::array<std::array<int32_t, 16>, 4> idx{};
    for (int v = 0; v < 4; ++v) {
      for (int l = 0; l < 16; ++l) {
        const int b = l % 8;
        idx[v][l] = (b / 2 % 2) * 16 + (b % 2) * 8 + octet_dword<T>(v, l);
      }
    }
    return idx;
  }();
  const __mmask16 upper_sources = 0xF0F0;  // lanes of blocks 4-7
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    for (int64_t o = 0; o < octets; ++o) {
      const int8_t* src = x.q_row(m) + o * 256;
      __m512i s[4];
      for (int j = 0; j < 4; ++j) s[j] = _mm512_loadu_si512(src + 64 * j);
      auto* dst = const_cast<uint8_t*>(out.vectors(r, o));
      __m512i sum = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        const __m512i idx = _mm512_load_si512(index[v].data());
        __m512i t = _mm512_mask_blend_epi32(upper_sources, _mm512_permutex2var_epi32(s[0], idx, s[1]),
                                            _mm512_permutex2var_epi32(s[2], idx, s[3]));
        sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), t);
        _mm512_store_si512(dst + 64 * v, t);
      }
      auto* sums = const_cast<int32_t*>(out.lane_sums(r, o));
      if constexpr (T == kQ4_0 || T == kMXFP4) {
        const __m512i offset = _mm512_set1_epi32(T == kQ4_0 ? -8 : -kMxfp4Offset);
        _mm512_store_si512(sums, _mm512_mullo_epi32(sum, offset));
      } else if constexpr (T == kQ4_1) {
        const __m512 dx = _mm512_castps256_ps512(_mm256_loadu_ps(&x.d[m * (x.K / 32) + 8 * o]));
        const __m512 dx16 = _mm512_shuffle_f32x4(dx, dx, 0x44);
        _mm512_store_ps(reinterpret_cast<float*>(sums), _mm512_mul_ps(_mm512_cvtepi32_ps(sum), dx16));
      } else {
        static_assert(T == kQ4_K);
        const __m512 dx = _mm512_set1_ps(x.d[m * (x.K / 256) + o]);
        _mm512_store_ps(reinterpret_cast<float*>(sums), _mm512_mul_ps(_mm512_cvtepi32_ps(sum), dx));
      }
    }
  }
  return out;
}

// The octet's weights: codes of the four rearranged vectors (unsigned nibbles; for
// MXFP4 their signed values), and its scales a (and Q4_1's mins) per lane.
template <int64_t T>
inline void octet_weights(const uint8_t* blk, __m512i* w, __m512& a16, __m512& min16) {
  using F = Format<T>;
  alignas(64) static const auto index = [] {
    std::array<std::array<int32_t, 16>, 2> idx{};
    for (int h = 0; h < 2; ++h) {
      for (int l = 0; l < 16; ++l) idx[h][l] = (l % 8 / 4) * 16 + (l % 4) * 4 + 2 * h + l / 8;
    }
    return idx;
  }();
  // Blocks 0-3 and 4-7, their nibble bytes one per 128-bit lane.
  __m512i half[2];
  for (int h = 0; h < 2; ++h) {
    const uint8_t* p = F::nibbles(blk + 4 * h * F::kBytes, 0);
    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    for (int b = 1; b < 4; ++b) {
      const auto* q = reinterpret_cast<const __m128i*>(p + b * F::kBytes);
      v = _mm512_mask_broadcast_i32x4(v, static_cast<__mmask16>(0xF << (4 * b)), _mm_loadu_si128(q));
    }
    half[h] = v;
  }
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    const __m512i d = _mm512_permutex2var_epi32(half[0], _mm512_load_si512(index[h].data()), half[1]);
    w[2 * h] = _mm512_and_si512(d, nib);
    w[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(d, 4), nib);
  }
  __m256 a, b;
  scales8<T>(blk, a, b);
  a16 = _mm512_shuffle_f32x4(_mm512_castps256_ps512(a), _mm512_castps256_ps512(a), 0x44);
  if constexpr (T == kQ4_1) {
    min16 = _mm512_shuffle_f32x4(_mm512_castps256_ps512(b), _mm512_castps256_ps512(b), 0x44);
  }
  if constexpr (T == kMXFP4) {
    const __m512i values = _mm512_add_epi8(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values))),
        _mm512_set1_epi8(kMxfp4Offset));
    for (int v = 0; v < 4; ++v) w[v] = _mm512_shuffle_epi8(values, w[v]);
  }
}

#if defined(__AVX512VBMI__)
// MXFP4's octet by byte permutes: codes of dwords 0-1 from bytes [0, 128), of dwords
// 2-3 from [8, 136); values + offset from a table repeated four times (vpermb reads
// six index bits); lane l's exponent, minus 128, as a float (scale 2^(e - 128)).
inline void mxfp4_octet(const uint8_t* blk, __m512i* w, __m512& exponent16) {
  using F = Format<kMXFP4>;
  struct Tables {
    std::array<uint8_t, 64> codes[2], exponents, values;
  };
  alignas(64) static const Tables t = [] {
    Tables v{};
    for (int p = 0; p < 64; ++p) {
      const int l = p / 4, b = l % 8, i = p % 4;
      for (int h = 0; h < 2; ++h) {
        const int dword = 2 * h + l / 8;
        v.codes[h][p] = static_cast<uint8_t>(b * F::kBytes + F::kQs + 4 * dword + i - 8 * h);
      }
      v.exponents[p] = static_cast<uint8_t>(b * F::kBytes + F::kE);
      v.values[p] = static_cast<uint8_t>(kMxfp4Values[p % 16] + kMxfp4Offset);
    }
    return v;
  }();
  const __m512i values = _mm512_load_si512(t.values.data());
  for (int h = 0; h < 2; ++h) {
    const uint8_t* p = blk + 8 * h;
    const __m512i d = _mm512_permutex2var_epi8(
        _mm512_loadu_si512(p), _mm512_load_si512(t.codes[h].data()), _mm512_loadu_si512(p + 64));
    w[2 * h] = _mm512_permutexvar_epi8(d, values);
    w[2 * h + 1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(d, 4), values);
  }
  const __m512i e = _mm512_maskz_permutex2var_epi8(
      0x1111111111111111ULL, _mm512_loadu_si512(blk), _mm512_load_si512(t.exponents.data()),
      _mm512_loadu_si512(blk + 64));
  exponent16 = _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(128)));
}
#endif

#if defined(__AVX512VBMI__)
// Q4_0's and Q4_1's octet (144 or 160 bytes) by byte permutes from three 64-byte
// loads, bytes [0, 128) and its last 64: the same vectors and scales as octet_weights,
// whose sixteen 16-byte inserts and gather of the scales were most of a batch-1
// product's instructions.
template <int64_t T>
inline void nibble_octet(const uint8_t* blk, __m512i* w, __m512& a16, __m512& min16) {
  using F = Format<T>;
  constexpr int kFar = 8 * F::kBytes - 64;  // the third load's offset
  constexpr int kMin = T == kQ4_1 ? Layout<kQ4_1>::kM : F::kD;
  struct Tables {
    std::array<uint8_t, 64> near[3], far[3];  // two code vectors, then the scales
    uint64_t far_mask[3];
  };
  alignas(64) static const Tables t = [] {
    Tables v{};
    auto put = [&v](int k, int p, int offset) {
      if (offset < 128) {
        v.near[k][p] = static_cast<uint8_t>(offset);
      } else {
        v.far[k][p] = static_cast<uint8_t>(offset - kFar);
        v.far_mask[k] |= uint64_t{1} << p;
      }
    };
    for (int p = 0; p < 64; ++p) {
      const int l = p / 4, b = l % 8, i = p % 4;
      for (int h = 0; h < 2; ++h) put(h, p, b * F::kBytes + F::kQs + 4 * (2 * h + l / 8) + i);
    }
    // Bytes [0, 16): the eight blocks' fp16 scales d; [16, 32): Q4_1's mins m.
    for (int p = 0; p < 32; ++p) {
      const int b = p % 16 / 2;
      put(2, p, b * F::kBytes + (p < 16 ? F::kD : kMin) + p % 2);
    }
    return v;
  }();
  const __m512i lo = _mm512_loadu_si512(blk), hi = _mm512_loadu_si512(blk + 64);
  const __m512i far = _mm512_loadu_si512(blk + kFar);
  auto gather = [&](int k) {
    const __m512i v = _mm512_permutex2var_epi8(lo, _mm512_load_si512(t.near[k].data()), hi);
    return _mm512_mask_permutexvar_epi8(v, t.far_mask[k], _mm512_load_si512(t.far[k].data()), far);
  };
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    const __m512i d = gather(h);
    w[2 * h] = _mm512_and_si512(d, nib);
    w[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(d, 4), nib);
  }
  const __m512i sc = gather(2);
  const __m512 a = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm512_castsi512_si128(sc)));
  a16 = _mm512_shuffle_f32x4(a, a, 0x44);
  if constexpr (T == kQ4_1) {
    const __m512 m = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm512_extracti32x4_epi32(sc, 1)));
    min16 = _mm512_shuffle_f32x4(m, m, 0x44);
  }
}
#endif

// The scales of an octet's lanes for input row scales dx16: a16 * dx16, or with
// VBMI's MXFP4 dx16 * 2^exponent16 (the same product, rounded once).
template <int64_t T>
inline constexpr bool kScalefOctets =
#if defined(__AVX512VBMI__)
    T == kMXFP4;
#else
    false;
#endif

// start + the octet's four 64-byte products with rearranged input q, in two chains of
// two: one chain of four vpdpbusd waited on each one's latency (SmolLM2 Q4_1, 8 rows,
// 1 thread: 19.0 -> 17.2 ms). Integer sums, so exact in any order.
inline __m512i octet_dot(__m512i start, const __m512i* wv, const uint8_t* q) {
  __m512i even = _mm512_dpbusd_epi32(start, wv[0], _mm512_load_si512(q));
  __m512i odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[1], _mm512_load_si512(q + 64));
  even = _mm512_dpbusd_epi32(even, wv[2], _mm512_load_si512(q + 128));
  odd = _mm512_dpbusd_epi32(odd, wv[3], _mm512_load_si512(q + 192));
  return _mm512_add_epi32(even, odd);
}

// Columns [n, n + NC) for input rows [m0, m0 + R).
template <int64_t T, int R, int NC>
inline void octet_pass(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x,
                       const OctetRows& xr, int64_t m0, int64_t blocks, float* out,
                       int64_t out_stride, int64_t n) {
  using F = Format<T>;
  const int64_t octets = blocks / 8;
  __m512 acc[R][NC] = {};
  for (int64_t o = 0; o < octets; ++o) {
    __m512i wv[NC][4];
    __m512 a16[NC], min16[NC];
    for (int c = 0; c < NC; ++c) {
      const uint8_t* blk = w + (n + c) * row_bytes + o * 8 * F::kBytes;
      prefetch_ahead<8 * F::kBytes>(blk, row_bytes >= kL2PrefetchRowBytes);
#if defined(__AVX512VBMI__)
      if constexpr (kScalefOctets<T>) {
        mxfp4_octet(blk, wv[c], a16[c]);
      } else if constexpr (T == kQ4_0 || T == kQ4_1) {
        nibble_octet<T>(blk, wv[c], a16[c], min16[c]);
      } else
#endif
      {
        octet_weights<T>(blk, wv[c], a16[c], min16[c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512i start =
          T == kQ4_1 ? _mm512_setzero_si512() : _mm512_load_si512(xr.lane_sums(r, o));
      const __m512 dx = _mm512_castps256_ps512(_mm256_loadu_ps(&x.d[(m0 + r) * blocks + 8 * o]));
      const __m512 dx16 = _mm512_shuffle_f32x4(dx, dx, 0x44);
      const uint8_t* q = xr.vectors(r, o);
      for (int c = 0; c < NC; ++c) {
        const __m512i sum = octet_dot(start, wv[c], q);
        const __m512 scale =
            kScalefOctets<T> ? _mm512_scalef_ps(dx16, a16[c]) : _mm512_mul_ps(a16[c], dx16);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r][c]);
        if constexpr (T == kQ4_1) {
          const __m512 s = _mm512_load_ps(reinterpret_cast<const float*>(xr.lane_sums(r, o)));
          acc[r][c] = _mm512_fmadd_ps(min16[c], s, acc[r][c]);
        }
      }
    }
  }
  float sums[R][NC], tail[NC][R];
  for (int r = 0; r < R; ++r) column_sums<NC>(acc[r], sums[r]);
  for (int c = 0; c < NC; ++c) {
    tail_blocks<T, R>(w + (n + c) * row_bytes, x, m0, octets * 8, blocks, tail[c]);
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < NC; ++c) out[r * out_stride + n + c] = sums[r][c] + tail[c][r];
  }
}

template <int64_t T, int R>
void octet_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
                int64_t K, float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  const int64_t blocks = K / 32;
  const OctetRows xr = rearrange_rows<T>(x, m0, R, blocks / 8);
  column_passes<kPassColumns>(n0, n1, [&](auto nc, int64_t n) {
    octet_pass<T, R, decltype(nc)::value>(w, row_bytes, x, xr, m0, blocks, out, out_stride, n);
  });
}

// Q4_K by the same rearrangement, a block of 256 being eight groups of 32 with 6-bit
// scales and mins: lane l of the four vectors holds weights of group l % 8, so one
// float scale per lane and row replaces kquant_rows' pair sums (vpmaddubsw + vpdpwssd
// per vector), and the mins take the rows' lane sums. The odd groups' codes stay in
// their bytes' high nibbles (one AND per vector, no shift): their sums are 16 times
// the codes' (at most 4 * 4 * 240 * 127, exact in float32), and their lanes' scales
// are divided by 16.
inline void q4k_weights(const uint8_t* blk, __m512i* w, __m512& scale16, __m512& min16) {
  using F = Format<kQ4_K>;
  struct Tables {
    std::array<std::array<int32_t, 16>, 4> index;
    std::array<float, 16> shift;  // 1/16 in the odd groups' lanes
  };
  alignas(64) static const Tables t = [] {
    Tables v{};
    for (int k = 0; k < 4; ++k) {
      for (int l = 0; l < 16; ++l) v.index[k][l] = 8 * (l % 8 / 2) + octet_dword<kQ4_K>(k, l);
    }
    for (int l = 0; l < 16; ++l) v.shift[l] = l % 2 ? 1.0f / 16.0f : 1.0f;
    return v;
  }();
  const uint8_t* qs = F::nibble_bytes(blk, 0);
  const __m512i q0 = _mm512_loadu_si512(qs), q1 = _mm512_loadu_si512(qs + 64);
  const __m512i nibbles = _mm512_set1_epi64(0xF0F0F0F00F0F0F0FLL);  // low, high per lane pair
  for (int v = 0; v < 4; ++v) {
    const __m512i d = _mm512_permutex2var_epi32(q0, _mm512_load_si512(t.index[v].data()), q1);
    w[v] = _mm512_and_si512(d, nibbles);
  }
  const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(blk)));
  uint64_t scales, mins;
  k_scales_mins(blk + F::kScales, scales, mins);
  const __m512i s16 = _mm512_cvtepu8_epi32(_mm_set1_epi64x(static_cast<int64_t>(scales)));
  scale16 = _mm512_mul_ps(_mm512_cvtepi32_ps(s16),
                          _mm512_mul_ps(_mm512_broadcastss_ps(dd), _mm512_load_ps(t.shift.data())));
  const __m512i m16 = _mm512_cvtepu8_epi32(_mm_set1_epi64x(static_cast<int64_t>(mins)));
  min16 = _mm512_mul_ps(_mm512_cvtepi32_ps(m16), _mm512_set1_ps(-_mm_cvtss_f32(_mm_movehdup_ps(dd))));
}

// Columns [n, n + NC) for input rows [m0, m0 + R).
template <int R, int NC>
inline void q4k_pass(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x,
                     const OctetRows& xr, int64_t m0, int64_t blocks, float* out,
                     int64_t out_stride, int64_t n) {
  using F = Format<kQ4_K>;
  __m512 acc[R][NC] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i wv[NC][4];
    __m512 scale16[NC], min16[NC];
    for (int c = 0; c < NC; ++c) {
      const uint8_t* blk = w + (n + c) * row_bytes + b * F::kBytes;
      prefetch_ahead<F::kBytes>(blk, row_bytes >= kL2PrefetchRowBytes);
      q4k_weights(blk, wv[c], scale16[c], min16[c]);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x.d[(m0 + r) * blocks + b]);
      const uint8_t* q = xr.vectors(r, b);
      const __m512 s = _mm512_load_ps(reinterpret_cast<const float*>(xr.lane_sums(r, b)));
      for (int c = 0; c < NC; ++c) {
        const __m512i sum = octet_dot(_mm512_setzero_si512(), wv[c], q);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale16[c], dx),
                                    acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(min16[c], s, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) column_sums<NC>(acc[r], out + r * out_stride + n);
}

template <int R>
void q4k_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0, int64_t K,
              float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  const int64_t blocks = K / 256;
  const OctetRows xr = rearrange_rows<kQ4_K>(x, m0, R, blocks);
  column_passes<kPassColumns>(n0, n1, [&](auto nc, int64_t n) {
    q4k_pass<R, decltype(nc)::value>(w, row_bytes, x, xr, m0, blocks, out, out_stride, n);
  });
}

}  // namespace
}  // namespace pyllm::cpu
