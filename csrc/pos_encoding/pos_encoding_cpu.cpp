// TEMPORARY scaffold: replaced by the real CPU rotary kernel.
#include <c10/util/Exception.h>

#include "../ops.h"

namespace pyllm::cpu {

void rotary_embedding(const at::Tensor&, at::Tensor&, at::Tensor&, int64_t, const at::Tensor&,
                      bool) {
  TORCH_CHECK(false, "rotary_embedding: not implemented yet");
}

}  // namespace pyllm::cpu
