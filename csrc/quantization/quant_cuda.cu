// CUDA kernels for GGUF-quantized weights: quant_linear and dequantize_rows.
//
// A quantized weight [N, K] is N rows of K / kBlock blocks of kBytes bytes,
// as the GGUF file stores them. Every format is decoded (gguf_blocks.cuh) in units of
// 32 consecutive weights of one row (a whole block for the 32-weight formats, one of
// the 8 sub-blocks of a 256-weight K-format block), so every kernel has one loop
// shape for all nine formats.
#include <algorithm>
#include <climits>

#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/macros/Macros.h>

#include "../cuda_utils.cuh"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "gguf_blocks.cuh"
#include "quant_checks.h"

namespace pyllm::cuda {
namespace {

// ---------------------------------------------------------------------------
// dequantize_rows: one thread per unit of 32 weights (a grid-stride loop). Output
// row r is weight row rows[r], or first_row + r without a row list.

template <typename T>
__device__ __forceinline__ void store_unit(T* dst, const float (&w)[kUnit], bool vectorized) {
  if (vectorized) {
    // dst is 16-byte aligned: 32 values are 8 (float) or 4 (16-bit) 16-byte stores.
    constexpr int kPerVec = 16 / sizeof(T);
#pragma unroll
    for (int v = 0; v < kUnit / kPerVec; ++v) {
      union {
        uint4 raw;
        T values[kPerVec];
      } pack;
#pragma unroll
      for (int i = 0; i < kPerVec; ++i) pack.values[i] = from_float<T>(w[v * kPerVec + i]);
      reinterpret_cast<uint4*>(dst)[v] = pack.raw;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kUnit; ++i) dst[i] = from_float<T>(w[i]);
  }
}

template <typename Format, typename T>
__global__ void dequantize_rows_kernel(T* __restrict__ out, const uint8_t* __restrict__ qweight,
                                       const int64_t* __restrict__ rows, int64_t first_row,
                                       int64_t num_weight_rows, int64_t num_out_rows,
                                       int64_t units_per_row, int64_t row_bytes, bool vectorized) {
  const int64_t total = num_out_rows * units_per_row;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < total;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = index / units_per_row;
    const int64_t unit = index % units_per_row;
    const int64_t row = rows ? rows[r] : first_row + r;
    // A row index outside the weight is the caller's error: a device-side assert
    // (as an embedding lookup raises), and never a read outside the weight.
    CUDA_KERNEL_ASSERT(row >= 0 && row < num_weight_rows);
    if (row < 0 || row >= num_weight_rows) continue;
    float w[kUnit];
    decode_unit<Format>(qweight + row * row_bytes, unit, w);
    store_unit<T>(out + r * units_per_row * kUnit + unit * kUnit, w, vectorized);
  }
}

// ---------------------------------------------------------------------------
// quant_linear for a few rows (M <= kGemvMaxRows): a dequantize-in-registers GEMV.
// One warp per output feature n, kGemvWarps features per thread block. The block
// walks K in tiles of 32 units (1024 weights): it stages the tile of all M input
// rows in shared memory as float, then lane l of each warp decodes unit l of the
// tile from its weight row and accumulates its 32 products for every input row.
// A warp-shuffle sum gives each output. All arithmetic is float32.

constexpr int kGemvMaxRows = 8;
constexpr int kGemvWarps = 8;
constexpr int kGemvThreads = kGemvWarps * kWarpSize;
constexpr int kTileUnits = kWarpSize;  // one unit per lane per tile
// Shared tile [rows][kTileUnits][kUnit + 1]: the +1 keeps the lanes, which read
// units kUnit floats apart, in different banks.
constexpr int kTileStride = kUnit + 1;

inline size_t gemv_shared_bytes(int64_t rows) {
  return static_cast<size_t>(rows) * kTileUnits * kTileStride * sizeof(float);
}

template <typename Format, typename T>
__global__ void __launch_bounds__(kGemvThreads)
    quant_gemv_kernel(T* __restrict__ out, int64_t out_stride, const T* __restrict__ input,
                      int64_t input_stride, const uint8_t* __restrict__ qweight, int64_t row_bytes,
                      const T* __restrict__ bias, int num_rows, int N, int K) {
  extern __shared__ float tile[];
  const int lane = threadIdx.x % kWarpSize;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / kWarpSize;
  const bool active = n < N;  // idle warps still take part in the barriers
  const uint8_t* wrow = qweight + (active ? n : 0) * row_bytes;

  float acc[kGemvMaxRows];
#pragma unroll
  for (int m = 0; m < kGemvMaxRows; ++m) acc[m] = 0.f;

  const int units = K / kUnit;
  for (int tile_start = 0; tile_start < units; tile_start += kTileUnits) {
    const int tile_units = min(kTileUnits, units - tile_start);
    const int tile_len = tile_units * kUnit;
    const int64_t k0 = static_cast<int64_t>(tile_start) * kUnit;
    __syncthreads();  // the previous tile has been read by every warp
    for (int i = threadIdx.x; i < num_rows * tile_len; i += blockDim.x) {
      const int m = i / tile_len, k = i % tile_len;
      tile[(m * kTileUnits + k / kUnit) * kTileStride + k % kUnit] =
          to_float(input[m * input_stride + k0 + k]);
    }
    __syncthreads();
    if (active && lane < tile_units) {
      float w[kUnit];
      decode_unit<Format>(wrow, tile_start + lane, w);
#pragma unroll
      for (int m = 0; m < kGemvMaxRows; ++m) {
        if (m < num_rows) {
          const float* x = tile + (m * kTileUnits + lane) * kTileStride;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < kUnit; ++j) sum += w[j] * x[j];
          acc[m] += sum;
        }
      }
    }
  }

#pragma unroll
  for (int m = 0; m < kGemvMaxRows; ++m) {
    if (m < num_rows) acc[m] = warp_sum(acc[m]);
  }
  if (active && lane == 0) {
    const float b = bias ? to_float(bias[n]) : 0.f;
#pragma unroll
    for (int m = 0; m < kGemvMaxRows; ++m) {
      if (m < num_rows) out[m * out_stride + n] = from_float<T>(acc[m] + b);
    }
  }
}

// ---------------------------------------------------------------------------
// Host side.

// The kernels index rows and columns with int.
void check_int_sizes(const at::Tensor& qweight, int64_t K) {
  TORCH_CHECK(qweight.size(0) <= INT_MAX && K <= INT_MAX, "qweight is too large: ",
              qweight.sizes());
}

// Dequantizes weight rows into out [R, K] (contiguous, on qweight's device): row r is
// rows[r] when `rows` is given, else first_row + r.
void launch_dequantize(at::Tensor& out, const at::Tensor& qweight, int64_t qtype,
                       const int64_t* rows, int64_t first_row, cudaStream_t stream) {
  const int64_t R = out.size(0), K = out.size(1);
  const int64_t units_per_row = K / kUnit;
  const int64_t total = R * units_per_row;
  if (total == 0) return;
  constexpr int kThreads = 256;
  // A grid-stride loop covers whatever the grid does not.
  const unsigned int blocks = static_cast<unsigned int>(
      std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t{1} << 20));
  const bool vectorized = reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  dispatch_format(qtype, [&](auto format) {
    using Format = decltype(format);
    PYLLM_DISPATCH_FLOATING_TYPES(out.scalar_type(), "dequantize_rows", [&] {
      dequantize_rows_kernel<Format, device_t<scalar_t>><<<blocks, kThreads, 0, stream>>>(
          device_ptr<scalar_t>(out), qweight.data_ptr<uint8_t>(), rows, first_row, qweight.size(0),
          R, units_per_row, qweight.size(1), vectorized);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// Scratch the GEMM path dequantizes into, per chunk of output features.
constexpr int64_t kScratchBytes = int64_t{256} << 20;

}  // namespace

void dequantize_rows(at::Tensor& out, const at::Tensor& qweight, int64_t qtype,
                     const std::optional<at::Tensor>& rows) {
  check_dequantize_rows(out, qweight, qtype, rows);
  check_cuda(out, "out");
  check_int_sizes(qweight, out.size(1));
  // Row indices stay on the device: the kernel reads them (pyllm/ops.py checks them).
  const int64_t* row_ptr = rows.has_value() ? rows->data_ptr<int64_t>() : nullptr;
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard device_guard(out.device());
  launch_dequantize(out, qweight, qtype, row_ptr, 0, c10::cuda::getCurrentCUDAStream());
}

namespace {

void linear_rows(at::Tensor& out, const at::Tensor& input, const at::Tensor& qweight,
                 int64_t qtype, const std::optional<at::Tensor>& bias, bool many) {
  const int64_t M = input.size(0), K = input.size(1), N = qweight.size(0);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (K == 0) {  // an empty sum
    if (bias.has_value()) {
      out.copy_(bias->unsqueeze(0).expand({M, N}));
    } else {
      out.zero_();
    }
    return;
  }

  if (!many && M <= kGemvMaxRows) {
    const int blocks = static_cast<int>(ceil_div(N, kGemvWarps));
    dispatch_format(qtype, [&](auto format) {
      using Format = decltype(format);
      PYLLM_DISPATCH_FLOATING_TYPES(input.scalar_type(), "quant_linear", [&] {
        using T = device_t<scalar_t>;
        quant_gemv_kernel<Format, T><<<blocks, kGemvThreads, gemv_shared_bytes(M), stream>>>(
            device_ptr<scalar_t>(out), out.stride(0), device_ptr<scalar_t>(input), input.stride(0),
            qweight.data_ptr<uint8_t>(), qweight.size(1),
            bias.has_value() ? device_ptr<scalar_t>(*bias) : nullptr, static_cast<int>(M),
            static_cast<int>(N), static_cast<int>(K));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    return;
  }

  // Many rows: dequantize into a scratch weight in input's dtype and let cuBLAS do the
  // product. Here the multiply is compute-bound and the one pass over the weight is
  // amortized over M rows, so cuBLAS's tensor-core GEMM (float32 accumulation) beats
  // anything a simple tiled kernel would reach. The weight is done in chunks of
  // output features so the scratch stays bounded for large weights (an LM head).
  const int64_t row_scratch = K * static_cast<int64_t>(input.element_size());
  const int64_t chunk = std::min(N, std::max<int64_t>(128, kScratchBytes / row_scratch));
  at::Tensor scratch = at::empty({chunk, K}, input.options());
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t n = std::min(chunk, N - n0);
    at::Tensor weight = scratch.narrow(0, 0, n);
    launch_dequantize(weight, qweight, qtype, nullptr, n0, stream);
    at::Tensor out_chunk = out.narrow(1, n0, n);
    if (bias.has_value()) {
      at::addmm_out(out_chunk, bias->narrow(0, n0, n), input, weight.t());
    } else {
      at::mm_out(out_chunk, input, weight.t());
    }
  }
}

}  // namespace

// Rows [0, many_rows) take the many-row path (dequantize + cuBLAS) whatever their
// count; the rest take the path of their own count, as on the CPU (quant_cpu.cpp).
void quant_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& qweight,
                  int64_t qtype, const std::optional<at::Tensor>& bias, int64_t many_rows) {
  const int64_t N = check_quant_linear(out, input, qweight, qtype, bias, many_rows);
  check_cuda(input, "input");
  const int64_t M = input.size(0), K = input.size(1);
  check_int_sizes(qweight, K);
  if (M == 0 || N == 0) return;
  int64_t P = many_rows;
  if (P > 0 && M - P > kGemvMaxRows) P = M;  // the other rows take that path too
  if (P == 0 || P == M) {
    linear_rows(out, input, qweight, qtype, bias, P == M);
    return;
  }
  at::Tensor head = out.narrow(0, 0, P), tail = out.narrow(0, P, M - P);
  linear_rows(head, input.narrow(0, 0, P), qweight, qtype, bias, true);
  linear_rows(tail, input.narrow(0, P, M - P), qweight, qtype, bias, false);
}

}  // namespace pyllm::cuda
