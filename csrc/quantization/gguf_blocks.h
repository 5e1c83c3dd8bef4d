// GGUF's quantized block formats, as the CPU kernels read them.
//
// A quantized weight [N, K] is N rows of K / kBlock blocks of kBytes bytes each,
// exactly as the GGUF file stores them (no repacking at load). Every format is read
// the same way, in groups of 32 consecutive weights of one row:
//   w[k] = a[k / 16] * u[k] + b[k / 16],   k in [0, 32)
// with u[k] small unsigned integers (< 64; Q8_0's and MXFP4's are signed int8
// instead, and their b is 0), and a, b the scale and offset of each half of the
// group. A block holds kGroups groups; scales() decodes all its (a, b) pairs once,
// group_quants() one group's integers. So a kernel's inner loop is one shape for all
// nine formats: an integer dot product of u with int8 activations, scaled per
// half-group.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/Half.h>

#if defined(__F16C__) && !defined(__CUDACC__)
#include <immintrin.h>
#endif

namespace pyllm::quant {

// GGML's type ids (gguf.GGMLQuantizationType).
enum Type : int64_t {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kMXFP4 = 39,
};

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__) && !defined(__CUDACC__)
  return _cvtsh_ss(bits);  // one instruction; c10's conversion is a dozen bit operations
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// MXFP4's E8M0 scale byte e as 2^(e - 127) / 2 (its codes are doubled E2M1 values),
// built from bits: the float's exponent field is e - 1, and e = 0, 1 give the
// subnormals 2^-128, 2^-127 (ggml's GGML_E8M0_TO_FP32_HALF; e = 255 is 2^127, not NaN).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// MXFP4's 4-bit codes (sign, 2-bit exponent, 1-bit mantissa) as twice their E2M1
// value: the integers the kernels multiply.
inline constexpr int8_t kMxfp4Values[16] = {0, 1, 2,  3,  4,  6,  8,  12,
                                             0, -1, -2, -3, -4, -6, -8, -12};

// Q4_K / Q5_K: 8 scales and 8 mins of 6 bits packed in 12 bytes.
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One format's layout. kSigned: u are int8 (Q8_0, MXFP4), else unsigned.
template <int64_t T>
struct Format;

template <>
struct Format<kQ4_0> {
  static constexpr int kBlock = 32, kBytes = 18, kGroups = 1;
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* blk, float* a, float* b) {
    const float d = half_at(blk);
    a[0] = a[1] = d;
    b[0] = b[1] = -8.0f * d;
  }
  static const uint8_t* nibbles(const uint8_t* blk, int) { return blk + 2; }
};

template <>
struct Format<kQ4_1> {
  static constexpr int kBlock = 32, kBytes = 20, kGroups = 1;
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* blk, float* a, float* b) {
    a[0] = a[1] = half_at(blk);
    b[0] = b[1] = half_at(blk + 2);
  }
  static const uint8_t* nibbles(const uint8_t* blk, int) { return blk + 4; }
};

template <>
struct Format<kQ5_0> {
  static constexpr int kBlock = 32, kBytes = 22, kGroups = 1;
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* blk, float* a, float* b) {
    const float d = half_at(blk);
    a[0] = a[1] = d;
    b[0] = b[1] = -16.0f * d;
  }
  static uint32_t high_bits(const uint8_t* blk) {
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    return qh;
  }
  static const uint8_t* nibbles(const uint8_t* blk, int) { return blk + 6; }
};

template <>
struct Format<kQ5_1> {
  static constexpr int kBlock = 32, kBytes = 24, kGroups = 1;
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* blk, float* a, float* b) {
    a[0] = a[1] = half_at(blk);
    b[0] = b[1] = half_at(blk + 2);
  }
  static uint32_t high_bits(const uint8_t* blk) {
    uint32_t qh;
    std::memcpy(&qh, blk + 4, 4);
    return qh;
  }
  static const uint8_t* nibbles(const uint8_t* blk, int) { return blk + 8; }
};

template <>
struct Format<kQ8_0> {
  static constexpr int kBlock = 32, kBytes = 34, kGroups = 1;
  static constexpr bool kSigned = true;
  static void scales(const uint8_t* blk, float* a, float* b) {
    a[0] = a[1] = half_at(blk);
    b[0] = b[1] = 0.0f;
  }
  static const int8_t* values(const uint8_t* blk, int) {
    return reinterpret_cast<const int8_t*>(blk + 2);
  }
};

// MXFP4: an E8M0 exponent byte e, then 16 bytes of 4-bit codes (weight l in the low
// nibble of byte l, weight l + 16 in its high nibble): w = kMxfp4Values[code] *
// e8m0_half(e). Signed, as Q8_0: u = the int8 values, a = e8m0_half(e), b = 0.
template <>
struct Format<kMXFP4> {
  static constexpr int kBlock = 32, kBytes = 17, kGroups = 1;
  static constexpr bool kSigned = true;
  static void scales(const uint8_t* blk, float* a, float* b) {
    a[0] = a[1] = e8m0_half(blk[0]);
    b[0] = b[1] = 0.0f;
  }
  static const uint8_t* nibbles(const uint8_t* blk, int) { return blk + 1; }
};

// Q4_K: fp16 d, fp16 dmin, 12 scale bytes, 128 bytes of nibbles. Group g takes
// the low (g even) or high (g odd) nibbles of bytes [32 (g / 2), 32 (g / 2) + 32).
template <>
struct Format<kQ4_K> {
  static constexpr int kBlock = 256, kBytes = 144, kGroups = 8;
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* blk, float* a, float* b) {
    const float d = half_at(blk), dmin = half_at(blk + 2);
    for (int g = 0; g < 8; ++g) {
      int sc, m;
      k_scale_min(blk + 4, g, sc, m);
      a[2 * g] = a[2 * g + 1] = d * float(sc);
      b[2 * g] = b[2 * g + 1] = -dmin * float(m);
    }
  }
  static const uint8_t* nibble_bytes(const uint8_t* blk, int g) { return blk + 16 + 32 * (g / 2); }
};

// Q5_K: as Q4_K, plus 32 bytes of fifth bits: bit g of byte l is weight l's of group g.
template <>
struct Format<kQ5_K> {
  static constexpr int kBlock = 256, kBytes = 176, kGroups = 8;
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* blk, float* a, float* b) { Format<kQ4_K>::scales(blk, a, b); }
  static const uint8_t* high_bytes(const uint8_t* blk) { return blk + 16; }
  static const uint8_t* nibble_bytes(const uint8_t* blk, int g) { return blk + 48 + 32 * (g / 2); }
};

// Q6_K: 128 bytes of low nibbles (ql), 64 bytes of 2-bit highs (qh), 16 int8
// scales (one per 16 weights), fp16 d; w = d * scale * (u - 32). Group g, in half
// h = g / 4 of the block, j = g % 4: its low nibbles are the low (j < 2) or high
// (j >= 2) nibbles of ql[64 h + 32 (j % 2) + l], its high bits bits 2j, 2j + 1 of
// qh[32 h + l], for l in [0, 32).
template <>
struct Format<kQ6_K> {
  static constexpr int kBlock = 256, kBytes = 210, kGroups = 8;
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* blk, float* a, float* b) {
    const float d = half_at(blk + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(blk + 192);
    for (int i = 0; i < 16; ++i) {
      a[i] = d * float(sc[i]);
      b[i] = -32.0f * a[i];
    }
  }
  static const uint8_t* low_bytes(const uint8_t* blk, int g) {
    return blk + 64 * (g / 4) + 32 * (g % 2);
  }
  static const uint8_t* high_bytes(const uint8_t* blk, int g) { return blk + 128 + 32 * (g / 4); }
  static int high_shift(int g) { return 2 * (g % 4); }
  static bool upper_nibble(int g) { return g % 4 >= 2; }
};

// Portable decoding of one group's integers (the reference for the vector paths).
template <int64_t T>
inline void group_quants(const uint8_t* blk, int g, uint8_t* u) {
  using F = Format<T>;
  if constexpr (T == kQ4_0 || T == kQ4_1) {
    const uint8_t* q = F::nibbles(blk, g);
    for (int l = 0; l < 16; ++l) {
      u[l] = q[l] & 0xF;
      u[l + 16] = q[l] >> 4;
    }
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    const uint8_t* q = F::nibbles(blk, g);
    const uint32_t qh = F::high_bits(blk);
    for (int l = 0; l < 16; ++l) {
      u[l] = (q[l] & 0xF) | (((qh >> l) & 1) << 4);
      u[l + 16] = (q[l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
    }
  } else if constexpr (T == kQ8_0) {
    std::memcpy(u, F::values(blk, g), 32);
  } else if constexpr (T == kMXFP4) {
    const uint8_t* q = F::nibbles(blk, g);
    for (int l = 0; l < 16; ++l) {
      u[l] = static_cast<uint8_t>(kMxfp4Values[q[l] & 0xF]);
      u[l + 16] = static_cast<uint8_t>(kMxfp4Values[q[l] >> 4]);
    }
  } else if constexpr (T == kQ4_K) {
    const uint8_t* q = F::nibble_bytes(blk, g);
    for (int l = 0; l < 32; ++l) u[l] = g % 2 ? q[l] >> 4 : q[l] & 0xF;
  } else if constexpr (T == kQ5_K) {
    const uint8_t* q = F::nibble_bytes(blk, g);
    const uint8_t* qh = F::high_bytes(blk);
    for (int l = 0; l < 32; ++l) {
      u[l] = (g % 2 ? q[l] >> 4 : q[l] & 0xF) | (((qh[l] >> g) & 1) << 4);
    }
  } else {
    static_assert(T == kQ6_K);
    const uint8_t* ql = F::low_bytes(blk, g);
    const uint8_t* qh = F::high_bytes(blk, g);
    const int shift = F::high_shift(g);
    const bool upper = F::upper_nibble(g);
    for (int l = 0; l < 32; ++l) {
      u[l] = (upper ? ql[l] >> 4 : ql[l] & 0xF) | (((qh[l] >> shift) & 3) << 4);
    }
  }
}

// Calls f(std::integral_constant<int64_t, T>{}) for the runtime type id, false if unknown.
template <typename F>
bool dispatch_type(int64_t type, F&& f) {
  switch (type) {
    case kQ4_0: f(std::integral_constant<int64_t, kQ4_0>{}); return true;
    case kQ4_1: f(std::integral_constant<int64_t, kQ4_1>{}); return true;
    case kQ5_0: f(std::integral_constant<int64_t, kQ5_0>{}); return true;
    case kQ5_1: f(std::integral_constant<int64_t, kQ5_1>{}); return true;
    case kQ8_0: f(std::integral_constant<int64_t, kQ8_0>{}); return true;
    case kQ4_K: f(std::integral_constant<int64_t, kQ4_K>{}); return true;
    case kQ5_K: f(std::integral_constant<int64_t, kQ5_K>{}); return true;
    case kQ6_K: f(std::integral_constant<int64_t, kQ6_K>{}); return true;
    case kMXFP4: f(std::integral_constant<int64_t, kMXFP4>{}); return true;
    default: return false;
  }
}

}  // namespace pyllm::quant
