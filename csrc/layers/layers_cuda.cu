// CUDA norms and activations: rms_norm, fused_add_rms_norm, silu_and_mul,
// gelu_tanh_and_mul (one thread block per row; all arithmetic in float32), and
// small_batch_linear.
#include <algorithm>
#include <vector>

#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>

#include "../cuda_utils.cuh"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "layers_checks.h"

namespace pyllm::cuda {
namespace {

// Threads per row: a multiple of the warp size, enough to cover short rows.
int threads_for(int64_t width, int64_t max_threads) {
  return static_cast<int>(std::min(max_threads, std::max<int64_t>(32, ((width + 31) / 32) * 32)));
}

template <typename T>
__global__ void rms_norm_kernel(T* __restrict__ out, const T* __restrict__ input,
                                const T* __restrict__ weight, RowLayout input_rows,
                                int hidden_size, float epsilon) {
  __shared__ float scratch[kWarpSize];
  const int64_t row = blockIdx.x;
  const T* x = input + input_rows.offset(row);
  float sum_squares = 0.f;
  for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
    const float v = to_float(x[i]);
    sum_squares += v * v;
  }
  sum_squares = block_sum(sum_squares, scratch);
  const float inv_rms = rsqrtf(sum_squares / static_cast<float>(hidden_size) + epsilon);
  T* y = out + row * hidden_size;
  for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
    y[i] = from_float<T>(to_float(x[i]) * inv_rms * to_float(weight[i]));
  }
}

// residual += input (rounded to T, as stored); input = rms_norm(residual) * weight.
template <typename T>
__global__ void fused_add_rms_norm_kernel(T* __restrict__ input, T* __restrict__ residual,
                                          const T* __restrict__ weight, int hidden_size,
                                          float epsilon) {
  __shared__ float scratch[kWarpSize];
  const int64_t row = blockIdx.x;
  T* x = input + row * hidden_size;
  T* r = residual + row * hidden_size;
  float sum_squares = 0.f;
  for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
    const T z = from_float<T>(to_float(x[i]) + to_float(r[i]));
    r[i] = z;
    const float v = to_float(z);
    sum_squares += v * v;
  }
  sum_squares = block_sum(sum_squares, scratch);
  const float inv_rms = rsqrtf(sum_squares / static_cast<float>(hidden_size) + epsilon);
  // Each thread reads back only the residual elements it wrote itself.
  for (int i = threadIdx.x; i < hidden_size; i += blockDim.x) {
    x[i] = from_float<T>(to_float(r[i]) * inv_rms * to_float(weight[i]));
  }
}

// out = g * sigmoid(a(g)) * up: SiLU's a(g) = g; GELU's tanh form is g * sigmoid(2u),
// u = sqrt(2 / pi) (g + 0.044715 g^3) (as the CPU kernel, layers_cpu.cpp).
template <typename T, bool kGelu>
__global__ void act_and_mul_kernel(T* __restrict__ out, const T* __restrict__ input,
                                   RowLayout input_rows, int d) {
  const int64_t row = blockIdx.x;
  const T* gate = input + input_rows.offset(row);
  const T* up = gate + d;
  T* y = out + row * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    const float g = to_float(gate[i]);
    const float a = kGelu ? g * (1.5957691216057308f + 0.0713548162726009f * g * g) : g;
    y[i] = from_float<T>(g / (1.f + __expf(-a)) * to_float(up[i]));
  }
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
              double epsilon) {
  check_rms_norm(out, input, weight, epsilon);
  check_cuda(input, "input");
  const int64_t hidden_size = input.size(-1);
  if (input.numel() == 0) return;
  const int64_t rows = input.numel() / hidden_size;

  const c10::cuda::CUDAGuard device_guard(input.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  PYLLM_DISPATCH_FLOATING_TYPES(input.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<device_t<scalar_t>><<<rows, threads_for(hidden_size, 512), 0, stream>>>(
        device_ptr<scalar_t>(out), device_ptr<scalar_t>(input), device_ptr<scalar_t>(weight),
        row_layout(input, hidden_size), static_cast<int>(hidden_size),
        static_cast<float>(epsilon));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon) {
  check_fused_add_rms_norm(input, residual, weight, epsilon);
  check_cuda(input, "input");
  const int64_t hidden_size = input.size(-1);
  if (input.numel() == 0) return;
  const int64_t rows = input.numel() / hidden_size;

  const c10::cuda::CUDAGuard device_guard(input.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  PYLLM_DISPATCH_FLOATING_TYPES(input.scalar_type(), "fused_add_rms_norm", [&] {
    fused_add_rms_norm_kernel<device_t<scalar_t>>
        <<<rows, threads_for(hidden_size, 512), 0, stream>>>(
            device_ptr<scalar_t>(input), device_ptr<scalar_t>(residual),
            device_ptr<scalar_t>(weight), static_cast<int>(hidden_size),
            static_cast<float>(epsilon));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <bool kGelu>
static void act_and_mul(at::Tensor& out, const at::Tensor& input) {
  check_act_and_mul(out, input);
  check_cuda(input, "input");
  const int64_t d = input.size(-1) / 2;
  if (out.numel() == 0) return;
  const int64_t rows = out.numel() / d;

  const c10::cuda::CUDAGuard device_guard(input.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  PYLLM_DISPATCH_FLOATING_TYPES(input.scalar_type(), "act_and_mul", [&] {
    act_and_mul_kernel<device_t<scalar_t>, kGelu><<<rows, threads_for(d, 1024), 0, stream>>>(
        device_ptr<scalar_t>(out), device_ptr<scalar_t>(input), row_layout(input, 2 * d),
        static_cast<int>(d));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  act_and_mul<false>(out, input);
}

void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& input) {
  act_and_mul<true>(out, input);
}

// On a GPU the product of a few rows is cuBLAS's to do well (its GEMV kernels stream
// the weight at HBM speed); the op exists on CUDA so that code calling it runs on
// either device. The shared checks, then one cuBLAS call.
void small_batch_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  check_small_batch_linear(out, input, weight, bias);
  check_cuda(input, "input");
  if (bias.has_value()) {
    at::addmm_out(out, *bias, input, weight.t());
  } else {
    at::mm_out(out, input, weight.t());
  }
}

// The word-packed layout is the CPU kernel's. Here the weight is viewed back as
// [N, K] (one copy) for cuBLAS, so that code calling the op runs on either device.
void packed_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed_weight,
                   const std::optional<at::Tensor>& bias) {
  const int64_t N = check_packed_linear(out, input, packed_weight, bias);
  check_cuda(input, "input");
  const at::Tensor weight = packed_weight.permute({0, 2, 1, 3}).reshape({N, input.size(1)});
  if (bias.has_value()) {
    at::addmm_out(out, *bias, input, weight.t());
  } else {
    at::mm_out(out, input, weight.t());
  }
}

}  // namespace pyllm::cuda
