// CUDA kernels for GGUF-quantized weights: quant_linear and dequantize_rows.
//
// A quantized weight [N, K] is N rows of K / kBlockSize blocks of kTypeSize bytes,
// as the GGUF file stores them. Every format is decoded here in units of 32
// consecutive weights of one row (a whole block for the 32-weight formats, one of
// the 8 sub-blocks of a 256-weight K-format block), so every kernel has one loop
// shape for all nine formats.
//
// Blocks are 17 to 210 bytes long, so most fields are only 2-byte aligned (some not
// even that in a view of a weight): the decoders read bytes and assemble the fp16 and
// uint32 fields from them instead of relying on any alignment.
#include <algorithm>
#include <climits>
#include <cstring>

#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/macros/Macros.h>

#include "../cuda_utils.cuh"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "quant_checks.h"

namespace pyllm::cuda {
namespace {

// Weights per decoding unit.
constexpr int kUnit = 32;

// The decoders are host-callable too, so their bit layouts can be checked against a
// reference on a machine without a GPU.
#define PYLLM_HD __host__ __device__ __forceinline__
#ifdef __CUDA_ARCH__
#define PYLLM_UNROLL _Pragma("unroll")
#else
#define PYLLM_UNROLL
#endif

PYLLM_HD uint32_t byte_at(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

PYLLM_HD float half_at(const uint8_t* p) {
  const uint16_t bits = static_cast<uint16_t>(byte_at(p) | (byte_at(p + 1) << 8));
  return __half2float(__ushort_as_half(bits));
}

PYLLM_HD uint32_t u32_at(const uint8_t* p) {
  return byte_at(p) | (byte_at(p + 1) << 8) | (byte_at(p + 2) << 16) | (byte_at(p + 3) << 24);
}

// Each format: kBlockSize weights in kTypeSize bytes; decode(block, u, w) writes the
// 32 weights of unit u (0 <= u < kBlockSize / 32) of the block at `block`.

// d (fp16), qs[16]: weight j is low nibble of qs[j], weight j + 16 its high nibble.
struct Q4_0 {
  static constexpr int kBlockSize = 32, kTypeSize = 18;
  PYLLM_HD static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b);
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const int q = static_cast<int>(byte_at(b + 2 + j));
      w[j] = d * static_cast<float>((q & 0xF) - 8);
      w[j + 16] = d * static_cast<float>((q >> 4) - 8);
    }
  }
};

// d, m (fp16), qs[16]: w = d * q + m.
struct Q4_1 {
  static constexpr int kBlockSize = 32, kTypeSize = 20;
  PYLLM_HD static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b), m = half_at(b + 2);
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const int q = static_cast<int>(byte_at(b + 4 + j));
      w[j] = d * static_cast<float>(q & 0xF) + m;
      w[j + 16] = d * static_cast<float>(q >> 4) + m;
    }
  }
};

// d (fp16), qh (uint32: bit j is weight j's fifth bit), qs[16]: w = d * (q - 16).
struct Q5_0 {
  static constexpr int kBlockSize = 32, kTypeSize = 22;
  PYLLM_HD static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b);
    const uint32_t qh = u32_at(b + 2);
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const int q = static_cast<int>(byte_at(b + 6 + j));
      const int lo = (q & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (q >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      w[j] = d * static_cast<float>(lo - 16);
      w[j + 16] = d * static_cast<float>(hi - 16);
    }
  }
};

// d, m (fp16), qh (uint32), qs[16]: w = d * q + m.
struct Q5_1 {
  static constexpr int kBlockSize = 32, kTypeSize = 24;
  PYLLM_HD static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b), m = half_at(b + 2);
    const uint32_t qh = u32_at(b + 4);
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const int q = static_cast<int>(byte_at(b + 8 + j));
      const int lo = (q & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int hi = (q >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      w[j] = d * static_cast<float>(lo) + m;
      w[j + 16] = d * static_cast<float>(hi) + m;
    }
  }
};

// d (fp16), qs int8[32]: w = d * q.
struct Q8_0 {
  static constexpr int kBlockSize = 32, kTypeSize = 34;
  PYLLM_HD static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const float d = half_at(b);
    PYLLM_UNROLL
    for (int j = 0; j < 32; ++j) {
      w[j] = d * static_cast<float>(static_cast<int8_t>(byte_at(b + 2 + j)));
    }
  }
};

// 2^(e - 128) for 2 <= e <= 255, from bits: exponent field e - 1.
PYLLM_HD float pow2_minus_128(uint32_t e) {
  const uint32_t bits = (e - 1) << 23;
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// A 4-bit MXFP4 code (sign, 2-bit exponent, 1-bit mantissa) as twice its E2M1 value:
// the magnitudes 0, 1, 2, 3, 4, 6, 8, 12 are the nibbles of one word, so no table.
PYLLM_HD float mxfp4_value(uint32_t code) {
  const int magnitude = static_cast<int>((0xC8643210u >> (4 * (code & 7))) & 0xF);
  return static_cast<float>(code & 8 ? -magnitude : magnitude);
}

// e (E8M0), qs[16]: weight j is the low nibble of qs[j], weight j + 16 its high
// nibble; w = mxfp4_value(code) * 2^(e - 128) (ggml's GGML_E8M0_TO_FP32_HALF(e)).
// For e < 2 that scale is subnormal, which this build's --use_fast_math flushes to
// zero as an operand: the values are quartered and scaled by 2^(e - 126) instead, so
// every weight >= 2^-126 is exact (smaller ones are subnormal and flush to zero).
struct MXFP4 {
  static constexpr int kBlockSize = 32, kTypeSize = 17;
  PYLLM_HD static void decode(const uint8_t* b, int, float (&w)[kUnit]) {
    const uint32_t e = byte_at(b);
    const float d = pow2_minus_128(e < 2 ? e + 2 : e);
    const float quarter = e < 2 ? 0.25f : 1.0f;
    PYLLM_UNROLL
    for (int j = 0; j < 16; ++j) {
      const uint32_t q = byte_at(b + 1 + j);
      w[j] = d * (quarter * mxfp4_value(q & 0xF));
      w[j + 16] = d * (quarter * mxfp4_value(q >> 4));
    }
  }
};

// Q4_K / Q5_K: the 6-bit scale and min of sub-block u, packed in 12 bytes: bytes 0-3
// hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
// for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7
// (high nibble).
PYLLM_HD void k_scale_min(const uint8_t* s, int u, int& scale, int& min) {
  if (u < 4) {
    scale = static_cast<int>(byte_at(s + u) & 63);
    min = static_cast<int>(byte_at(s + u + 4) & 63);
  } else {
    scale = static_cast<int>((byte_at(s + u + 4) & 0xF) | ((byte_at(s + u - 4) >> 6) << 4));
    min = static_cast<int>((byte_at(s + u + 4) >> 4) | ((byte_at(s + u) >> 6) << 4));
  }
}

// d, dmin (fp16), scales[12], qs[128]: sub-block u's quants are the low (u even) or
// high (u odd) nibbles of qs[32 * (u / 2) + l]; w = d * scale * q - dmin * min.
struct Q4_K {
  static constexpr int kBlockSize = 256, kTypeSize = 144;
  PYLLM_HD static void decode(const uint8_t* b, int u, float (&w)[kUnit]) {
    int scale, min;
    k_scale_min(b + 4, u, scale, min);
    const float a = half_at(b) * static_cast<float>(scale);
    const float c = half_at(b + 2) * static_cast<float>(min);
    const uint8_t* qs = b + 16 + 32 * (u / 2);
    const int shift = 4 * (u % 2);
    PYLLM_UNROLL
    for (int l = 0; l < 32; ++l) {
      const int q = static_cast<int>((byte_at(qs + l) >> shift) & 0xF);
      w[l] = a * static_cast<float>(q) - c;
    }
  }
};

// d, dmin, scales[12], qh[32], qs[128]: Q4_K's nibbles plus a fifth bit, bit u of
// qh[l].
struct Q5_K {
  static constexpr int kBlockSize = 256, kTypeSize = 176;
  PYLLM_HD static void decode(const uint8_t* b, int u, float (&w)[kUnit]) {
    int scale, min;
    k_scale_min(b + 4, u, scale, min);
    const float a = half_at(b) * static_cast<float>(scale);
    const float c = half_at(b + 2) * static_cast<float>(min);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48 + 32 * (u / 2);
    const int shift = 4 * (u % 2);
    PYLLM_UNROLL
    for (int l = 0; l < 32; ++l) {
      const int q = static_cast<int>(((byte_at(qs + l) >> shift) & 0xF) |
                                     (((byte_at(qh + l) >> u) & 1u) << 4));
      w[l] = a * static_cast<float>(q) - c;
    }
  }
};

// ql[128], qh[64], scales int8[16], d (fp16). The block is two halves of 128 weights;
// in half h, sub-block g (u = 4h + g) takes the low (g < 2) or high nibbles of
// ql[64h + 32 * (g % 2) + l] and bits 2g, 2g+1 of qh[32h + l]; q is 6 bits minus 32,
// and each 16 weights have their own scale: w = d * scales[16-weight group] * q.
struct Q6_K {
  static constexpr int kBlockSize = 256, kTypeSize = 210;
  PYLLM_HD static void decode(const uint8_t* b, int u, float (&w)[kUnit]) {
    const int h = u / 4, g = u % 4;
    const float d = half_at(b + 208);
    const uint8_t* ql = b + 64 * h + 32 * (g % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    const int ql_shift = 4 * (g / 2), qh_shift = 2 * g;
    const float a0 = d * static_cast<float>(static_cast<int8_t>(byte_at(b + 192 + 8 * h + 2 * g)));
    const float a1 =
        d * static_cast<float>(static_cast<int8_t>(byte_at(b + 192 + 8 * h + 2 * g + 1)));
    PYLLM_UNROLL
    for (int l = 0; l < 32; ++l) {
      const int q = static_cast<int>(((byte_at(ql + l) >> ql_shift) & 0xF) |
                                     (((byte_at(qh + l) >> qh_shift) & 3u) << 4)) -
                    32;
      w[l] = (l < 16 ? a0 : a1) * static_cast<float>(q);
    }
  }
};

#undef PYLLM_UNROLL
#undef PYLLM_HD

// Unit `unit` (counted from the start of the row) of the row at `row`.
template <typename Format>
__device__ __forceinline__ void decode_unit(const uint8_t* row, int64_t unit, float (&w)[kUnit]) {
  constexpr int kUnitsPerBlock = Format::kBlockSize / kUnit;
  const int64_t block = unit / kUnitsPerBlock;
  Format::decode(row + block * Format::kTypeSize, static_cast<int>(unit % kUnitsPerBlock), w);
}

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

struct FormatInfo {
  int block_size;
  int type_size;
};

FormatInfo format_info(int64_t qtype) {
  switch (qtype) {
    case 2:
      return {Q4_0::kBlockSize, Q4_0::kTypeSize};
    case 3:
      return {Q4_1::kBlockSize, Q4_1::kTypeSize};
    case 6:
      return {Q5_0::kBlockSize, Q5_0::kTypeSize};
    case 7:
      return {Q5_1::kBlockSize, Q5_1::kTypeSize};
    case 8:
      return {Q8_0::kBlockSize, Q8_0::kTypeSize};
    case 12:
      return {Q4_K::kBlockSize, Q4_K::kTypeSize};
    case 13:
      return {Q5_K::kBlockSize, Q5_K::kTypeSize};
    case 14:
      return {Q6_K::kBlockSize, Q6_K::kTypeSize};
    case 39:
      return {MXFP4::kBlockSize, MXFP4::kTypeSize};
    default:
      TORCH_CHECK(false, "qtype ", qtype,
                  " is not a supported GGML type (Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, "
                  "Q4_K=12, Q5_K=13, Q6_K=14, MXFP4=39)");
  }
}

// Calls f(Format{}) for qtype (already validated by format_info).
template <typename F>
void dispatch_format(int64_t qtype, F&& f) {
  switch (qtype) {
    case 2:
      return f(Q4_0{});
    case 3:
      return f(Q4_1{});
    case 6:
      return f(Q5_0{});
    case 7:
      return f(Q5_1{});
    case 8:
      return f(Q8_0{});
    case 12:
      return f(Q4_K{});
    case 13:
      return f(Q5_K{});
    case 14:
      return f(Q6_K{});
    case 39:
      return f(MXFP4{});
    default:
      format_info(qtype);  // raises
  }
}

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

void quant_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& qweight,
                  int64_t qtype, const std::optional<at::Tensor>& bias) {
  const int64_t N = check_quant_linear(out, input, qweight, qtype, bias);
  check_cuda(input, "input");
  const int64_t M = input.size(0), K = input.size(1);
  check_int_sizes(qweight, K);
  if (M == 0 || N == 0) return;
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

  if (M <= kGemvMaxRows) {
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

}  // namespace pyllm::cuda
