// GGUF's block formats as pyllm's CUDA kernels decode them (quant_cuda.cu's
// quant_linear and dequantize_rows, moe_cuda.cu's fused_moe), in units of 32
// consecutive weights of one row: a whole block for the 32-weight formats, one of the
// 8 sub-blocks of a 256-weight K-format block. The layouts and field decoding are
// gguf_formats.h's, shared with the CPU; the decoders are host-callable too, so their
// bit layouts can be checked against a reference on a machine without a GPU.
#pragma once

#include <cstdint>

#include <c10/util/Exception.h>

#include "../cuda_utils.cuh"
#include "gguf_formats.h"

namespace pyllm::cuda {
namespace {

using quant::byte_at;
using quant::half_at;
using quant::Layout;
using quant::u32_at;

// Weights per decoding unit.
constexpr int kUnit = quant::kGroupSize;

#ifdef __CUDA_ARCH__
#define PYLLM_UNROLL _Pragma("unroll")
#else
#define PYLLM_UNROLL
#endif

// Each format: Layout<T> (kBlock weights in kBytes bytes); decode(block, u, w) writes
// the 32 weights of unit u (0 <= u < kGroups) of the block at `block`.
template <int64_t T>
struct Decoder;

template <>
struct Decoder<quant::kQ4_0> : Layout<quant::kQ4_0> {
  PYLLM_HOST_DEVICE static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b + kD);
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const int q = static_cast<int>(byte_at(b + kQs + j));
      w[j] = d * static_cast<float>((q & 0xF) - 8);
      w[j + 16] = d * static_cast<float>((q >> 4) - 8);
    }
  }
};

template <>
struct Decoder<quant::kQ4_1> : Layout<quant::kQ4_1> {
  PYLLM_HOST_DEVICE static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b + kD), m = half_at(b + kM);
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const int q = static_cast<int>(byte_at(b + kQs + j));
      w[j] = d * static_cast<float>(q & 0xF) + m;
      w[j + 16] = d * static_cast<float>(q >> 4) + m;
    }
  }
};

template <>
struct Decoder<quant::kQ5_0> : Layout<quant::kQ5_0> {
  PYLLM_HOST_DEVICE static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b + kD);
    const uint32_t qh = u32_at(b + kQh);
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const int q = static_cast<int>(byte_at(b + kQs + j));
      const int lo = (q & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (q >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      w[j] = d * static_cast<float>(lo - 16);
      w[j + 16] = d * static_cast<float>(hi - 16);
    }
  }
};

template <>
struct Decoder<quant::kQ5_1> : Layout<quant::kQ5_1> {
  PYLLM_HOST_DEVICE static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b + kD), m = half_at(b + kM);
    const uint32_t qh = u32_at(b + kQh);
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const int q = static_cast<int>(byte_at(b + kQs + j));
      const int lo = (q & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (q >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      w[j] = d * static_cast<float>(lo) + m;
      w[j + 16] = d * static_cast<float>(hi) + m;
    }
  }
};

template <>
struct Decoder<quant::kQ8_0> : Layout<quant::kQ8_0> {
  PYLLM_HOST_DEVICE static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b + kD);
    PYLLM_UNROLL
    for (int j = 0; j < 32; ++j) {
      w[j] = d * static_cast<float>(static_cast<int8_t>(byte_at(b + kQs + j)));
    }
  }
};

// w = mxfp4_value(code) * e8m0_half(e). For e < 2 that scale is subnormal, which this
// build's --use_fast_math flushes to zero as an operand: the values are quartered and
// scaled by e8m0_half(e + 2) instead, so every weight >= 2^-126 is exact (smaller
// ones are subnormal and flush to zero).
template <>
struct Decoder<quant::kMXFP4> : Layout<quant::kMXFP4> {
  PYLLM_HOST_DEVICE static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const uint32_t e = byte_at(b + kE);
    const float d = quant::e8m0_half(static_cast<uint8_t>(e < 2 ? e + 2 : e));
    const float quarter = e < 2 ? 0.25f : 1.0f;
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const uint32_t q = byte_at(b + kQs + j);
      w[j] = d * (quarter * quant::mxfp4_value(q & 0xF));
      w[j + 16] = d * (quarter * quant::mxfp4_value(q >> 4));
    }
  }
};

template <>
struct Decoder<quant::kQ4_K> : Layout<quant::kQ4_K> {
  PYLLM_HOST_DEVICE static void decode(const uint8_t* b, int u, float (&w)[kUnit]) {
    int scale, min;
    quant::k_scale_min(b + kScales, u, scale, min);
    const float a = half_at(b + kD) * static_cast<float>(scale);
    const float c = half_at(b + kDmin) * static_cast<float>(min);
    const uint8_t* qs = nibble_bytes(b, u);
    const int shift = 4 * (u % 2);
    PYLLM_UNROLL
    for (int l = 0; l < 32; ++l) {
      const int q = static_cast<int>((byte_at(qs + l) >> shift) & 0xF);
      w[l] = a * static_cast<float>(q) - c;
    }
  }
};

template <>
struct Decoder<quant::kQ5_K> : Layout<quant::kQ5_K> {
  PYLLM_HOST_DEVICE static void decode(const uint8_t* b, int u, float (&w)[kUnit]) {
    int scale, min;
    quant::k_scale_min(b + kScales, u, scale, min);
    const float a = half_at(b + kD) * static_cast<float>(scale);
    const float c = half_at(b + kDmin) * static_cast<float>(min);
    const uint8_t* qh = high_bytes(b);
    const uint8_t* qs = nibble_bytes(b, u);
    const int shift = 4 * (u % 2);
    PYLLM_UNROLL
    for (int l = 0; l < 32; ++l) {
      const int q = static_cast<int>(((byte_at(qs + l) >> shift) & 0xF) |
                                     (((byte_at(qh + l) >> u) & 1u) << 4));
      w[l] = a * static_cast<float>(q) - c;
    }
  }
};

// Each 16 weights have their own scale: the unit's first 16 scales[2u], the rest
// scales[2u + 1].
template <>
struct Decoder<quant::kQ6_K> : Layout<quant::kQ6_K> {
  PYLLM_HOST_DEVICE static void decode(const uint8_t* b, int u, float (&w)[kUnit]) {
    const float d = half_at(b + kD);
    const uint8_t* ql = low_bytes(b, u);
    const uint8_t* qh = high_bytes(b, u);
    const int ql_shift = upper_nibble(u) ? 4 : 0, qh_shift = high_shift(u);
    const float a0 = d * static_cast<float>(static_cast<int8_t>(byte_at(b + kScales + 2 * u)));
    const float a1 =
        d * static_cast<float>(static_cast<int8_t>(byte_at(b + kScales + 2 * u + 1)));
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

// Unit `unit` (counted from the start of the row) of the row at `row`.
template <typename Format>
__device__ __forceinline__ void decode_unit(const uint8_t* row, int64_t unit, float (&w)[kUnit]) {
  constexpr int kUnitsPerBlock = Format::kGroups;
  const int64_t block = unit / kUnitsPerBlock;
  Format::decode(row + block * Format::kBytes, static_cast<int>(unit % kUnitsPerBlock), w);
}

// Calls f(Decoder<T>{}) for qtype (already validated by the op's checks).
template <typename F>
void dispatch_format(int64_t qtype, F&& f) {
  const bool known =
      quant::dispatch_type(qtype, [&](auto t) { f(Decoder<decltype(t)::value>{}); });
  TORCH_CHECK(known, "qtype ", qtype, " is not a supported GGML type");
}

}  // namespace
}  // namespace pyllm::cuda
