// Quantized weights in strips of 16 rows (output columns), for the CPU: each strip's
// blocks interleaved so that one 64-byte load holds eight weights of each of its 16
// columns, and an integer dot product per load leaves one column's sum in each
// 32-bit lane (quant_strips_avx512.h; on AVX2 each 64-byte vector is two halves of
// 8 columns, quant_strips_avx2.h). GGUF's layout keeps a column's weights in their
// own blocks, so a kernel over it either sums across lanes or rearranges bytes per
// block (quant_octets_avx512.h); that work, not the memory, bounded decode of 4-bit
// files at small row counts (AVX2 too: TinyLlama Q4_K_M's projections streamed 27
// GB/s as GGUF rows at one row, 30 as strips).
//
// Same bytes as GGUF, same tensor shape [N, row_bytes]: strip i (rows 16i..16i+15)
// occupies the strip's 16 * row_bytes bytes, as unit after unit of 16 columns (a
// unit: one block of 256 weights for Q4_K, of 32 for Q4_0 and Q4_1). Rows past the
// last whole strip stay in GGUF's layout. In every unit the weights come as 64-byte
// vectors of 8 weights of the 16 columns: vector v, lane c (4 bytes), byte j holds
// weight 8v + j of column c (low nibble) and 8v + 4 + j (high nibble).
//
// Q4_0, Q4_1 (16 x 18 or 20 bytes): d (fp16) of column c at 2c; Q4_1's m at 32 + 2c;
// then the 4 weight vectors. MXFP4 (16 x 17 bytes): the E8M0 byte of column c at c,
// then the 4 vectors of codes. Q8_0 (16 x 34 bytes): d, then 8 vectors of 4 weights per
// lane (vector v: weights 4v..4v+3), each weight + 128 (an unsigned byte). Q5_0, Q5_1
// (16 x 22 or 24 bytes): as Q4_0, Q4_1, then one vector of fifth bits, as Q5_K's below.
//
// Q4_K (16 x 144 bytes), column c, sub-block s (weights 32s..32s+31 of the block):
//   [0, 32)      d (fp16) of column c at 2c
//   [32, 64)     dmin (fp16) at 32 + 2c
//   [64, 192)    for each pair p = s / 2: 32 bytes, (scale, min) byte of sub-block
//                2p then 2p + 1 of column c at 64 + 32p + 2c + s % 2; a byte holds
//                the 6-bit scale and the min's low 2 bits (bits 6, 7)
//   [192, 256)   the min's high 4 bits: byte 192 + 16p + c, low nibble for
//                sub-block 2p, high nibble for 2p + 1
//   [256, 2304)  the weight vectors, 4 per sub-block (vector 4s + v: weights
//                32s + 8v + ...)
//
// Q5_K (16 x 176 bytes): Q4_K's [0, 256), then per sub-block s 320 bytes from 256 +
// 320s: its 4 vectors of low 4 bits as Q4_K's, then one vector of fifth bits: lane c,
// byte j, bit t holds weight 32s + 4t + j's (the order the kernels take the nibble
// halves in: vector v's low nibbles, then its high ones). A kernel reads the block
// front to back (with the fifth bits after all the nibbles, 1 row streamed at 18 GB/s
// against 34: the hardware prefetchers did not follow two runs a block).
//
// Q6_K (16 x 210 bytes), column c, sub-block j of 16 weights (scale j):
//   [0, 32)      d (fp16) of column c at 2c
//   [32, 288)    scales (int8) of sub-blocks 2p then 2p + 1 at 32 + 32p + 2c + j % 2
//   [288, 3360)  per sub-block j, 192 bytes: two vectors of the weights' low 4 bits
//                (8 weights a lane each, as Q4_K's), then one of their high 2 bits:
//                lane c, byte i, bits 2s and 2s + 1 hold weight 16j + 4s + i's
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gguf_formats.h"

namespace pyllm::quant {

inline constexpr int kStripColumns = 16;

// A strip layout's type id for quant_linear: 1000 + its GGML type's (outside GGML's).
inline constexpr int64_t kStripsBase = 1000;
constexpr bool has_strips(int64_t type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ8_0 || type == kMXFP4 || type == kQ4_K ||
         type == kQ5_0 || type == kQ5_1 || type == kQ5_K || type == kQ6_K;
}
constexpr bool is_strips(int64_t type) { return type > kStripsBase && has_strips(type - kStripsBase); }
constexpr int64_t strips_type(int64_t type) { return kStripsBase + type; }
// The GGML type whose rows a weight of `type` holds (itself unless strips).
constexpr int64_t plain_type(int64_t type) { return is_strips(type) ? type - kStripsBase : type; }

// A block of Q4_K strips.
struct Q4KStrip {
  static constexpr int kColumns = kStripColumns, kBytes = kColumns * 144;
  static constexpr int kD = 0, kDmin = 32, kScales = 64, kMinHigh = 192, kQs = 256;
  // Sub-block s's 4 weight vectors.
  static constexpr int weights(int s) { return kQs + 256 * s; }
};

// A block of Q5_K strips: Q4KStrip's header; each sub-block's fifth bits after its
// weight vectors.
struct Q5KStrip : Q4KStrip {
  static constexpr int kBytes = kColumns * 176, kSubBytes = 256 + 64;
  static_assert(kQs + 8 * kSubBytes == kBytes);
  static constexpr int weights(int s) { return kQs + kSubBytes * s; }
  static constexpr int fifth(int s) { return weights(s) + 256; }
};

// The strip block of Q4_K or Q5_K.
template <int64_t T>
using KStrip = std::conditional_t<T == kQ5_K, Q5KStrip, Q4KStrip>;

// A block of Q6_K strips.
struct Q6KStrip {
  static constexpr int kColumns = kStripColumns, kBytes = kColumns * 210;
  static constexpr int kD = 0, kScales = 32, kWeights = 288, kSubBytes = 192;
  static_assert(kWeights + 16 * kSubBytes == kBytes);
  // Sub-block j's two low vectors, then its high bits' vector.
  static constexpr int low(int j) { return kWeights + kSubBytes * j; }
  static constexpr int high(int j) { return kWeights + kSubBytes * j + 128; }
};

// Types whose blocks hold a fifth bit per weight.
constexpr bool has_fifth_bits(int64_t type) {
  return type == kQ5_0 || type == kQ5_1 || type == kQ5_K;
}
// Types with a scale and an offset m per block.
constexpr bool has_block_min(int64_t type) { return type == kQ4_1 || type == kQ5_1; }

// A unit of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or MXFP4 strips (MXFP4: kD holds the E8M0
// bytes; Q5_0, Q5_1: the fifth bits at kQh).
template <int64_t T>
struct Strip32 {
  static_assert(T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1 || T == kQ8_0 ||
                T == kMXFP4);
  static constexpr int kColumns = kStripColumns, kBytes = kColumns * Layout<T>::kBytes;
  static constexpr int kD = 0, kM = 32;
  static constexpr int kQs = has_block_min(T) ? 64 : T == kMXFP4 ? 16 : 32, kQh = kQs + 256;
  static_assert(!has_fifth_bits(T) || kQh + 64 == kBytes);
};

// A block's scale field: fp16 d, or MXFP4's E8M0 byte.
template <int64_t T>
constexpr int scale_bytes() { return T == kMXFP4 ? 1 : 2; }
template <int64_t T>
constexpr int scale_at() {
  if constexpr (T == kMXFP4) return Layout<T>::kE;
  else return Layout<T>::kD;
}

// Q8_0's weights plus 128 (unsigned, vpdpbusd's unsigned side): vector v, lane c holds
// weights 4v..4v+3 of column c.
inline void pack_strip8(const uint8_t* const* blk, uint8_t* dst) {
  using S = Strip32<kQ8_0>;
  using L = Layout<kQ8_0>;
  for (int c = 0; c < S::kColumns; ++c) {
    std::memcpy(dst + S::kD + 2 * c, blk[c] + L::kD, 2);
    for (int v = 0; v < 8; ++v) {  // four weights a move: packing is a load's main cost
      uint32_t word;
      std::memcpy(&word, blk[c] + L::kQs + 4 * v, 4);
      word ^= 0x80808080u;
      std::memcpy(dst + S::kQs + 64 * v + 4 * c, &word, 4);
    }
  }
}

inline void unpack_strip8(const uint8_t* src, uint8_t* const* blk) {
  using S = Strip32<kQ8_0>;
  using L = Layout<kQ8_0>;
  for (int c = 0; c < S::kColumns; ++c) {
    std::memcpy(blk[c] + L::kD, src + S::kD + 2 * c, 2);
    for (int v = 0; v < 8; ++v) {
      uint32_t word;
      std::memcpy(&word, src + S::kQs + 64 * v + 4 * c, 4);
      word ^= 0x80808080u;
      std::memcpy(blk[c] + L::kQs + 4 * v, &word, 4);
    }
  }
}

// The strip dword of weights 8v..8v+3 (low nibbles) and 8v+4..8v+7 (high) from the
// GGUF bytes lo, hi that hold them in their high (high_half) or low nibbles.
inline uint32_t strip_word(uint32_t lo, uint32_t hi, bool high_half) {
  return high_half ? ((lo >> 4) & 0x0F0F0F0Fu) | (hi & 0xF0F0F0F0u)
                   : (lo & 0x0F0F0F0Fu) | ((hi & 0x0F0F0F0Fu) << 4);
}

// The fifth bits of 32 weights (bit l: weight l's) as a strip lane: byte j, bit t holds
// weight 4t + j's; and back.
inline uint32_t fifth_lane(uint32_t bits) {
  uint32_t lane = 0;
  for (int l = 0; l < 32; ++l) lane |= ((bits >> l) & 1u) << (8 * (l % 4) + l / 4);
  return lane;
}
inline uint32_t fifth_bits(uint32_t lane) {
  uint32_t bits = 0;
  for (int l = 0; l < 32; ++l) bits |= ((lane >> (8 * (l % 4) + l / 4)) & 1u) << l;
  return bits;
}

// Column c's GGUF block of Q4_0, Q4_1, Q5_0, Q5_1 or MXFP4 (at blk[c]) into the strip
// unit at dst: weight k < 16 is qs[k]'s low nibble, k >= 16 qs[k - 16]'s high one.
template <int64_t T>
inline void pack_strip32(const uint8_t* const* blk, uint8_t* dst) {
  using S = Strip32<T>;
  using L = Layout<T>;
  for (int c = 0; c < S::kColumns; ++c) {
    const uint8_t* b = blk[c];
    constexpr int kScale = scale_bytes<T>();
    std::memcpy(dst + S::kD + kScale * c, b + scale_at<T>(), kScale);
    if constexpr (has_block_min(T)) std::memcpy(dst + S::kM + 2 * c, b + L::kM, 2);
    for (int v = 0; v < 4; ++v) {
      uint32_t lo, hi;
      std::memcpy(&lo, b + L::kQs + 8 * (v % 2), 4);
      std::memcpy(&hi, b + L::kQs + 8 * (v % 2) + 4, 4);
      const uint32_t word = strip_word(lo, hi, v >= 2);
      std::memcpy(dst + S::kQs + 64 * v + 4 * c, &word, 4);
    }
    if constexpr (has_fifth_bits(T)) {
      uint32_t bits;
      std::memcpy(&bits, b + L::kQh, 4);
      const uint32_t lane = fifth_lane(bits);
      std::memcpy(dst + S::kQh + 4 * c, &lane, 4);
    }
  }
}

template <int64_t T>
inline void unpack_strip32(const uint8_t* src, uint8_t* const* blk) {
  using S = Strip32<T>;
  using L = Layout<T>;
  for (int c = 0; c < S::kColumns; ++c) {
    uint8_t* b = blk[c];
    constexpr int kScale = scale_bytes<T>();
    std::memcpy(b + scale_at<T>(), src + S::kD + kScale * c, kScale);
    if constexpr (has_block_min(T)) std::memcpy(b + L::kM, src + S::kM + 2 * c, 2);
    std::memset(b + L::kQs, 0, 16);
    for (int k = 0; k < 32; ++k) {
      const uint8_t byte = src[S::kQs + 64 * (k / 8) + 4 * c + k % 4];
      const int q = (k % 8) < 4 ? byte & 0x0F : byte >> 4;
      b[L::kQs + k % 16] |= static_cast<uint8_t>(k < 16 ? q : q << 4);
    }
    if constexpr (has_fifth_bits(T)) {
      uint32_t lane;
      std::memcpy(&lane, src + S::kQh + 4 * c, 4);
      const uint32_t bits = fifth_bits(lane);
      std::memcpy(b + L::kQh, &bits, 4);
    }
  }
}

// Column c's GGUF block of Q4_K or Q5_K (at blk[c]) into the strip block at dst.
template <int64_t T>
inline void pack_strip_block(const uint8_t* const* blk, uint8_t* dst) {
  using S = KStrip<T>;
  using L = Layout<T>;
  for (int c = 0; c < S::kColumns; ++c) {
    const uint8_t* b = blk[c];
    std::memcpy(dst + S::kD + 2 * c, b + L::kD, 2);
    std::memcpy(dst + S::kDmin + 2 * c, b + L::kDmin, 2);
    for (int s = 0; s < 8; ++s) {
      int sc, m;
      k_scale_min(b + L::kScales, s, sc, m);
      dst[S::kScales + 32 * (s / 2) + 2 * c + s % 2] = static_cast<uint8_t>(sc | (m & 3) << 6);
      uint8_t& high = dst[S::kMinHigh + 16 * (s / 2) + c];
      high = static_cast<uint8_t>(s % 2 ? (high & 0x0F) | (m >> 2) << 4 : m >> 2);
    }
    // Weights: GGUF byte k of sub-block pair (2p, 2p + 1) holds weight k of 2p (low
    // nibble) and of 2p + 1 (high); a strip dword takes 4 of one sub-block's weights
    // in its low nibbles and the next 4 in its high ones.
    for (int s = 0; s < 8; ++s) {
      for (int v = 0; v < 4; ++v) {
        uint32_t lo, hi;  // GGUF bytes 8v..8v+3 and 8v+4..8v+7 of the pair
        std::memcpy(&lo, b + L::kQs + 32 * (s / 2) + 8 * v, 4);
        std::memcpy(&hi, b + L::kQs + 32 * (s / 2) + 8 * v + 4, 4);
        const uint32_t word = strip_word(lo, hi, s % 2);
        std::memcpy(dst + S::weights(s) + 64 * v + 4 * c, &word, 4);
      }
    }
    if constexpr (T == kQ5_K) {  // qh[l] bit s: weight 32s + l's fifth bit
      for (int s = 0; s < 8; ++s) {
        uint32_t bits = 0;
        for (int l = 0; l < 32; ++l) bits |= ((b[L::kQh + l] >> s) & 1u) << l;
        const uint32_t lane = fifth_lane(bits);
        std::memcpy(dst + Q5KStrip::fifth(s) + 4 * c, &lane, 4);
      }
    }
  }
}

// The inverse: the strip block at src into column c's GGUF block at blk[c].
template <int64_t T>
inline void unpack_strip_block(const uint8_t* src, uint8_t* const* blk) {
  using S = KStrip<T>;
  using L = Layout<T>;
  for (int c = 0; c < S::kColumns; ++c) {
    uint8_t* b = blk[c];
    std::memcpy(b + L::kD, src + S::kD + 2 * c, 2);
    std::memcpy(b + L::kDmin, src + S::kDmin + 2 * c, 2);
    int sc[8], m[8];
    for (int s = 0; s < 8; ++s) {
      const uint8_t byte = src[S::kScales + 32 * (s / 2) + 2 * c + s % 2];
      const uint8_t high = src[S::kMinHigh + 16 * (s / 2) + c];
      sc[s] = byte & 63;
      m[s] = (byte >> 6) | ((s % 2 ? high >> 4 : high & 0x0F) << 2);
    }
    uint8_t* scales = b + L::kScales;  // k_scale_min's packing, inverted
    for (int j = 0; j < 4; ++j) {
      scales[j] = static_cast<uint8_t>(sc[j] | (sc[j + 4] >> 4) << 6);
      scales[j + 4] = static_cast<uint8_t>(m[j] | (m[j + 4] >> 4) << 6);
      scales[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0x0F) | (m[j + 4] & 0x0F) << 4);
    }
    std::memset(b + L::kQs, 0, 128);
    for (int s = 0; s < 8; ++s) {
      for (int k = 0; k < 32; ++k) {
        const uint8_t byte = src[S::weights(s) + 64 * (k / 8) + 4 * c + k % 4];
        const int q = (k % 8) < 4 ? byte & 0x0F : byte >> 4;
        b[L::kQs + 32 * (s / 2) + k] |= static_cast<uint8_t>(s % 2 ? q << 4 : q);
      }
    }
    if constexpr (T == kQ5_K) {
      std::memset(b + L::kQh, 0, 32);
      for (int s = 0; s < 8; ++s) {
        uint32_t lane;
        std::memcpy(&lane, src + Q5KStrip::fifth(s) + 4 * c, 4);
        const uint32_t bits = fifth_bits(lane);
        for (int l = 0; l < 32; ++l) b[L::kQh + l] |= static_cast<uint8_t>(((bits >> l) & 1) << s);
      }
    }
  }
}

// Q6_K: column c's GGUF block (at blk[c]) into the strip block at dst.
inline void pack_strip6(const uint8_t* const* blk, uint8_t* dst) {
  using S = Q6KStrip;
  using L = Layout<kQ6_K>;
  for (int c = 0; c < S::kColumns; ++c) {
    const uint8_t* b = blk[c];
    std::memcpy(dst + S::kD + 2 * c, b + L::kD, 2);
    for (int j = 0; j < 16; ++j) dst[S::kScales + 32 * (j / 2) + 2 * c + j % 2] = b[L::kScales + j];
    uint8_t q[256];  // the 6-bit quants
    for (int g = 0; g < 8; ++g) {
      const uint8_t *ql = L::low_bytes(b, g), *qh = L::high_bytes(b, g);
      for (int l = 0; l < 32; ++l) {
        q[32 * g + l] = static_cast<uint8_t>((L::upper_nibble(g) ? ql[l] >> 4 : ql[l] & 0x0F) |
                                             ((qh[l] >> L::high_shift(g)) & 3) << 4);
      }
    }
    for (int j = 0; j < 16; ++j) {
      const uint8_t* qj = q + 16 * j;
      for (int i = 0; i < 4; ++i) {
        for (int t = 0; t < 2; ++t) {  // weights 8t + i (low nibble), 8t + 4 + i (high)
          dst[S::low(j) + 64 * t + 4 * c + i] =
              static_cast<uint8_t>((qj[8 * t + i] & 0x0F) | (qj[8 * t + 4 + i] & 0x0F) << 4);
        }
        dst[S::high(j) + 4 * c + i] = static_cast<uint8_t>(
            qj[i] >> 4 | (qj[4 + i] >> 4) << 2 | (qj[8 + i] >> 4) << 4 | (qj[12 + i] >> 4) << 6);
      }
    }
  }
}

inline void unpack_strip6(const uint8_t* src, uint8_t* const* blk) {
  using S = Q6KStrip;
  using L = Layout<kQ6_K>;
  for (int c = 0; c < S::kColumns; ++c) {
    uint8_t* b = blk[c];
    std::memcpy(b + L::kD, src + S::kD + 2 * c, 2);
    for (int j = 0; j < 16; ++j) b[L::kScales + j] = src[S::kScales + 32 * (j / 2) + 2 * c + j % 2];
    std::memset(b + L::kQl, 0, L::kScales - L::kQl);
    for (int k = 0; k < 256; ++k) {
      const uint8_t low =
          src[S::low(k / 16) + 64 * (k % 16 / 8) + 4 * c + k % 4] >> (k % 8 < 4 ? 0 : 4);
      const uint8_t high = src[S::high(k / 16) + 4 * c + k % 4] >> 2 * (k % 16 / 4);
      const int g = k / 32, l = k % 32;  // Layout<kQ6_K>'s group g, weight l
      b[L::kQl + 64 * (g / 4) + 32 * (g % 2) + l] |=
          static_cast<uint8_t>((low & 0x0F) << (L::upper_nibble(g) ? 4 : 0));
      b[L::kQh + 32 * (g / 4) + l] |= static_cast<uint8_t>((high & 3) << L::high_shift(g));
    }
  }
}

// Rows [16i, 16i + 16) of a [N, row_bytes] weight of type T (strip i) between the
// layouts.
template <int64_t T>
inline void pack_strip(const uint8_t* rows, int64_t row_bytes, uint8_t* strip) {
  constexpr int64_t kBytes = Layout<T>::kBytes;
  const uint8_t* blk[kStripColumns];
  for (int64_t b = 0; b < row_bytes / kBytes; ++b) {
    for (int c = 0; c < kStripColumns; ++c) blk[c] = rows + c * row_bytes + b * kBytes;
    if constexpr (T == kQ4_K || T == kQ5_K) {
      pack_strip_block<T>(blk, strip + b * kStripColumns * kBytes);
    } else if constexpr (T == kQ6_K) {
      pack_strip6(blk, strip + b * kStripColumns * kBytes);
    } else if constexpr (T == kQ8_0) {
      pack_strip8(blk, strip + b * kStripColumns * kBytes);
    } else {
      pack_strip32<T>(blk, strip + b * kStripColumns * kBytes);
    }
  }
}

template <int64_t T>
inline void unpack_strip(const uint8_t* strip, int64_t row_bytes, uint8_t* rows) {
  constexpr int64_t kBytes = Layout<T>::kBytes;
  uint8_t* blk[kStripColumns];
  for (int64_t b = 0; b < row_bytes / kBytes; ++b) {
    for (int c = 0; c < kStripColumns; ++c) blk[c] = rows + c * row_bytes + b * kBytes;
    if constexpr (T == kQ4_K || T == kQ5_K) {
      unpack_strip_block<T>(strip + b * kStripColumns * kBytes, blk);
    } else if constexpr (T == kQ6_K) {
      unpack_strip6(strip + b * kStripColumns * kBytes, blk);
    } else if constexpr (T == kQ8_0) {
      unpack_strip8(strip + b * kStripColumns * kBytes, blk);
    } else {
      unpack_strip32<T>(strip + b * kStripColumns * kBytes, blk);
    }
  }
}

}  // namespace pyllm::quant
