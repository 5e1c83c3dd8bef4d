// GGUF's block formats as pyllm's CUDA kernels decode them (quant_cuda.cu's
// quant_linear and dequantize_rows, moe_cuda.cu's fused_moe), in units of 32
// consecutive weights of one row: a whole block for the 32-weight formats, one of the
// 8 sub-blocks of a 256-weight K-format block. Blocks are 17 to 210 bytes long, so
// most fields are only 2-byte aligned: the decoders read bytes and assemble the fp16
// and uint32 fields from them instead of relying on any alignment.
#pragma once

#include <cstdint>
#include <cstring>

#include <c10/util/Exception.h>

#include "../cuda_utils.cuh"

namespace pyllm::cuda {
namespace {

// Weights per decoding unit.
constexpr int kUnit = 32;

// The decoders are host-callable too, so their bit layouts can be checked against a
// reference on a machine without a GPU.
#define PYLLM_HD __host__ __device__ __forceinline__
#ifdef __CUDA_ARCH__
#define PYLLM_UNROLL _Pragma("unroll")
#else
#define PYLLM_UNROLL
#endif

PYLLM_HD uint32_t byte_at(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

PYLLM_HD float half_at(const uint8_t* p) {
  const uint16_t bits = static_cast<uint16_t>(byte_at(p) | (byte_at(p + 1) << 8));
  return __half2float(__ushort_as_half(bits));
}

PYLLM_HD uint32_t u32_at(const uint8_t* p) {
  return byte_at(p) | (byte_at(p + 1) << 8) | (byte_at(p + 2) << 16) | (byte_at(p + 3) << 24);
}

// Each format: kBlockSize weights in kTypeSize bytes; decode(block, u, w) writes the
// 32 weights of unit u (0 <= u < kBlockSize / 32) of the block at `block`.

// d (fp16), qs[16]: weight j is low nibble of qs[j], weight j + 16 its high nibble.
struct Q4_0 {
  static constexpr int kBlockSize = 32, kTypeSize = 18;
  PYLLM_HD static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b);
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const int q = static_cast<int>(byte_at(b + 2 + j));
      w[j] = d * static_cast<float>((q & 0xF) - 8);
      w[j + 16] = d * static_cast<float>((q >> 4) - 8);
    }
  }
};

// d, m (fp16), qs[16]: w = d * q + m.
struct Q4_1 {
  static constexpr int kBlockSize = 32, kTypeSize = 20;
  PYLLM_HD static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b), m = half_at(b + 2);
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const int q = static_cast<int>(byte_at(b + 4 + j));
      w[j] = d * static_cast<float>(q & 0xF) + m;
      w[j + 16] = d * static_cast<float>(q >> 4) + m;
    }
  }
};

// d (fp16), qh (uint32: bit j is weight j's fifth bit), qs[16]: w = d * (q - 16).
struct Q5_0 {
  static constexpr int kBlockSize = 32, kTypeSize = 22;
  PYLLM_HD static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b);
    const uint32_t qh = u32_at(b + 2);
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const int q = static_cast<int>(byte_at(b + 6 + j));
      const int lo = (q & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (q >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      w[j] = d * static_cast<float>(lo - 16);
      w[j + 16] = d * static_cast<float>(hi - 16);
    }
  }
};

// d, m (fp16), qh (uint32), qs[16]: w = d * q + m.
struct Q5_1 {
  static constexpr int kBlockSize = 32, kTypeSize = 24;
  PYLLM_HD static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b), m = half_at(b + 2);
    const uint32_t qh = u32_at(b + 4);
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const int q = static_cast<int>(byte_at(b + 8 + j));
      const int lo = (q & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (q >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      w[j] = d * static_cast<float>(lo) + m;
      w[j + 16] = d * static_cast<float>(hi) + m;
    }
  }
};

// d (fp16), qs int8[32]: w = d * q.
struct Q8_0 {
  static constexpr int kBlockSize = 32, kTypeSize = 34;
  PYLLM_HD static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b);
    PYLLM_UNROLL
    for (int j = 0; j < 32; ++j) {
      w[j] = d * static_cast<float>(static_cast<int8_t>(byte_at(b + 2 + j)));
    }
  }
};

// 2^(e - 128) for 2 <= e <= 255, from bits: exponent field e - 1.
PYLLM_HD float pow2_minus_128(uint32_t e) {
  const uint32_t bits = (e - 1) << 23;
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// A 4-bit MXFP4 code (sign, 2-bit exponent, 1-bit mantissa) as twice its E2M1 value:
// the magnitudes 0, 1, 2, 3, 4, 6, 8, 12 are the nibbles of one word, so no table.
PYLLM_HD float mxfp4_value(uint32_t code) {
  const int magnitude = static_cast<int>((0xC8643210u >> (4 * (code & 7))) & 0xF);
  return static_cast<float>(code & 8 ? -magnitude : magnitude);
}

// e (E8M0), qs[16]: weight j is the low nibble of qs[j], weight j + 16 its high
// nibble; w = mxfp4_value(code) * 2^(e - 128) (ggml's GGML_E8M0_TO_FP32_HALF(e)).
// For e < 2 that scale is subnormal, which this build's --use_fast_math flushes to
// zero as an operand: the values are quartered and scaled by 2^(e - 126) instead, so
// every weight >= 2^-126 is exact (smaller ones are subnormal and flush to zero).
struct MXFP4 {
  static constexpr int kBlockSize = 32, kTypeSize = 17;
  PYLLM_HD static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const uint32_t e = byte_at(b);
    const float d = pow2_minus_128(e < 2 ? e + 2 : e);
    const float quarter = e < 2 ? 0.25f : 1.0f;
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const uint32_t q = byte_at(b + 1 + j);
      w[j] = d * (quarter * mxfp4_value(q & 0xF));
      w[j + 16] = d * (quarter * mxfp4_value(q >> 4));
    }
  }
};

// Q4_K / Q5_K: the 6-bit scale and min of sub-block u, packed in 12 bytes: bytes 0-3
// hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
// for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7
// (high nibble).
PYLLM_HD void k_scale_min(const uint8_t* s, int u, int& scale, int& min) {
  if (u < 4) {
    scale = static_cast<int>(byte_at(s + u) & 63);
    min = static_cast<int>(byte_at(s + u + 4) & 63);
  } else {
    scale = static_cast<int>((byte_at(s + u + 4) & 0xF) | ((byte_at(s + u - 4) >> 6) << 4));
    min = static_cast<int>((byte_at(s + u + 4) >> 4) | ((byte_at(s + u) >> 6) << 4));
  }
}

// d, dmin (fp16), scales[12], qs[128]: sub-block u's quants are the low (u even) or
// high (u odd) nibbles of qs[32 * (u / 2) + l]; w = d * scale * q - dmin * min.
struct Q4_K {
  static constexpr int kBlockSize = 256, kTypeSize = 144;
  PYLLM_HD static void decode(const uint8_t* b, int u, float (&w)[kUnit]) {
    int scale, min;
    k_scale_min(b + 4, u, scale, min);
    const float a = half_at(b) * static_cast<float>(scale);
    const float c = half_at(b + 2) * static_cast<float>(min);
    const uint8_t* qs = b + 16 + 32 * (u / 2);
    const int shift = 4 * (u % 2);
    PYLLM_UNROLL
    for (int l = 0; l < 32; ++l) {
      const int q = static_cast<int>((byte_at(qs + l) >> shift) & 0xF);
      w[l] = a * static_cast<float>(q) - c;
    }
  }
};

// d, dmin, scales[12], qh[32], qs[128]: Q4_K's nibbles plus a fifth bit, bit u of
// qh[l].
struct Q5_K {
  static constexpr int kBlockSize = 256, kTypeSize = 176;
  PYLLM_HD static void decode(const uint8_t* b, int u, float (&w)[kUnit]) {
    int scale, min;
    k_scale_min(b + 4, u, scale, min);
    const float a = half_at(b) * static_cast<float>(scale);
    const float c = half_at(b + 2) * static_cast<float>(min);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48 + 32 * (u / 2);
    const int shift = 4 * (u % 2);
    PYLLM_UNROLL
    for (int l = 0; l < 32; ++l) {
      const int q = static_cast<int>(((byte_at(qs + l) >> shift) & 0xF) |
                                     (((byte_at(qh + l) >> u) & 1u) << 4));
      w[l] = a * static_cast<float>(q) - c;
    }
  }
};

// ql[128], qh[64], scales int8[16], d (fp16). The block is two halves of 128 weights;
// in half h, sub-block g (u = 4h + g) takes the low (g < 2) or high nibbles of
// ql[64h + 32 * (g % 2) + l] and bits 2g, 2g+1 of qh[32h + l]; q is 6 bits minus 32,
// and each 16 weights have their own scale: w = d * scales[16-weight group] * q.
struct Q6_K {
  static constexpr int kBlockSize = 256, kTypeSize = 210;
  PYLLM_HD static void decode(const uint8_t* b, int u, float (&w)[kUnit]) {
    const int h = u / 4, g = u % 4;
    const float d = half_at(b + 208);
    const uint8_t* ql = b + 64 * h + 32 * (g % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    const int ql_shift = 4 * (g / 2), qh_shift = 2 * g;
    const float a0 = d * static_cast<float>(static_cast<int8_t>(byte_at(b + 192 + 8 * h + 2 * g)));
    const float a1 =
        d * static_cast<float>(static_cast<int8_t>(byte_at(b + 192 + 8 * h + 2 * g + 1)));
    PYLLM_UNROLL
    for (int l = 0; l < 32; ++l) {
      const int q = static_cast<int>(((byte_at(ql + l) >> ql_shift) & 0xF) |
                                     (((byte_at(qh + l) >> qh_shift) & 3u) << 4)) -
                    32;
      w[l] = (l < 16 ? a0 : a1) * static_cast<float>(q);
    }
  }
};

#undef PYLLM_UNROLL
#undef PYLLM_HD

// Unit `unit` (counted from the start of the row) of the row at `row`.
template <typename Format>
__device__ __forceinline__ void decode_unit(const uint8_t* row, int64_t unit, float (&w)[kUnit]) {
  constexpr int kUnitsPerBlock = Format::kBlockSize / kUnit;
  const int64_t block = unit / kUnitsPerBlock;
  Format::decode(row + block * Format::kTypeSize, static_cast<int>(unit % kUnitsPerBlock), w);
}

// ---------------------------------------------------------------------------
// Host side: a type id's block sizes, and dispatch on it.

struct FormatInfo {
  int block_size;
  int type_size;
};

FormatInfo format_info(int64_t qtype) {
  switch (qtype) {
    case 2:
      return {Q4_0::kBlockSize, Q4_0::kTypeSize};
    case 3:
      return {Q4_1::kBlockSize, Q4_1::kTypeSize};
    case 6:
      return {Q5_0::kBlockSize, Q5_0::kTypeSize};
    case 7:
      return {Q5_1::kBlockSize, Q5_1::kTypeSize};
    case 8:
      return {Q8_0::kBlockSize, Q8_0::kTypeSize};
    case 12:
      return {Q4_K::kBlockSize, Q4_K::kTypeSize};
    case 13:
      return {Q5_K::kBlockSize, Q5_K::kTypeSize};
    case 14:
      return {Q6_K::kBlockSize, Q6_K::kTypeSize};
    case 39:
      return {MXFP4::kBlockSize, MXFP4::kTypeSize};
    default:
      TORCH_CHECK(false, "qtype ", qtype,
                  " is not a supported GGML type (Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, "
                  "Q4_K=12, Q5_K=13, Q6_K=14, MXFP4=39)");
  }
}

// Calls f(Format{}) for qtype (already validated by format_info).
template <typename F>
void dispatch_format(int64_t qtype, F&& f) {
  switch (qtype) {
    case 2:
      return f(Q4_0{});
    case 3:
      return f(Q4_1{});
    case 6:
      return f(Q5_0{});
    case 7:
      return f(Q5_1{});
    case 8:
      return f(Q8_0{});
    case 12:
      return f(Q4_K{});
    case 13:
      return f(Q5_K{});
    case 14:
      return f(Q6_K{});
    case 39:
      return f(MXFP4{});
    default:
      format_info(qtype);  // raises
  }
}

}  // namespace
}  // namespace pyllm::cuda
