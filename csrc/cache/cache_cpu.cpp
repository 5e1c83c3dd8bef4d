// TEMPORARY scaffold: replaced by the real CPU cache kernels.
#include <c10/util/Exception.h>

#include "../ops.h"

namespace pyllm::cpu {

void reshape_and_cache(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                       const at::Tensor&, const std::string&) {
  TORCH_CHECK(false, "reshape_and_cache: not implemented yet");
}

void copy_blocks(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                 const at::Tensor&) {
  TORCH_CHECK(false, "copy_blocks: not implemented yet");
}

void swap_blocks(const at::Tensor&, at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "swap_blocks: not implemented yet");
}

}  // namespace pyllm::cpu
