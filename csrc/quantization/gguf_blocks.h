// GGUF's quantized block formats as the CPU kernels read them; the layouts themselves
// are gguf_formats.h's, shared with CUDA.
//
// Every format is read the same way, in groups of 32 consecutive weights of one row:
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

#include "gguf_formats.h"

namespace pyllm::quant {

// One format as the CPU reads it: its layout (gguf_formats.h), whether u are int8
// (kSigned: Q8_0, MXFP4) or unsigned, its (a, b) pairs and where its integers are.
template <int64_t T>
struct Format;

template <>
struct Format<kQ4_0> : Layout<kQ4_0> {
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* blk, float* a, float* b) {
    const float d = half_at(blk + kD);
    a[0] = a[1] = d;
    b[0] = b[1] = -8.0f * d;
  }
  static const uint8_t* nibbles(const uint8_t* blk, int) { return blk + kQs; }
};

template <>
struct Format<kQ4_1> : Layout<kQ4_1> {
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* blk, float* a, float* b) {
    a[0] = a[1] = half_at(blk + kD);
    b[0] = b[1] = half_at(blk + kM);
  }
  static const uint8_t* nibbles(const uint8_t* blk, int) { return blk + kQs; }
};

template <>
struct Format<kQ5_0> : Layout<kQ5_0> {
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* blk, float* a, float* b) {
    const float d = half_at(blk + kD);
    a[0] = a[1] = d;
    b[0] = b[1] = -16.0f * d;
  }
  static uint32_t high_bits(const uint8_t* blk) { return u32_at(blk + kQh); }
  static const uint8_t* nibbles(const uint8_t* blk, int) { return blk + kQs; }
};

template <>
struct Format<kQ5_1> : Layout<kQ5_1> {
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* blk, float* a, float* b) {
    a[0] = a[1] = half_at(blk + kD);
    b[0] = b[1] = half_at(blk + kM);
  }
  static uint32_t high_bits(const uint8_t* blk) { return u32_at(blk + kQh); }
  static const uint8_t* nibbles(const uint8_t* blk, int) { return blk + kQs; }
};

template <>
struct Format<kQ8_0> : Layout<kQ8_0> {
  static constexpr bool kSigned = true;
  static void scales(const uint8_t* blk, float* a, float* b) {
    a[0] = a[1] = half_at(blk + kD);
    b[0] = b[1] = 0.0f;
  }
  static const int8_t* values(const uint8_t* blk, int) {
    return reinterpret_cast<const int8_t*>(blk + kQs);
  }
};

// MXFP4: signed, as Q8_0: u = the int8 values kMxfp4Values[code], a = e8m0_half(e),
// b = 0.
template <>
struct Format<kMXFP4> : Layout<kMXFP4> {
  static constexpr bool kSigned = true;
  static void scales(const uint8_t* blk, float* a, float* b) {
    a[0] = a[1] = e8m0_half(blk[kE]);
    b[0] = b[1] = 0.0f;
  }
  static const uint8_t* nibbles(const uint8_t* blk, int) { return blk + kQs; }
};

template <>
struct Format<kQ4_K> : Layout<kQ4_K> {
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* blk, float* a, float* b) {
    const float d = half_at(blk + kD), dmin = half_at(blk + kDmin);
    for (int g = 0; g < 8; ++g) {
      int sc, m;
      k_scale_min(blk + kScales, g, sc, m);
      a[2 * g] = a[2 * g + 1] = d * float(sc);
      b[2 * g] = b[2 * g + 1] = -dmin * float(m);
    }
  }
};

template <>
struct Format<kQ5_K> : Layout<kQ5_K> {
  static constexpr bool kSigned = false;
  static_assert(kD == Layout<kQ4_K>::kD && kDmin == Layout<kQ4_K>::kDmin &&
                kScales == Layout<kQ4_K>::kScales);
  static void scales(const uint8_t* blk, float* a, float* b) { Format<kQ4_K>::scales(blk, a, b); }
};

// Q6_K: a[i] = d * scales[i] for each 16 weights, b = -32 a.
template <>
struct Format<kQ6_K> : Layout<kQ6_K> {
  static constexpr bool kSigned = false;
  static void scales(const uint8_t* blk, float* a, float* b) {
    const float d = half_at(blk + kD);
    const auto* sc = reinterpret_cast<const int8_t*>(blk + kScales);
    for (int i = 0; i < 16; ++i) {
      a[i] = d * float(sc[i]);
      b[i] = -32.0f * a[i];
    }
  }
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

}  // namespace pyllm::quant
