// fused_moe's products on the CPU (an internal header of moe_cpu.cpp): float32 sums
// of R grouped rows of one expert with a range of its weight's output columns, by
// the path the expert's row count picks (as quant_linear picks it for a matrix):
//   kInt8       int8 tiles of up to 8 rows over the GGUF blocks (quant_dot.h)
//   kPanel      dequantized panels of 16 * NB columns through packed_linear's tile
//   kGemm       float32 columns dequantized for ATen's GEMM (AVX2 / portable builds)
//   kFloatFew   float weights streamed row by row (few rows)
//   kFloatMany  float weights through ATen's GEMM
// All run inside one thread of fused_moe's parallel regions: no kernel here forks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>

#include "../cpu/float_rows.h"
#include "../quantization/quant_matmul.h"
#include "moe_checks.h"

namespace pyllm::cpu {
namespace {

enum class MoePath : uint8_t { kInt8, kPanel, kGemm, kFloatFew, kFloatMany };

// Rows from which float weights go through ATen's GEMM instead of being streamed.
constexpr int64_t kFloatGemmMinRows = 16;

// The path of a projection of type `type` (in strips or not) for an expert with
// `rows` rows of S; many: the panels whatever the rows where they run (prompt tokens,
// as quant_linear's many_rows).
template <typename S>
MoePath moe_path(int64_t type, bool strips, int64_t rows, bool many = false) {
  if (is_float_weight_type(type)) {
    return rows >= kFloatGemmMinRows ? MoePath::kFloatMany : MoePath::kFloatFew;
  }
  if constexpr (kPackedLinearVectorized<S>) {
    const int64_t from = panel_min_rows<S>(type, strips);
    if (from != INT64_MAX && (many || rows >= from)) return MoePath::kPanel;
  }
  if constexpr (std::is_same_v<S, float> && !kPackedLinearVectorized<S>) {
    if (rows >= gemm_min_rows(type, strips)) return MoePath::kGemm;
  }
  return MoePath::kInt8;
}

inline bool takes_int8(MoePath path) { return path == MoePath::kInt8; }

// One projection of every expert: expert e's [N, K] weight at w + e * expert_bytes
// (GGUF rows of row_bytes, each expert's in strips where `strips`, or floats of the
// activations' dtype).
struct MoeWeight {
  const uint8_t* w;
  int64_t type, N, row_bytes, expert_bytes;  // type: the GGML type of the rows
  const void* bias;  // [E, N] of the activations' dtype, or null
  bool strips;
};

inline MoeWeight moe_weight(const at::Tensor& w, int64_t type,
                            const std::optional<at::Tensor>& bias) {
  const int64_t N = w.size(1), row_bytes = w.size(2) * w.element_size();
  return {static_cast<const uint8_t*>(w.const_data_ptr()), plain_type(type), N, row_bytes,
          N * row_bytes, bias.has_value() ? bias->const_data_ptr() : nullptr, is_strips(type)};
}

// The rows a product reads: int8 rows [m0, m0 + R) of q, or R rows of S from x.
template <typename S>
struct MoeRows {
  const QuantizedRows* q;
  int64_t m0;
  const S* x;
  int64_t x_ld;
};

// out[r, c - n0] for c in [n0, n1): columns of W (rows [0, R) of x) by int8 tiles. A
// run of columns whose weights stay in L2 meets every tile of rows; with strips, runs
// of whole strips (n0 is a multiple of 16: item_columns).
template <int64_t T, typename S>
void int8_columns(const MoeWeight& p, const uint8_t* w, int64_t K, const MoeRows<S>& in,
                  int64_t R, int64_t n0, int64_t n1, float* out, int64_t ld) {
  const int64_t row_bytes = p.row_bytes;
  int64_t run = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(row_bytes, 1));
  if (p.strips) run = std::max<int64_t>(1, run / kStripColumns) * kStripColumns;
  for (int64_t c0 = n0; c0 < n1; c0 += run) {
    const int64_t c1 = std::min(n1, c0 + run);
    for (int64_t r0 = 0; r0 < R; r0 += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, R - r0));
      const uint8_t* wc = w + c0 * row_bytes;
      float* o = out + r0 * ld + (c0 - n0);
      if (p.strips) {
        strip_tile<T>(rows, wc, row_bytes, p.N - c0, *in.q, in.m0 + r0, K, o, ld, 0, c1 - c0,
                      w + n1 * row_bytes);  // no prefetch past the item
      } else {
        dot_tile<T>(rows, wc, row_bytes, *in.q, in.m0 + r0, K, o, ld, 0, c1 - c0);
      }
    }
  }
}

// The same by dequantized panels through packed_linear's register tile; a partial
// last block of 16 columns goes through a buffer.
template <int64_t T, typename S>
void panel_columns(const MoeWeight& wp, const uint8_t* w, int64_t K, const MoeRows<S>& in,
                   int64_t R, int64_t n0, int64_t n1, float* out, int64_t ld) {
  constexpr int NB = tile_blocks(kTileRows), kCols = NB * vec::kLanes;
  thread_local std::vector<float> row, part;
  thread_local std::vector<S> row_words, panel;
  float* r = scratch(row, size_t(vec::kLanes) * K);
  S* words = scratch(row_words, size_t(vec::kLanes) * K);
  S* p = scratch(panel, size_t(kCols) * K);
  for (int64_t c0 = n0; c0 < n1; c0 += kCols) {
    const int cols = static_cast<int>(std::min<int64_t>(kCols, n1 - c0));
    const int nb = (cols + vec::kLanes - 1) / vec::kLanes;
    dequantize_weight_panel<T>(w, wp.row_bytes, wp.N, wp.strips, c0, nb, K, r, words, p, cols);
    const bool whole = cols == nb * vec::kLanes;
    float* o = whole ? out + (c0 - n0) : scratch(part, size_t(R) * kCols);
    const int64_t o_ld = whole ? ld : kCols;
    if (nb == NB) {
      panel_rows<S, NB>(in.x, in.x_ld, R, p, K, nullptr, o, o_ld);
    } else if (nb == 2) {
      panel_rows<S, 2>(in.x, in.x_ld, R, p, K, nullptr, o, o_ld);
    } else {
      panel_rows<S, 1>(in.x, in.x_ld, R, p, K, nullptr, o, o_ld);
    }
    if (!whole) {
      for (int64_t m = 0; m < R; ++m) {
        std::memcpy(out + m * ld + (c0 - n0), o + m * kCols, cols * sizeof(float));
      }
    }
  }
}

// out [R, N] float32 (row stride ld) = x [R, K] . w [N, K]^T by ATen's GEMM, which
// runs on this thread inside a parallel region.
template <typename S>
void gemm_rows(const S* x, int64_t x_ld, int64_t R, const S* w, int64_t N, int64_t K, float* out,
               int64_t ld) {
  const auto dtype = c10::CppTypeToScalarType<S>::value;
  const at::Tensor a = at::from_blob(const_cast<S*>(x), {R, K}, {x_ld, 1}, at::dtype(dtype));
  const at::Tensor b = at::from_blob(const_cast<S*>(w), {N, K}, at::dtype(dtype));
  if constexpr (std::is_same_v<S, float>) {
    at::Tensor o = at::from_blob(out, {R, N}, {ld, 1}, at::dtype(at::kFloat));
    at::mm_out(o, a, b.t());
  } else {
    const at::Tensor o = at::mm(a, b.t());
    const S* y = o.const_data_ptr<S>();
    for (int64_t m = 0; m < R; ++m) load_floats(y + m * N, out + m * ld, N);
  }
}

// Columns dequantized to float32 and multiplied by ATen's GEMM (float32 rows only).
template <int64_t T, typename S>
void gemm_columns(const uint8_t* w, int64_t row_bytes, int64_t K, const MoeRows<S>& in,
                  int64_t R, int64_t n0, int64_t n1, float* out, int64_t ld) {
  if constexpr (std::is_same_v<S, float>) {
    thread_local std::vector<float> dense;
    float* d = scratch(dense, size_t(n1 - n0) * K);
    for (int64_t n = n0; n < n1; ++n) dequantize_row_f32<T>(w + n * row_bytes, K, d + (n - n0) * K);
    gemm_rows(in.x, in.x_ld, R, d, n1 - n0, K, out, ld);
  }
}

// Float weights, M <= 4 rows: each weight row is streamed once and meets all M rows.
template <typename S, int M>
void float_rows_tile(const S* x, int64_t x_ld, const S* w, int64_t K, int64_t n0, int64_t n1,
                     float* out, int64_t ld) {
  using vec::Vec16;
  const int64_t k_vec = K / vec::kLanes * vec::kLanes;
  for (int64_t n = n0; n < n1; ++n) {
    const S* wn = w + n * K;
    Vec16 acc[M];
    for (auto& a : acc) a = Vec16::zero();
    for (int64_t k = 0; k < k_vec; k += vec::kLanes) {
      const Vec16 wv = Vec16::load(wn + k);
      for (int m = 0; m < M; ++m) acc[m] = Vec16::fmadd(wv, Vec16::load(x + m * x_ld + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float sum = acc[m].reduce_add();
      for (int64_t k = k_vec; k < K; ++k) {
        sum += static_cast<float>(wn[k]) * static_cast<float>(x[m * x_ld + k]);
      }
      out[m * ld + n - n0] = sum;
    }
  }
}

template <typename S>
void float_columns(const S* w, int64_t K, const MoeRows<S>& in, int64_t R, int64_t n0,
                   int64_t n1, float* out, int64_t ld, MoePath path) {
  if (path == MoePath::kFloatMany) {
    gemm_rows(in.x, in.x_ld, R, w + n0 * K, n1 - n0, K, out, ld);
    return;
  }
  for (int64_t m = 0; m < R; m += 4) {
    const S* x = in.x + m * in.x_ld;
    float* o = out + m * ld;
    switch (std::min<int64_t>(4, R - m)) {
      case 1: float_rows_tile<S, 1>(x, in.x_ld, w, K, n0, n1, o, ld); break;
      case 2: float_rows_tile<S, 2>(x, in.x_ld, w, K, n0, n1, o, ld); break;
      case 3: float_rows_tile<S, 3>(x, in.x_ld, w, K, n0, n1, o, ld); break;
      default: float_rows_tile<S, 4>(x, in.x_ld, w, K, n0, n1, o, ld); break;
    }
  }
}

// out[r, c - n0] = row r of `in` . column c of expert e's weight, for c in [n0, n1),
// by `path`.
template <typename S>
void expert_columns(const MoeWeight& p, MoePath path, int64_t e, int64_t K,
                    const MoeRows<S>& in, int64_t R, int64_t n0, int64_t n1, float* out,
                    int64_t ld) {
  const uint8_t* w = p.w + e * p.expert_bytes;
  if (path == MoePath::kFloatFew || path == MoePath::kFloatMany) {
    float_columns<S>(reinterpret_cast<const S*>(w), K, in, R, n0, n1, out, ld, path);
    return;
  }
  dispatch_type(p.type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    if (path == MoePath::kInt8) {
      int8_columns<T, S>(p, w, K, in, R, n0, n1, out, ld);
    } else if (path == MoePath::kPanel) {
      if constexpr (kPackedLinearVectorized<S>) {
        panel_columns<T, S>(p, w, K, in, R, n0, n1, out, ld);
      }
    } else {
      gemm_columns<T, S>(w, p.row_bytes, K, in, R, n0, n1, out, ld);
    }
  });
}

// Output columns per work item: about 256 KiB of weights (gate's and up's together),
// in whole units of the path (int8: 32 columns, so that a span of the activations'
// quantization is rarely split; panels: 16 * NB). Items of 64 KiB, quant_matmul's
// strip, made fused_moe 16-23% slower at 1 to 32 tokens (bench_moe.py, Zen 4, 2
// threads: qwen3-30b-a3b Q4_K_M 1 token 0.854 -> 0.714 ms, 8: 6.05 -> 4.68, 32:
// 17.5 -> 13.4); 512 KiB and 1 MiB were no faster. A step has many items across its
// experts, so larger ones still balance.
constexpr int64_t kItemBytes = int64_t{256} << 10;

inline int64_t item_columns(MoePath path, int64_t row_bytes, int64_t N) {
  const int64_t unit = path == MoePath::kPanel ? tile_blocks(kTileRows) * vec::kLanes : 32;
  const int64_t cols = kItemBytes / std::max<int64_t>(row_bytes, 1);
  return std::clamp<int64_t>((cols + unit / 2) / unit * unit, unit, std::max<int64_t>(N, 1));
}

}  // namespace
}  // namespace pyllm::cpu
