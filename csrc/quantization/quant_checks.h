// The quantized linear ops' argument contracts, checked first by their CPU and CUDA
// implementations: the GGML block formats they read, and the qweight, input, out,
// bias and rows tensors. pyllm/ops_quant.py checks the values of rows.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../check_utils.h"
#include "../layers/layers_checks.h"
#include "gguf_formats.h"
#include "quant_strips.h"

namespace pyllm {

using quant::kQuantTypes;
using quant::QuantType;

inline const QuantType& check_qtype(int64_t qtype) {
  for (const QuantType& t : kQuantTypes) {
    if (t.id == qtype) return t;
  }
  TORCH_CHECK_VALUE(false, "qtype must be a supported GGML type id (", quant::kQuantTypesText,
                    "), got ", qtype);
}

// qweight [out_features, row bytes] uint8 holding rows of in_features values of type
// qtype (or, on the CPU, their strips: quant_strips.h), contiguous, on device. Returns
// out_features.
inline int64_t check_qweight(const at::Tensor& qweight, int64_t qtype, int64_t in_features,
                             const at::Device& device) {
  check_device("qweight", qweight, device);
  TORCH_CHECK_VALUE(qweight.scalar_type() == at::kByte,
                    "qweight must be uint8 (the GGUF blocks' bytes), got ",
                    dtype_name(qweight.scalar_type()));
  check_ndim("qweight", qweight, 2, "[out_features, row_bytes]");
  const bool strips = quant::is_strips(qtype);
  const int64_t plain = quant::plain_type(qtype);
  TORCH_CHECK_VALUE(!strips || device.is_cpu(), "qtype ", qtype, " (strips of GGML type ",
                    plain, ") is a CPU layout; on ", device.str(), " pass the GGUF rows");
  const QuantType& type = check_qtype(plain);
  TORCH_CHECK_VALUE(in_features % type.block == 0, "in_features (", in_features,
                    ") must be a multiple of ", type.name, "'s block of ", type.block);
  const int64_t row_bytes = in_features / type.block * type.bytes;
  TORCH_CHECK_VALUE(qweight.size(1) == row_bytes, "qweight must be [out_features, ", row_bytes,
                    "] (", type.name, " rows of ", in_features, " values), got ",
                    shape_text(qweight.sizes()));
  check_contiguous("qweight", qweight);
  return qweight.size(0);
}

// Returns out_features. out's rows may be strided (a fused projection writes each
// part into its columns); each row must be packed.
inline int64_t check_quant_linear(const at::Tensor& out, const at::Tensor& input,
                                  const at::Tensor& qweight, int64_t qtype,
                                  const std::optional<at::Tensor>& bias, int64_t many_rows) {
  check_linear_input(input);
  const int64_t N = check_qweight(qweight, qtype, input.size(1), input.device());
  check_like("out", out, input);
  check_shape("out", out, {input.size(0), N}, "[rows, out_features]");
  check_packed_rows("out", out);
  check_linear_bias(bias, input, N);
  TORCH_CHECK_VALUE(many_rows >= 0 && many_rows <= input.size(0), "many_rows must be in [0, ",
                    input.size(0), "] (input's rows), got ", many_rows);
  return N;
}

inline void check_dequantize_rows(const at::Tensor& out, const at::Tensor& qweight,
                                  int64_t qtype, const std::optional<at::Tensor>& rows) {
  check_float_dtype("out", out);
  check_ndim("out", out, 2, "[rows, in_features]");
  check_contiguous("out", out);
  const int64_t num_rows = check_qweight(qweight, qtype, out.size(1), out.device());
  if (!rows.has_value()) {
    TORCH_CHECK_VALUE(out.size(0) == num_rows, "out must have qweight's ", num_rows,
                      " rows when rows is None, got ", out.size(0));
    return;
  }
  check_device("rows", *rows, out.device());
  check_dtype("rows", *rows, at::kLong);
  check_shape("rows", *rows, {out.size(0)}, "[R] (one per row of out)");
  check_contiguous("rows", *rows);
}

}  // namespace pyllm
