// CUDA apply_token_bitmask (see sampling_cpu.cpp for the contract): one thread per
// 32-token mask word, writing -inf over the tokens whose bit is 0. Row ids are
// trusted here (checking them would cost a device-to-host copy each step).
#include <cstdint>

#include "../cuda_utils.cuh"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "sampling_checks.h"

namespace pyllm::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void apply_token_bitmask_kernel(T* __restrict__ logits,
                                           const int32_t* __restrict__ bitmask,
                                           const int64_t* __restrict__ rows, int64_t stride,
                                           int64_t vocab, int64_t num_words) {
  const int64_t i = blockIdx.y;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w * 32 >= vocab) return;
  const uint32_t word = w < num_words ? static_cast<uint32_t>(bitmask[i * num_words + w]) : 0u;
  if (word == 0xFFFFFFFFu) return;
  T* row = logits + rows[i] * stride;
  const int64_t end = min(vocab, (w + 1) * 32);
  for (int64_t t = w * 32; t < end; ++t) {
    if (!((word >> (t - w * 32)) & 1u)) row[t] = from_float<T>(-INFINITY);
  }
}

}  // namespace

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  check_apply_token_bitmask(logits, bitmask, rows);
  check_cuda(logits, "logits");
  const int64_t n = rows.size(0);
  const int64_t vocab = logits.size(1);
  if (n == 0 || vocab == 0) return;
  TORCH_CHECK_VALUE(n <= 65535, "apply_token_bitmask masks at most 65535 rows per call, got ", n);
  const int64_t words_per_row = (vocab + 31) / 32;
  const dim3 grid(static_cast<unsigned>((words_per_row + kThreads - 1) / kThreads),
                  static_cast<unsigned>(n));
  const c10::cuda::CUDAGuard device_guard(logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  PYLLM_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "apply_token_bitmask", [&] {
    apply_token_bitmask_kernel<device_t<scalar_t>><<<grid, kThreads, 0, stream>>>(
        device_ptr<scalar_t>(logits), bitmask.data_ptr<int32_t>(), rows.data_ptr<int64_t>(),
        logits.stride(0), vocab, bitmask.size(1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace pyllm::cuda
