// GGUF's quantized block formats: the one list of the types pyllm reads and the one
// description of their block layouts, for host C++ and CUDA device code alike. The
// checks (quant_checks.h), the CPU kernels (gguf_blocks.h) and the CUDA kernels
// (gguf_blocks.cuh) all read them from here; pyllm.ops reads the list through
// torch.ops.pyllm.quant_types().
//
// A quantized weight [N, K] is N rows of K / kBlock blocks of kBytes bytes each,
// exactly as the GGUF file stores them (no repacking at load). Blocks are 17 to 210
// bytes long, so most fields are only 2-byte aligned: fields are read through
// half_at / u32_at, never by casting the pointer.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/Half.h>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#define PYLLM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PYLLM_HOST_DEVICE inline
#endif

#if defined(__F16C__) && !defined(__CUDACC__)
#include <immintrin.h>
#endif

// The types: X(name, GGML type id (gguf.GGMLQuantizationType), weights per block,
// bytes per block).
#define PYLLM_QUANT_TYPES(X) \
  X(Q4_0, 2, 32, 18)         \
  X(Q4_1, 3, 32, 20)         \
  X(Q5_0, 6, 32, 22)         \
  X(Q5_1, 7, 32, 24)         \
  X(Q8_0, 8, 32, 34)         \
  X(Q4_K, 12, 256, 144)      \
  X(Q5_K, 13, 256, 176)      \
  X(Q6_K, 14, 256, 210)      \
  X(MXFP4, 39, 32, 17)

namespace pyllm::quant {

enum Type : int64_t {
#define PYLLM_QUANT_ENUM(name, id, block, bytes) k##name = id,
  PYLLM_QUANT_TYPES(PYLLM_QUANT_ENUM)
#undef PYLLM_QUANT_ENUM
};

// One type's row of the list, for code that knows the type only at run time.
struct QuantType {
  int64_t id;
  const char* name;
  int64_t block, bytes;
};

inline constexpr QuantType kQuantTypes[] = {
#define PYLLM_QUANT_ROW(name, id, block, bytes) {id, #name, block, bytes},
    PYLLM_QUANT_TYPES(PYLLM_QUANT_ROW)
#undef PYLLM_QUANT_ROW
};

// "Q4_0=2, Q4_1=3, ...": the list for error messages, joined by the preprocessor (the
// + 2 drops the first separator).
#define PYLLM_QUANT_TEXT(name, id, block, bytes) ", " #name "=" #id
inline constexpr const char* kQuantTypesText = PYLLM_QUANT_TYPES(PYLLM_QUANT_TEXT) + 2;
#undef PYLLM_QUANT_TEXT

// Every format is read in groups of this many consecutive weights of one row.
inline constexpr int kGroupSize = 32;

// Calls f(std::integral_constant<int64_t, T>{}) for the runtime type id, false if unknown.
template <typename F>
bool dispatch_type(int64_t type, F&& f) {
  switch (type) {
#define PYLLM_QUANT_CASE(name, id, block, bytes)     \
  case id:                                           \
    f(std::integral_constant<int64_t, k##name>{});   \
    return true;
    PYLLM_QUANT_TYPES(PYLLM_QUANT_CASE)
#undef PYLLM_QUANT_CASE
    default:
      return false;
  }
}

// A type's block size and byte size at compile time, from the list.
template <int64_t T>
struct QuantSizes;
#define PYLLM_QUANT_SIZE(name, id, block, bytes)                       \
  template <>                                                          \
  struct QuantSizes<id> {                                               \
    static constexpr int kBlock = block, kBytes = bytes;               \
    static constexpr int kGroups = block / kGroupSize;                 \
  };
PYLLM_QUANT_TYPES(PYLLM_QUANT_SIZE)
#undef PYLLM_QUANT_SIZE

// ---------------------------------------------------------------------------
// Field decoding. nvcc's host pass and the C++ compiler take different paths in
// half_at (F16C), so each compiler's copies get names of their own.

#ifdef __CUDACC__
inline namespace nvcc {
#else
inline namespace cxx {
#endif

// On the device through the read-only data cache: weights are never written by a kernel.
PYLLM_HOST_DEVICE uint8_t byte_at(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

// A little-endian fp16 field.
PYLLM_HOST_DEVICE float half_at(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  const uint16_t bits = static_cast<uint16_t>(byte_at(p) | (byte_at(p + 1) << 8));
  return __half2float(__ushort_as_half(bits));
#else
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__) && !defined(__CUDACC__)
  return _cvtsh_ss(bits);  // one instruction; c10's conversion is a dozen bit operations
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
#endif
}

// A little-endian uint32 field (Q5_0's and Q5_1's fifth bits).
PYLLM_HOST_DEVICE uint32_t u32_at(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{byte_at(p + i)} << (8 * i);
  return v;
#else
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
#endif
}

PYLLM_HOST_DEVICE float float_from_bits(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// MXFP4's E8M0 scale byte e as 2^(e - 127) / 2 (its codes are doubled E2M1 values),
// built from bits: the float's exponent field is e - 1, and e = 0, 1 give the
// subnormals 2^-128, 2^-127 (ggml's GGML_E8M0_TO_FP32_HALF; e = 255 is 2^127, not NaN).
PYLLM_HOST_DEVICE float e8m0_half(uint8_t e) {
  return float_from_bits(e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23);
}

// Q4_K / Q5_K: the 6-bit scale and min of group j, packed in 12 bytes: bytes 0-3 hold
// scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for
// the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7
// (high nibble).
PYLLM_HOST_DEVICE void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = byte_at(s + j) & 63;
    m = byte_at(s + j + 4) & 63;
  } else {
    sc = (byte_at(s + j + 4) & 0xF) | ((byte_at(s + j - 4) >> 6) << 4);
    m = (byte_at(s + j + 4) >> 4) | ((byte_at(s + j) >> 6) << 4);
  }
}

// The same for all 8 groups at once, as bytes of two words, with 32-bit word
// operations instead of 16 six-bit extractions.
PYLLM_HOST_DEVICE void k_scales_mins(const uint8_t* s, uint64_t& scales, uint64_t& mins) {
  const uint32_t u0 = u32_at(s), u1 = u32_at(s + 4), u2 = u32_at(s + 8);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  const uint32_t sc_hi = (u2 & k4) | (((u0 >> 6) & k2) << 4);
  const uint32_t m_hi = ((u2 >> 4) & k4) | (((u1 >> 6) & k2) << 4);
  scales = uint64_t(u0 & k6) | (uint64_t(sc_hi) << 32);
  mins = uint64_t(u1 & k6) | (uint64_t(m_hi) << 32);
}

}  // inline namespace

// MXFP4's 4-bit codes (sign, 2-bit exponent, 1-bit mantissa) as twice their E2M1
// value: the integers the kernels multiply.
inline constexpr int8_t kMxfp4Values[16] = {0, 1, 2,  3,  4,  6,  8,  12,
                                             0, -1, -2, -3, -4, -6, -8, -12};

// Device code cannot index a host array: the magnitudes of codes 0-7 as the nibbles
// of one word instead, codes 8-15 being their negatives.
constexpr uint32_t mxfp4_magnitude_word() {
  uint32_t word = 0;
  for (int c = 0; c < 8; ++c) word |= static_cast<uint32_t>(kMxfp4Values[c]) << (4 * c);
  return word;
}
constexpr bool mxfp4_signs_mirror() {
  for (int c = 0; c < 8; ++c) {
    if (kMxfp4Values[c + 8] != -kMxfp4Values[c]) return false;
  }
  return true;
}
static_assert(mxfp4_signs_mirror(), "codes 8-15 must be the negatives of codes 0-7");
inline constexpr uint32_t kMxfp4Magnitudes = mxfp4_magnitude_word();

PYLLM_HOST_DEVICE float mxfp4_value(uint32_t code) {
  const int magnitude = static_cast<int>((kMxfp4Magnitudes >> (4 * (code & 7))) & 0xF);
  return static_cast<float>(code & 8 ? -magnitude : magnitude);
}

// ---------------------------------------------------------------------------
// Block layouts: each field's byte offset in the block, and where group g (32
// consecutive weights, g < kGroups) of a K-format block keeps its bits.

template <int64_t T>
struct Layout;

// d (fp16), qs[16]: weight l is the low nibble of qs[l], weight l + 16 its high
// nibble; w = d * (q - 8).
template <>
struct Layout<kQ4_0> : QuantSizes<kQ4_0> {
  static constexpr int kD = 0, kQs = 2;
  static_assert(kQs + 16 == kBytes);
};

// d, m (fp16), qs[16] as Q4_0's: w = d * q + m.
template <>
struct Layout<kQ4_1> : QuantSizes<kQ4_1> {
  static constexpr int kD = 0, kM = 2, kQs = 4;
  static_assert(kQs + 16 == kBytes);
};

// d (fp16), qh (uint32: bit l is weight l's fifth bit), qs[16]: w = d * (q - 16).
template <>
struct Layout<kQ5_0> : QuantSizes<kQ5_0> {
  static constexpr int kD = 0, kQh = 2, kQs = 6;
  static_assert(kQs + 16 == kBytes);
};

// d, m (fp16), qh (uint32), qs[16]: w = d * q + m.
template <>
struct Layout<kQ5_1> : QuantSizes<kQ5_1> {
  static constexpr int kD = 0, kM = 2, kQh = 4, kQs = 8;
  static_assert(kQs + 16 == kBytes);
};

// d (fp16), qs int8[32]: w = d * q.
template <>
struct Layout<kQ8_0> : QuantSizes<kQ8_0> {
  static constexpr int kD = 0, kQs = 2;
  static_assert(kQs + 32 == kBytes);
};

// e (E8M0), qs[16]: weight l is the low nibble of qs[l], weight l + 16 its high
// nibble; w = kMxfp4Values[code] * e8m0_half(e).
template <>
struct Layout<kMXFP4> : QuantSizes<kMXFP4> {
  static constexpr int kE = 0, kQs = 1;
  static_assert(kQs + 16 == kBytes);
};

// d, dmin (fp16), scales[12] (k_scale_min), qs[128]: group g takes the low (g even)
// or high (g odd) nibbles of qs[32 (g / 2) + l]; w = d * scale * q - dmin * min.
template <>
struct Layout<kQ4_K> : QuantSizes<kQ4_K> {
  static constexpr int kD = 0, kDmin = 2, kScales = 4, kQs = 16;
  static_assert(kQs + 128 == kBytes);
  PYLLM_HOST_DEVICE static const uint8_t* nibble_bytes(const uint8_t* blk, int g) {
    return blk + kQs + 32 * (g / 2);
  }
};

// As Q4_K, plus qh[32] of fifth bits before qs: bit g of qh[l] is weight l's of group g.
template <>
struct Layout<kQ5_K> : QuantSizes<kQ5_K> {
  static constexpr int kD = 0, kDmin = 2, kScales = 4, kQh = 16, kQs = 48;
  static_assert(kQs + 128 == kBytes);
  PYLLM_HOST_DEVICE static const uint8_t* high_bytes(const uint8_t* blk) { return blk + kQh; }
  PYLLM_HOST_DEVICE static const uint8_t* nibble_bytes(const uint8_t* blk, int g) {
    return blk + kQs + 32 * (g / 2);
  }
};

// ql[128] (low nibbles), qh[64] (2-bit highs), scales int8[16] (one per 16 weights),
// d (fp16); w = d * scale * (q - 32). Group g, in half h = g / 4 of the block, j =
// g % 4: its low nibbles are the low (j < 2) or high (j >= 2) nibbles of
// ql[64 h + 32 (j % 2) + l], its high bits bits 2j, 2j + 1 of qh[32 h + l], for l in
// [0, 32); its two scales are scales[2 g], scales[2 g + 1].
template <>
struct Layout<kQ6_K> : QuantSizes<kQ6_K> {
  static constexpr int kQl = 0, kQh = 128, kScales = 192, kD = 208;
  static_assert(kD + 2 == kBytes);
  PYLLM_HOST_DEVICE static const uint8_t* low_bytes(const uint8_t* blk, int g) {
    return blk + kQl + 64 * (g / 4) + 32 * (g % 2);
  }
  PYLLM_HOST_DEVICE static const uint8_t* high_bytes(const uint8_t* blk, int g) {
    return blk + kQh + 32 * (g / 4);
  }
  PYLLM_HOST_DEVICE static int high_shift(int g) { return 2 * (g % 4); }
  PYLLM_HOST_DEVICE static bool upper_nibble(int g) { return g % 4 >= 2; }
};

}  // namespace pyllm::quant
