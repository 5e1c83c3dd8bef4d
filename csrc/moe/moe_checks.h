// The mixture-of-experts ops' argument contracts, checked first by their CPU and CUDA
// implementations: the router logits, the experts' weights (GGUF blocks or floats),
// their biases and the activation. pyllm/ops.py checks nothing more: every value the
// kernels index with (the routed expert ids) comes from the kernels themselves.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../check_utils.h"
#include "../quantization/quant_checks.h"

namespace pyllm {

// GGML's type ids of float tensors: an expert weight of one of these is kept as
// floats of the activations' dtype.
inline constexpr int64_t kGgmlF32 = 0, kGgmlF16 = 1, kGgmlBF16 = 30;

inline bool is_float_weight_type(int64_t type) {
  return type == kGgmlF32 || type == kGgmlF16 || type == kGgmlBF16;
}

inline int64_t ggml_float_type(at::ScalarType dtype) {
  return dtype == at::kFloat ? kGgmlF32 : dtype == at::kHalf ? kGgmlF16 : kGgmlBF16;
}

// The activation between the gate/up and the down projections.
enum class MoeActivation {
  kSilu,       // silu(gate) * up (Llama, Mixtral, Qwen3-MoE)
  kSwigluOai,  // gpt-oss: gate clamped above at limit, up to [-limit, limit],
               // (up + 1) * gate * sigmoid(alpha * gate)
};

inline MoeActivation check_moe_activation(const std::string& name, double alpha, double limit) {
  TORCH_CHECK_VALUE(name == "silu" || name == "swigluoai",
                    "activation must be 'silu' or 'swigluoai', got '", name, "'");
  TORCH_CHECK_VALUE(std::isfinite(alpha), "alpha must be finite, got ", alpha);
  TORCH_CHECK_VALUE(std::isfinite(limit) && limit > 0, "limit must be positive and finite, got ",
                    limit);
  return name == "silu" ? MoeActivation::kSilu : MoeActivation::kSwigluOai;
}

// router_logits [T, num_experts], any float dtype, rows packed.
inline void check_router_logits(const at::Tensor& router_logits, int64_t num_tokens) {
  check_float_dtype("router_logits", router_logits);
  check_ndim("router_logits", router_logits, 2, "[num_tokens, num_experts]");
  check_contiguous("router_logits", router_logits);
  TORCH_CHECK_VALUE(num_tokens < 0 || router_logits.size(0) == num_tokens,
                    "router_logits must have one row per token (", num_tokens, "), got ",
                    router_logits.size(0));
  TORCH_CHECK_VALUE(router_logits.size(1) >= 1, "router_logits must have at least one expert");
}

inline void check_top_k(int64_t top_k, int64_t num_experts) {
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= num_experts, "top_k must lie in [1, num_experts=",
                    num_experts, "], got ", top_k);
}

inline void check_moe_topk(const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                           const at::Tensor& router_logits) {
  check_router_logits(router_logits, -1);
  const int64_t T = router_logits.size(0);
  check_device("topk_weights", topk_weights, router_logits.device());
  check_device("topk_ids", topk_ids, router_logits.device());
  check_dtype("topk_weights", topk_weights, at::kFloat);
  check_dtype("topk_ids", topk_ids, at::kInt);
  check_ndim("topk_weights", topk_weights, 2, "[num_tokens, top_k]");
  TORCH_CHECK_VALUE(topk_weights.size(0) == T, "topk_weights must have one row per token (", T,
                    "), got ", topk_weights.size(0));
  check_shape("topk_ids", topk_ids, topk_weights.sizes(), "(same as topk_weights)");
  check_contiguous("topk_weights", topk_weights);
  check_contiguous("topk_ids", topk_ids);
  check_top_k(topk_weights.size(1), router_logits.size(1));
}

// One projection of every expert: [num_experts, out_features, in_features] floats of
// the activations' dtype (type F32/F16/BF16), or [num_experts, out_features, row
// bytes] uint8 GGUF blocks of type `type` (or, on the CPU, each expert's rows in
// strips: quant_strips.h). Returns out_features.
inline int64_t check_expert_weight(std::string_view name, const at::Tensor& w, int64_t type,
                                   int64_t num_experts, int64_t in_features,
                                   const at::Tensor& hidden) {
  check_device(name, w, hidden.device());
  check_ndim(name, w, 3, "[num_experts, out_features, in_features or row_bytes]");
  TORCH_CHECK_VALUE(w.size(0) == num_experts, name, " holds ", w.size(0),
                    " experts but w_gate holds ", num_experts);
  check_contiguous(name, w);
  if (is_float_weight_type(type)) {
    TORCH_CHECK_TYPE(type == ggml_float_type(hidden.scalar_type()), name,
                     "'s type (GGML id ", type, ") must be the float type of hidden (",
                     dtype_name(hidden.scalar_type()), ": GGML id ",
                     ggml_float_type(hidden.scalar_type()), ")");
    check_same_dtype(name, w, hidden.scalar_type());
    TORCH_CHECK_VALUE(w.size(2) == in_features, name, " must be [num_experts, out_features, ",
                      in_features, "], got ", shape_text(w.sizes()));
    return w.size(1);
  }
  TORCH_CHECK_TYPE(w.scalar_type() == at::kByte, name,
                   " must be uint8 GGUF blocks for a quantized type, got ",
                   dtype_name(w.scalar_type()));
  const int64_t plain = quant::plain_type(type);
  TORCH_CHECK_VALUE(!quant::is_strips(type) || hidden.device().is_cpu(), name, "'s type ", type,
                    " (strips of GGML type ", plain, ") is a CPU layout; on ",
                    hidden.device().str(), " pass the GGUF rows");
  const QuantType& q = check_qtype(plain);
  TORCH_CHECK_VALUE(in_features % q.block == 0, name, ": in_features (", in_features,
                    ") must be a multiple of ", q.name, "'s block of ", q.block);
  const int64_t row_bytes = in_features / q.block * q.bytes;
  TORCH_CHECK_VALUE(w.size(2) == row_bytes, name, " must be [num_experts, out_features, ",
                    row_bytes, "] (", q.name, " rows of ", in_features, " values), got ",
                    shape_text(w.sizes()));
  return w.size(1);
}

inline void check_expert_bias(std::string_view name, const std::optional<at::Tensor>& bias,
                              int64_t num_experts, int64_t features, const at::Tensor& hidden) {
  if (!bias.has_value()) return;
  check_like(name, *bias, hidden);
  check_shape(name, *bias, {num_experts, features}, "[num_experts, out_features]");
  check_contiguous(name, *bias);
}

struct MoeShape {
  int64_t tokens, hidden, inter, experts, total_experts;
  MoeActivation activation;
};

inline MoeShape check_fused_moe(const at::Tensor& out, const at::Tensor& hidden,
                                const at::Tensor& router_logits, int64_t top_k,
                                const at::Tensor& w_gate, const at::Tensor& w_up,
                                const at::Tensor& w_down, int64_t gate_type, int64_t up_type,
                                int64_t down_type, const std::optional<at::Tensor>& gate_bias,
                                const std::optional<at::Tensor>& up_bias,
                                const std::optional<at::Tensor>& down_bias,
                                const std::string& activation, double alpha, double limit,
                                int64_t expert_start, int64_t many_rows) {
  check_float_dtype("hidden", hidden);
  check_ndim("hidden", hidden, 2, "[num_tokens, hidden_size]");
  check_packed_rows("hidden", hidden);
  check_like("out", out, hidden);
  check_shape("out", out, hidden.sizes(), "(same as hidden)");
  check_contiguous("out", out);
  check_device("router_logits", router_logits, hidden.device());
  check_router_logits(router_logits, hidden.size(0));
  const int64_t total = router_logits.size(1);
  check_top_k(top_k, total);
  TORCH_CHECK_VALUE(w_gate.dim() == 3, "w_gate must be 3-D [num_experts, intermediate_size, ...]");
  const int64_t E = w_gate.size(0), H = hidden.size(1);
  TORCH_CHECK_VALUE(expert_start >= 0 && expert_start + E <= total, "expert_start (",
                    expert_start, ") + the weights' ", E, " experts must lie within the ", total,
                    " experts of router_logits");
  const int64_t I = check_expert_weight("w_gate", w_gate, gate_type, E, H, hidden);
  const int64_t up_rows = check_expert_weight("w_up", w_up, up_type, E, H, hidden);
  TORCH_CHECK_VALUE(up_rows == I, "w_up has ", up_rows, " rows per expert but w_gate has ", I);
  const int64_t down_rows = check_expert_weight("w_down", w_down, down_type, E, I, hidden);
  TORCH_CHECK_VALUE(down_rows == H, "w_down must have hidden_size (", H,
                    ") rows per expert, got ", down_rows);
  check_expert_bias("gate_bias", gate_bias, E, I, hidden);
  check_expert_bias("up_bias", up_bias, E, I, hidden);
  check_expert_bias("down_bias", down_bias, E, H, hidden);
  const MoeActivation act = check_moe_activation(activation, alpha, limit);
  TORCH_CHECK_VALUE(many_rows >= 0 && many_rows <= hidden.size(0), "many_rows must be in [0, ",
                    hidden.size(0), "] (hidden's tokens), got ", many_rows);
  return {hidden.size(0), H, I, E, total, act};
}

}  // namespace pyllm
