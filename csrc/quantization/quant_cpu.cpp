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
// AVX2; a plain loop elsewhere: quant_dot.h, one header per ISA). Each thread takes
// a contiguous range of output columns and streams its rows of W once per tile of
// input rows.
//
// Many rows (a prompt chunk, a large batch) go instead through float products of
// dequantized panels of W: AMX tiles for bf16 inputs where the build targets them
// (from 16 rows; 64 over strips), else packed_linear's register tile (from 32 rows,
// where it is vectorized), else (float32 on AVX2) chunks through ATen's GEMM (from 64
// rows; the K-quants keep the int8 products on AVX2: gemm_min_rows). A step's prompt rows take
// the AMX tiles or panels at any count (many_rows). Weights in strips without AMX keep
// the int8 products at every count, which outrun the panels there (panel_min_rows).
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../dispatch_utils.h"
#include "../ops.h"
#include "quant_checks.h"
#include "quant_matmul.h"

namespace pyllm::cpu {

namespace {
std::atomic<bool> g_batch_invariant{false};
}  // namespace

bool batch_invariant() { return g_batch_invariant.load(std::memory_order_relaxed); }
void set_batch_invariant(bool on) { g_batch_invariant.store(on, std::memory_order_relaxed); }

namespace {

// The float path a call of many rows takes, where this build has one for dtype S and
// the format (AMX tiles, or the panels), and the rows from which a call takes it by
// its count alone; 0 where the int8 products (or, on AVX2, ATen's GEMM) take many
// rows.
template <typename S>
int64_t many_row_path_from(int64_t qtype, bool strips) {
#ifdef PYLLM_QUANT_AMX
  const int64_t amx_from = amx_min_rows(strips);
  if (std::is_same_v<S, c10::BFloat16> && amx_from != INT64_MAX && !batch_invariant() &&
      amx::ready()) {
    return amx_from;
  }
#endif
  if constexpr (kPackedLinearVectorized<S>) {
    const int64_t from = panel_min_rows<S>(qtype, strips);
    if (from != INT64_MAX) return from;
  }
  return 0;
}

// out = input . W^T + bias for input's rows; many: by the many-row path whatever their
// count.
template <typename scalar_t>
void linear_rows(at::Tensor& out, const at::Tensor& input, const at::Tensor& qweight,
                 int64_t type, const std::optional<at::Tensor>& bias, bool many) {
  const bool strips = is_strips(type);  // read by the strip kernels (kStripsNative)
  const int64_t qtype = plain_type(type);
  const int64_t M = input.size(0), K = input.size(1), N = qweight.size(0);
  const scalar_t* in = input.const_data_ptr<scalar_t>();
  const uint8_t* w = qweight.const_data_ptr<uint8_t>();
  const int64_t row_bytes = qweight.size(1);
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t ld = out.stride(0);
  const scalar_t* b = bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr;
  // Columns the panel path takes (whole blocks of 16); the int8 tiles do the rest.
  int64_t n_panel = 0;
#ifdef PYLLM_QUANT_AMX
  const int64_t amx_from = amx_min_rows(strips);
  if (std::is_same_v<scalar_t, c10::BFloat16> && amx_from != INT64_MAX &&
      (many || M >= amx_from) && !batch_invariant() && amx::ready()) {
    dispatch_type(qtype, [&](auto t) {
      n_panel = amx_matmul<decltype(t)::value>(w, row_bytes, N, K, in, input.stride(0), M, b, o,
                                               ld, strips);
    });
  }
#endif
  if constexpr (kPackedLinearVectorized<scalar_t>) {
    const int64_t from = panel_min_rows<scalar_t>(qtype, strips);
    if (n_panel == 0 && from != INT64_MAX && (many || M >= from)) {
      n_panel = N / vec::kLanes * vec::kLanes;
      dispatch_type(qtype, [&](auto t) {
        panel_matmul<decltype(t)::value>(w, row_bytes, N, K, in, input.stride(0), M, b, o, ld);
      });
    }
  }
  if constexpr (std::is_same_v<scalar_t, float> && !kPackedLinearVectorized<scalar_t>) {
    if (n_panel == 0 && M >= gemm_min_rows(qtype, strips)) {
      dispatch_type(qtype, [&](auto t) {
        gemm_matmul<decltype(t)::value>(input, w, row_bytes, N, bias, out);
      });
      return;
    }
  }
  const int64_t rest = N - n_panel;
  if (rest == 0) return;
  QuantizedRows x;
  quantize_rows(in, input.stride(0), M, K, block_size_of(qtype), x);
  // float32 out is written in place; other dtypes through a float32 buffer.
  constexpr bool kFloat = std::is_same_v<scalar_t, float>;
  std::vector<float> buffer(kFloat ? 0 : M * rest);
  float* y = kFloat ? reinterpret_cast<float*>(o + n_panel) : buffer.data();
  const int64_t y_ld = kFloat ? ld : rest;
  dispatch_type(qtype, [&](auto t) {
    quant_matmul<decltype(t)::value>(w + n_panel * row_bytes, rest, K, x, M, y, y_ld, strips);
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
}

// Strips (quant_strips.h) are read natively by the AVX-512 VNNI and AVX2 kernels;
// portable builds take them back to GGUF's layout per call.
#ifdef PYLLM_QUANT_STRIPS
constexpr bool kStripsNative = true;
#else
constexpr bool kStripsNative = false;
#endif

// Every whole strip of 16 rows of a weight of GGML type `type` ([N, row bytes], or
// [E, N, row bytes]: each expert's rows apart) between GGUF's layout and the strips',
// in place (a strip at a time through a copy).
void convert_strips(at::Tensor& qweight, int64_t type, bool pack) {
  const int64_t row_bytes = qweight.size(-1), N = qweight.size(-2);
  const int64_t experts = qweight.dim() == 3 ? qweight.size(0) : 1, per = N / kStripColumns;
  uint8_t* w = qweight.data_ptr<uint8_t>();
  dispatch_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    if constexpr (has_strips(T)) {
      at::parallel_for(0, experts * per, 1, [&](int64_t s0, int64_t s1) {
        std::vector<uint8_t> copy(kStripColumns * row_bytes);
        for (int64_t i = s0; i < s1; ++i) {
          uint8_t* strip = w + (i / per * N + i % per * kStripColumns) * row_bytes;
          std::memcpy(copy.data(), strip, copy.size());
          if (pack) {
            pack_strip<T>(copy.data(), row_bytes, strip);
          } else {
            unpack_strip<T>(copy.data(), row_bytes, strip);
          }
        }
      });
    }
  });
}

// "Q4_0, Q4_1, ...": the types with strips, for messages.
std::string strip_type_names() {
  std::string names;
  for (const QuantType& t : kQuantTypes) {
    if (has_strips(t.id)) names += (names.empty() ? "" : ", ") + std::string(t.name);
  }
  return names;
}

// GGUF rows of a strips weight (of strips type `type`).
at::Tensor unpack_strips(const at::Tensor& qweight, int64_t type) {
  at::Tensor plain = qweight.clone();
  convert_strips(plain, plain_type(type), false);
  return plain;
}

}  // namespace

void pack_strips_(at::Tensor& qweight, int64_t qtype) {
  const QuantType& type = check_qtype(qtype);
  TORCH_CHECK_VALUE(has_strips(qtype), "qtype must be one with a strip layout (",
                    strip_type_names(), "), got ", qtype, " (", type.name, ")");
  TORCH_CHECK_VALUE(qweight.dim() == 2 || qweight.dim() == 3,
                    "qweight must be 2-D [out_features, row_bytes] or 3-D [num_experts, "
                    "out_features, row_bytes], got shape ", shape_text(qweight.sizes()));
  const int64_t row_bytes = qweight.size(-1);
  TORCH_CHECK_VALUE(row_bytes % type.bytes == 0, "qweight must hold ", type.name,
                    " rows (whole blocks of ", type.bytes, " bytes), got rows of ", row_bytes,
                    " bytes");
  check_contiguous("qweight", qweight);
  check_qweight(qweight.view({-1, row_bytes}), qtype, row_bytes / type.bytes * type.block,
                at::kCPU);
  convert_strips(qweight, qtype, true);
}

bool strips_native() { return kStripsNative; }

std::tuple<std::vector<int64_t>, std::vector<int64_t>> strip_types() {
  std::vector<int64_t> plain, strips;
  for (const QuantType& t : kQuantTypes) {
    if (has_strips(t.id)) {
      plain.push_back(t.id);
      strips.push_back(strips_type(t.id));
    }
  }
  return {plain, strips};
}

// Rows [0, many_rows) (a step's prompt tokens) take the many-row path whatever their
// count, so that a prompt computes alike whole, in chunks, or after a prefix-cache hit;
// the rest take the path of their own count. The AMX tiles, the panels and the int8
// tiles each compute a row the same whatever rows share the call, so where both parts
// take one path they run as one call. Where this build has no float path for many rows,
// many_rows changes nothing.
void quant_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& qweight,
                  int64_t qtype, const std::optional<at::Tensor>& bias, int64_t many_rows) {
  const int64_t N = check_quant_linear(out, input, qweight, qtype, bias, many_rows);
  const int64_t M = input.size(0);
  if (M == 0 || N == 0) return;
  if (is_strips(qtype) && !kStripsNative) {
    quant_linear(out, input, unpack_strips(qweight, qtype), plain_type(qtype), bias, many_rows);
    return;
  }
  PYLLM_DISPATCH_FLOATING_TYPES(input.scalar_type(), "quant_linear", [&] {
    const int64_t from = many_row_path_from<scalar_t>(plain_type(qtype), is_strips(qtype));
    int64_t P = from == 0 ? 0 : many_rows;
    if (P > 0 && M - P >= from) P = M;  // the other rows take that path too
    if (P == 0 || P == M) {
      linear_rows<scalar_t>(out, input, qweight, qtype, bias, P == M);
      return;
    }
    at::Tensor head = out.narrow(0, 0, P), tail = out.narrow(0, P, M - P);
    linear_rows<scalar_t>(head, input.narrow(0, 0, P), qweight, qtype, bias, true);
    linear_rows<scalar_t>(tail, input.narrow(0, P, M - P), qweight, qtype, bias, false);
  });
}

void dequantize_rows(at::Tensor& out, const at::Tensor& qweight, int64_t qtype,
                     const std::optional<at::Tensor>& rows) {
  check_dequantize_rows(out, qweight, qtype, rows);
  const int64_t K = out.size(1), N = qweight.size(0), R = out.size(0);
  const int64_t* index = nullptr;
  if (rows.has_value()) {
    // A row past qweight would be read outside it: one pass over the indices.
    index = rows->const_data_ptr<int64_t>();
    for (int64_t i = 0; i < R; ++i) {
      TORCH_CHECK(index[i] >= 0 && index[i] < N, "rows[", i, "] = ", index[i],
                  " is outside [0, ", N, ")");
    }
  }
  const int64_t row_bytes = qweight.size(1);
  const uint8_t* w = qweight.const_data_ptr<uint8_t>();
  // Rows of a whole strip are unpacked with their strip (the one unpacked last is kept,
  // so rows in order unpack each strip once); rows past the last whole strip are GGUF's.
  const int64_t strip_rows = is_strips(qtype) ? N / kStripColumns * kStripColumns : 0;
  PYLLM_DISPATCH_FLOATING_TYPES(out.scalar_type(), "dequantize_rows", [&] {
    scalar_t* y = out.data_ptr<scalar_t>();
    dispatch_type(plain_type(qtype), [&](auto t) {
      constexpr int64_t T = decltype(t)::value;
      at::parallel_for(0, R, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(K, 1)),
                       [&](int64_t r0, int64_t r1) {
                         std::vector<uint8_t> rows_of_strip;
                         int64_t unpacked = -1;
                         for (int64_t r = r0; r < r1; ++r) {
                           const int64_t src = index ? index[r] : r;
                           const uint8_t* row = w + src * row_bytes;
                           if constexpr (has_strips(T)) {
                             if (src < strip_rows) {
                               const int64_t first = src / kStripColumns * kStripColumns;
                               if (first != unpacked) {
                                 rows_of_strip.resize(kStripColumns * row_bytes);
                                 unpack_strip<T>(w + first * row_bytes, row_bytes,
                                                 rows_of_strip.data());
                                 unpacked = first;
                               }
                               row = rows_of_strip.data() + (src - first) * row_bytes;
                             }
                           }
                           dequantize_row<T>(row, K, y + r * K);
                         }
                       });
    });
  });
}

}  // namespace pyllm::cpu
