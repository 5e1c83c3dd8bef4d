// TEMPORARY scaffold: replaced by the real CPU norm/activation kernels.
#include <c10/util/Exception.h>

#include "../ops.h"

namespace pyllm::cpu {

void rms_norm(at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  TORCH_CHECK(false, "rms_norm: not implemented yet");
}

void fused_add_rms_norm(at::Tensor&, at::Tensor&, const at::Tensor&, double) {
  TORCH_CHECK(false, "fused_add_rms_norm: not implemented yet");
}

void silu_and_mul(at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "silu_and_mul: not implemented yet");
}

}  // namespace pyllm::cpu
