// TEMPORARY scaffold: replaced by the real CPU attention kernels.
#include <c10/util/Exception.h>

#include "../ops.h"

namespace pyllm::cpu {

void paged_attention_v1(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        int64_t, double, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                        const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "paged_attention_v1: not implemented yet");
}

void paged_attention_v2(at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, int64_t, double, const at::Tensor&,
                        const at::Tensor&, int64_t, int64_t, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "paged_attention_v2: not implemented yet");
}

void paged_attention_prefill(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             int64_t, double, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, int64_t, int64_t,
                             const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "paged_attention_prefill: not implemented yet");
}

}  // namespace pyllm::cpu
