// The building blocks of the ops' argument checks (csrc/<family>/<family>_checks.h).
//
// Plain C++ shared by the CPU and the CUDA implementations. Each check names the
// argument and the wrong value, and raises what Python users expect:
// TORCH_CHECK_TYPE (TypeError) for a dtype, TORCH_CHECK_VALUE (ValueError) for a
// shape, layout or value. Dtypes and shapes are spelled as Python prints them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace pyllm {

// "torch.float32", as Python prints the dtype.
inline std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kDouble: return "torch.float64";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(dtype);
  }
}

// "(3, 64)" or "(8,)", as Python prints a shape tuple.
inline std::string shape_text(at::IntArrayRef shape) {
  std::string text = "(";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + (shape.size() == 1 ? ",)" : ")");
}

inline bool is_float_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

// x of the KV cache layout: elements per 16-byte group of a key.
inline int64_t kv_cache_x(at::ScalarType dtype) {
  return 16 / static_cast<int64_t>(c10::elementSize(dtype));
}

inline void check_float_dtype(std::string_view name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(is_float_dtype(t.scalar_type()), name, " has dtype ",
                   dtype_name(t.scalar_type()), "; supported: float32, float16, bfloat16");
}

// t must have the dtype of the op's other float tensors.
inline void check_same_dtype(std::string_view name, const at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " has dtype ", dtype_name(t.scalar_type()),
                   " but must match the others (", dtype_name(dtype), ")");
}

// t must have this one dtype (index tensors, float32 statistics).
inline void check_dtype(std::string_view name, const at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must have dtype ", dtype_name(dtype),
                   ", got ", dtype_name(t.scalar_type()));
}

inline void check_device(std::string_view name, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, name, " is on ", t.device(),
                    " but the other tensors are on ", device);
}

inline void check_ndim(std::string_view name, const at::Tensor& t, int64_t ndim,
                       std::string_view layout) {
  TORCH_CHECK_VALUE(t.dim() == ndim, name, " must be ", ndim, "-D ", layout, ", got shape ",
                    shape_text(t.sizes()));
}

inline void check_shape(std::string_view name, const at::Tensor& t, at::IntArrayRef shape,
                        std::string_view layout) {
  TORCH_CHECK_VALUE(t.sizes() == shape, name, " must have shape ", shape_text(shape), " ",
                    layout, ", got ", shape_text(t.sizes()));
}

inline void check_contiguous(std::string_view name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

// Rows (dim 0) may be strided, as in a view of a wider tensor; the elements inside
// one row must be packed.
inline void check_packed_rows(std::string_view name, const at::Tensor& t) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d > 0; --d) {
    TORCH_CHECK_VALUE(t.size(d) <= 1 || t.stride(d) == expected, name,
                      " must have each row's elements packed (all dims but the first "
                      "contiguous), got shape ",
                      shape_text(t.sizes()), " with strides ", shape_text(t.strides()));
    expected *= t.size(d);
  }
  TORCH_CHECK_VALUE(t.dim() != 1 || t.size(0) <= 1 || t.stride(0) == 1, name,
                    " must be contiguous");
}

// A tensor argument of one device and dtype as the op's reference tensor.
inline void check_like(std::string_view name, const at::Tensor& t, const at::Tensor& like) {
  check_device(name, t, like.device());
  check_same_dtype(name, t, like.scalar_type());
}

}  // namespace pyllm
