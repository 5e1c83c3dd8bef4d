// The small layers' argument contracts (norms, activation, the dense linear ops),
// checked first by their CPU and CUDA implementations. The linear ops' input, out and
// bias checks serve the quantized linear op too.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>

#include <ATen/core/DimVector.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../check_utils.h"
#include "../ops.h"

namespace pyllm {

inline void check_eps(double eps) {
  TORCH_CHECK_VALUE(std::isfinite(eps), "eps must be finite, got ", eps);
  TORCH_CHECK_VALUE(eps > 0, "eps must be positive, got ", eps);
}

// weight [hidden_size]: the last dimension of t (named name).
inline void check_norm_weight(const at::Tensor& weight, const at::Tensor& t,
                              std::string_view name) {
  check_like("weight", weight, t);
  check_ndim("weight", weight, 1, "[hidden_size]");
  check_contiguous("weight", weight);
  TORCH_CHECK_VALUE(weight.size(0) == t.size(-1), "weight has ", weight.size(0), " elements but ",
                    name, "'s last dimension is ", t.size(-1));
}

// A [..., hidden_size] input (not 0-d).
inline void check_hidden(std::string_view name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() >= 1, name, " must be [..., hidden_size], got a 0-d tensor");
}

inline void check_rms_norm(const at::Tensor& out, const at::Tensor& input,
                           const at::Tensor& weight, double eps) {
  check_float_dtype("input", input);
  check_hidden("input", input);
  check_packed_rows("input", input);
  check_like("out", out, input);
  check_shape("out", out, input.sizes(), "(same as input)");
  check_contiguous("out", out);
  check_norm_weight(weight, input, "input");
  check_eps(eps);
}

inline void check_fused_add_rms_norm(const at::Tensor& input, const at::Tensor& residual,
                                     const at::Tensor& weight, double eps) {
  check_float_dtype("input", input);
  check_hidden("input", input);
  check_contiguous("input", input);
  check_like("residual", residual, input);
  check_shape("residual", residual, input.sizes(), "(same as input)");
  check_contiguous("residual", residual);
  check_norm_weight(weight, input, "input");
  check_eps(eps);
}

// silu_and_mul and gelu_tanh_and_mul: input [..., 2 * d] = [gate | up], out [..., d].
inline void check_act_and_mul(const at::Tensor& out, const at::Tensor& input) {
  check_float_dtype("input", input);
  check_packed_rows("input", input);
  TORCH_CHECK_VALUE(input.dim() >= 1 && input.size(-1) % 2 == 0,
                    "input's last dimension must be even (gate and up halves), got ",
                    shape_text(input.sizes()));
  at::DimVector out_shape(input.sizes());
  out_shape.back() /= 2;
  check_like("out", out, input);
  check_shape("out", out, out_shape, "(input's with the last dim halved)");
  check_contiguous("out", out);
}

// input [rows, in_features] of a linear op: rows may be strided, elements packed.
inline void check_linear_input(const at::Tensor& input) {
  check_float_dtype("input", input);
  check_ndim("input", input, 2, "[rows, in_features]");
  check_packed_rows("input", input);
}

inline void check_linear_bias(const std::optional<at::Tensor>& bias, const at::Tensor& input,
                              int64_t out_features) {
  if (!bias.has_value()) return;
  check_like("bias", *bias, input);
  check_shape("bias", *bias, {out_features}, "[out_features]");
  check_contiguous("bias", *bias);
}

// out [rows, out_features], contiguous, and bias, of input's device and dtype.
inline void check_linear_output(const at::Tensor& out, const std::optional<at::Tensor>& bias,
                                const at::Tensor& input, int64_t out_features) {
  check_like("out", out, input);
  check_shape("out", out, {input.size(0), out_features}, "[rows, out_features]");
  check_contiguous("out", out);
  check_linear_bias(bias, input, out_features);
}

inline void check_small_batch_linear(const at::Tensor& out, const at::Tensor& input,
                                     const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias) {
  check_linear_input(input);
  TORCH_CHECK_VALUE(input.size(0) <= kSmallBatchMaxRows, "input has ", input.size(0),
                    " rows; small_batch_linear takes at most ", kSmallBatchMaxRows);
  check_like("weight", weight, input);
  check_ndim("weight", weight, 2, "[out_features, in_features]");
  TORCH_CHECK_VALUE(weight.size(1) == input.size(1), "weight must be [out_features, ",
                    input.size(1), "] (input's in_features), got ", shape_text(weight.sizes()));
  check_contiguous("weight", weight);
  check_linear_output(out, bias, input, weight.size(0));
}

// packed_weight [out_features / 16, in_features / E, 16, E], E = 4 / element size:
// pack_weight_words of a [out_features, in_features] weight. Returns out_features.
inline int64_t check_packed_linear(const at::Tensor& out, const at::Tensor& input,
                                   const at::Tensor& packed_weight,
                                   const std::optional<at::Tensor>& bias) {
  check_linear_input(input);
  check_like("packed_weight", packed_weight, input);
  const int64_t K = input.size(1), E = 4 / static_cast<int64_t>(input.element_size());
  check_ndim("packed_weight", packed_weight, 4, "[out_features / 16, in_features / E, 16, E]");
  TORCH_CHECK_VALUE(K % E == 0 && packed_weight.size(1) == K / E && packed_weight.size(2) == 16 &&
                        packed_weight.size(3) == E,
                    "packed_weight must be [out_features / 16, ", K / E, ", 16, ", E,
                    "] (pack_weight_words of a weight with ", K, " in_features), got ",
                    shape_text(packed_weight.sizes()));
  check_contiguous("packed_weight", packed_weight);
  const int64_t N = packed_weight.size(0) * 16;
  check_linear_output(out, bias, input, N);
  return N;
}

}  // namespace pyllm
