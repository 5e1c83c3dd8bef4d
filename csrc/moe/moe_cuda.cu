// CUDA kernels of the mixture-of-experts ops: moe_topk (routing) and fused_moe (a
// whole MoE feed-forward). Everything runs on the device, without a host sync:
//  1. moe_topk_kernel: one warp per token, its softmax and top-k;
//  2. group_kernel (one block): a counting sort of the (token, choice) pairs by local
//     expert: each pair's grouped row, each row's token, and the tiles of the two
//     product kernels: experts with at most kGemvMaxRows rows in tiles of up to
//     kGemvRows rows for the GEMV kernel, the others in tiles of kBM rows for the
//     tiled GEMM;
//  3. gate/up: gemv_kernel / gemm_kernel decode the weights' blocks as they read them
//     (gguf_blocks.cuh; float weights are read as they are), multiply in float32, add
//     the biases, apply the activation and store the activations (float32);
//  4. down: the same kernels over the activations into float32 rows (+ bias);
//  5. combine_kernel: one block per token, the weighted sum of its rows in its own
//     top-k order.
// The GEMV kernel reads each expert's weights once for up to kGemvRows rows (a decode
// step); the GEMM kernel stages a dequantized kBK x kBN tile of the weight and a kBM x
// kBK tile of the rows in shared memory for 4 x 4 register tiles (a prefill). Gate
// and up share one type here (models quantize them alike).
#include <algorithm>
#include <climits>

#include <ATen/ops/empty.h>

#include "../cuda_utils.cuh"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "../quantization/gguf_blocks.cuh"
#include "moe_checks.h"

namespace pyllm::cuda {
namespace {

// ---------------------------------------------------------------------------
// Weight rows: unit u (values [32 u, 32 u + 32)) of a row, as float32.

template <typename Format>
struct QuantRows {
  __device__ static void unit(const uint8_t* row, int u, int, float (&w)[kUnit]) {
    decode_unit<Format>(row, u, w);
  }
};

// Float weights of the activations' dtype T; values past K read as 0.
template <typename T>
struct FloatRows {
  __device__ static void unit(const uint8_t* row, int u, int K, float (&w)[kUnit]) {
    const T* r = reinterpret_cast<const T*>(row);
#pragma unroll
    for (int j = 0; j < kUnit; ++j) {
      const int k = u * kUnit + j;
      w[j] = k < K ? to_float(r[k]) : 0.f;
    }
  }
};

// Calls f(Rows{}) for a weight of GGML type `type` with activations of scalar_t.
template <typename scalar_t, typename F>
void dispatch_rows(int64_t type, F&& f) {
  if (is_float_weight_type(type)) {
    f(FloatRows<device_t<scalar_t>>{});
  } else {
    dispatch_format(type, [&](auto format) { f(QuantRows<decltype(format)>{}); });
  }
}

// ---------------------------------------------------------------------------
// Routing: one warp per token.

constexpr int kTopkWarps = 4;

// The better of (p, e) and (q, f): the larger probability, the lower id on ties.
__device__ __forceinline__ bool better(float p, int e, float q, int f) {
  return p > q || (p == q && e < f);
}

template <typename T>
__global__ void moe_topk_kernel(float* __restrict__ weights, int32_t* __restrict__ ids,
                                const T* __restrict__ logits, int num_tokens, int E, int k,
                                bool renormalize) {
  extern __shared__ float probs[];  // [kTopkWarps][E]
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int t = blockIdx.x * kTopkWarps + warp;
  if (t >= num_tokens) return;  // whole warps leave: no block barrier follows
  float* p = probs + warp * E;
  const T* row = logits + static_cast<int64_t>(t) * E;
  float max = -INFINITY;
  for (int e = lane; e < E; e += kWarpSize) max = fmaxf(max, to_float(row[e]));
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) {
    max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, mask));
  }
  float sum = 0.f;
  for (int e = lane; e < E; e += kWarpSize) {
    p[e] = expf(to_float(row[e]) - max);
    sum += p[e];
  }
  sum = warp_sum(sum);
  __syncwarp();
  // Chosen experts are marked -2; a NaN probability ranks as -1, below every other
  // (the bit test: fast math may drop isnan), so that k experts are always chosen.
  float chosen = 0.f;
  for (int j = 0; j < k; ++j) {
    float best = -1.5f;
    int best_e = INT_MAX;
    for (int e = lane; e < E; e += kWarpSize) {
      const float q = (__float_as_uint(p[e]) & 0x7fffffffu) > 0x7f800000u ? -1.f : p[e];
      if (better(q, e, best, best_e)) {
        best = q;
        best_e = e;
      }
    }
#pragma unroll
    for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) {
      const float q = __shfl_xor_sync(0xffffffffu, best, mask);
      const int f = __shfl_xor_sync(0xffffffffu, best_e, mask);
      if (better(q, f, best, best_e)) {
        best = q;
        best_e = f;
      }
    }
    const float value = p[best_e];  // read by every lane before lane 0 marks it
    chosen += value;
    __syncwarp();
    if (lane == 0) {
      ids[static_cast<int64_t>(t) * k + j] = best_e;
      weights[static_cast<int64_t>(t) * k + j] = value;
      p[best_e] = -2.f;
    }
    __syncwarp();
  }
  const float scale = 1.f / (renormalize ? chosen : sum);
  for (int j = lane; j < k; j += kWarpSize) weights[static_cast<int64_t>(t) * k + j] *= scale;
}

template <typename scalar_t>
void launch_topk(float* weights, int32_t* ids, const at::Tensor& logits, int64_t k,
                 bool renormalize, cudaStream_t stream) {
  const int T = static_cast<int>(logits.size(0)), E = static_cast<int>(logits.size(1));
  const size_t smem = static_cast<size_t>(kTopkWarps) * E * sizeof(float);
  TORCH_CHECK(smem <= 48 * 1024, "router_logits has too many experts (", E, ") for moe_topk");
  moe_topk_kernel<<<ceil_div(T, kTopkWarps), kTopkWarps * kWarpSize, smem, stream>>>(
      weights, ids, device_ptr<scalar_t>(logits), T, E, static_cast<int>(k), renormalize);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void route(float* weights, int32_t* ids, const at::Tensor& logits, int64_t k, bool renormalize,
           cudaStream_t stream) {
  PYLLM_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "moe_topk", [&] {
    launch_topk<scalar_t>(weights, ids, logits, k, renormalize, stream);
  });
}

// ---------------------------------------------------------------------------
// Grouping: one block.

constexpr int kGemvRows = 8;       // rows per GEMV tile
constexpr int kGemvMaxRows = 16;   // experts with more rows take the tiled GEMM
constexpr int kBM = 64, kBN = 64, kBK = 32;  // GEMM tile: rows, columns, K step
constexpr int kGroupThreads = 1024;

// Tiles of a product kernel: tile i covers rows [row0[i], row0[i] + rows[i]) of
// expert expert[i]; count[0] tiles in all.
struct Tiles {
  int32_t* expert;
  int32_t* row0;
  int32_t* rows;
  int32_t* count;
};

__global__ void group_kernel(const int32_t* __restrict__ ids, int P, int k, int E,
                             int expert_start, int32_t* __restrict__ row_of_pair,
                             int32_t* __restrict__ token_of_row, Tiles gemv, Tiles gemm) {
  extern __shared__ int32_t counts[];  // [E] rows, [E] filled, [E] first row
  int32_t* filled = counts + E;
  int32_t* first = counts + 2 * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = filled[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int e = ids[p] - expert_start;
    if (e >= 0 && e < E) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int row = 0, nv = 0, nm = 0;
    for (int e = 0; e < E; ++e) {
      first[e] = row;
      const int R = counts[e];
      const bool few = R <= kGemvMaxRows;
      const int step = few ? kGemvRows : kBM;
      for (int r0 = 0; r0 < R; r0 += step) {
        const Tiles& t = few ? gemv : gemm;
        const int i = few ? nv++ : nm++;
        t.expert[i] = e;
        t.row0[i] = row + r0;
        t.rows[i] = min(step, R - r0);
      }
      row += R;
    }
    *gemv.count = nv;
    *gemm.count = nm;
  }
  __syncthreads();
  // Rows within an expert in the order the atomics give: each row's products do
  // not depend on its neighbours, and combine_kernel sums in each token's order.
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int e = ids[p] - expert_start;
    int r = -1;
    if (e >= 0 && e < E) {
      r = first[e] + atomicAdd(&filled[e], 1);
      token_of_row[r] = p / k;
    }
    row_of_pair[p] = r;
  }
}

// ---------------------------------------------------------------------------
// The products.

// What a product kernel reads and writes. Input row r of the tile is x + token[r] *
// x_ld (gate/up: the token's hidden row) or x + r * x_ld (down: grouped rows).
template <typename In, typename T>
struct Products {
  const uint8_t* w0;  // gate, or the only weight
  const uint8_t* w1;  // up (gate/up kernels)
  int64_t row_bytes, expert_bytes;
  const T* bias0;  // [E, N] or null
  const T* bias1;
  const In* x;
  int64_t x_ld;
  const int32_t* token;  // or null
  float* out;            // [rows, N]
  int N, K;
  Tiles tiles;
  bool swiglu;
  float alpha, limit;
};

__device__ __forceinline__ float activation(float g, float u, bool swiglu, float alpha,
                                            float limit) {
  if (!swiglu) return g / (1.f + __expf(-g)) * u;
  g = fminf(g, limit);
  u = fminf(fmaxf(u, -limit), limit);
  return (u + 1.f) * g / (1.f + __expf(-alpha * g));
}

// The output of row r, column n: bias added, and with kGateUp the activation.
template <bool kGateUp, typename In, typename T>
__device__ __forceinline__ void store(const Products<In, T>& p, int e, int64_t r, int n,
                                      float a0, float a1) {
  const int64_t b = static_cast<int64_t>(e) * p.N + n;
  if (p.bias0 != nullptr) a0 += to_float(p.bias0[b]);
  if constexpr (kGateUp) {
    if (p.bias1 != nullptr) a1 += to_float(p.bias1[b]);
    a0 = activation(a0, a1, p.swiglu, p.alpha, p.limit);
  }
  p.out[r * p.N + n] = a0;
}

template <typename In, typename T>
__device__ __forceinline__ const In* input_row(const Products<In, T>& p, int64_t r) {
  return p.x + (p.token != nullptr ? static_cast<int64_t>(p.token[r]) : r) * p.x_ld;
}

// GEMV: one warp per output column, kGemvWarps columns per block, a tile of up to
// kGemvRows rows (blockIdx.y). K in steps of 32 units: the rows' values are staged in
// shared memory, then lane l decodes unit l of the column's weight row(s) and
// multiply-adds its 32 values into every row's sum.
constexpr int kGemvWarps = 8;
constexpr int kStepUnits = kWarpSize;
constexpr int kUnitStride = kUnit + 1;  // lanes read units apart: distinct banks

template <typename Rows, bool kGateUp, typename In, typename T>
__global__ void __launch_bounds__(kGemvWarps * kWarpSize)
    gemv_kernel(const Products<In, T> p) {
  __shared__ float xs[kGemvRows * kStepUnits * kUnitStride];
  const int tile = blockIdx.y;
  if (tile >= *p.tiles.count) return;  // the whole block: no barrier is skipped
  const int e = p.tiles.expert[tile], R = p.tiles.rows[tile];
  const int64_t r0 = p.tiles.row0[tile];
  const int lane = threadIdx.x % kWarpSize;
  const int n = blockIdx.x * kGemvWarps + threadIdx.x / kWarpSize;
  const bool active = n < p.N;
  const int64_t w_row = static_cast<int64_t>(e) * p.expert_bytes +
                        static_cast<int64_t>(active ? n : 0) * p.row_bytes;
  float acc0[kGemvRows] = {}, acc1[kGemvRows] = {};
  const int units = (p.K + kUnit - 1) / kUnit;
  for (int u0 = 0; u0 < units; u0 += kStepUnits) {
    __syncthreads();  // the previous step's values are read
    for (int i = threadIdx.x; i < R * kStepUnits * kUnit; i += blockDim.x) {
      const int m = i / (kStepUnits * kUnit), k = u0 * kUnit + i % (kStepUnits * kUnit);
      xs[(m * kStepUnits + (k / kUnit - u0)) * kUnitStride + k % kUnit] =
          k < p.K ? to_float(input_row(p, r0 + m)[k]) : 0.f;
    }
    __syncthreads();
    if (!active || u0 + lane >= units) continue;
    float w[kUnit], v[kUnit];
    Rows::unit(p.w0 + w_row, u0 + lane, p.K, w);
    if constexpr (kGateUp) Rows::unit(p.w1 + w_row, u0 + lane, p.K, v);
#pragma unroll
    for (int m = 0; m < kGemvRows; ++m) {
      if (m >= R) break;
      const float* x = xs + (m * kStepUnits + lane) * kUnitStride;
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int j = 0; j < kUnit; ++j) {
        s0 += w[j] * x[j];
        if constexpr (kGateUp) s1 += v[j] * x[j];
      }
      acc0[m] += s0;
      acc1[m] += s1;
    }
  }
#pragma unroll
  for (int m = 0; m < kGemvRows; ++m) {
    acc0[m] = warp_sum(acc0[m]);
    if constexpr (kGateUp) acc1[m] = warp_sum(acc1[m]);
  }
  if (!active || lane != 0) return;
#pragma unroll
  for (int m = 0; m < kGemvRows; ++m) {
    if (m < R) store<kGateUp>(p, e, r0 + m, n, acc0[m], acc1[m]);
  }
}

// Tiled GEMM: a kBM x kBN tile of outputs per block (blockIdx.y: the row tile), 256
// threads of 4 x 4 sums each (per weight). Per step of kBK values: the rows' values
// and the weight's dequantized values (one unit of 32 per thread) into shared
// memory, K-major so that each thread reads 4 consecutive rows and 4 consecutive
// columns.
constexpr int kGemmThreads = 256;
constexpr int kPad = 4;

template <typename Rows, bool kGateUp, typename In, typename T>
__global__ void __launch_bounds__(kGemmThreads) gemm_kernel(const Products<In, T> p) {
  constexpr int kWeights = kGateUp ? 2 : 1;
  __shared__ float xs[kBK][kBM + kPad];
  __shared__ float ws[kWeights][kBK][kBN + kPad];
  const int tile = blockIdx.y;
  if (tile >= *p.tiles.count) return;
  const int e = p.tiles.expert[tile], R = p.tiles.rows[tile];
  const int64_t r0 = p.tiles.row0[tile];
  const int n0 = blockIdx.x * kBN;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[kWeights][4][4] = {};
  constexpr int kUnitsPerStep = kBK / kUnit;
  for (int k0 = 0; k0 < p.K; k0 += kBK) {
    for (int i = threadIdx.x; i < kBM * kBK; i += kGemmThreads) {
      const int m = i / kBK, k = k0 + i % kBK;
      xs[i % kBK][m] = m < R && k < p.K ? to_float(input_row(p, r0 + m)[k]) : 0.f;
    }
    // Thread t decodes unit t % kUnitsPerStep of column t / kUnitsPerStep of weight
    // t / (kBN * kUnitsPerStep).
    if (threadIdx.x < kWeights * kBN * kUnitsPerStep) {
      const int which = threadIdx.x / (kBN * kUnitsPerStep);
      const int c = threadIdx.x / kUnitsPerStep % kBN, j = threadIdx.x % kUnitsPerStep;
      const int u = k0 / kUnit + j;
      float w[kUnit];
      if (n0 + c < p.N && u * kUnit < p.K) {
        const uint8_t* base = which == 0 ? p.w0 : p.w1;
        Rows::unit(base + static_cast<int64_t>(e) * p.expert_bytes +
                       static_cast<int64_t>(n0 + c) * p.row_bytes,
                   u, p.K, w);
      } else {
#pragma unroll
        for (int l = 0; l < kUnit; ++l) w[l] = 0.f;
      }
#pragma unroll
      for (int l = 0; l < kUnit; ++l) ws[which][j * kUnit + l][c] = w[l];
    }
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < kBK; ++k) {
      float a[4], b[kWeights][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = xs[k][ty * 4 + i];
#pragma unroll
      for (int q = 0; q < kWeights; ++q) {
#pragma unroll
        for (int j = 0; j < 4; ++j) b[q][j] = ws[q][k][tx * 4 + j];
      }
#pragma unroll
      for (int q = 0; q < kWeights; ++q) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[q][i][j] += a[i] * b[q][j];
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = ty * 4 + i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + tx * 4 + j;
      if (m < R && n < p.N) {
        store<kGateUp>(p, e, r0 + m, n, acc[0][i][j], acc[kWeights - 1][i][j]);
      }
    }
  }
}

// Launches both product kernels over their tiles (grids sized for the most tiles
// the routing can make; blocks past the count leave at once).
template <typename Rows, bool kGateUp, typename In, typename T>
void launch_products(const Products<In, T>& gemv, const Products<In, T>& gemm, int max_gemv,
                     int max_gemm, cudaStream_t stream) {
  if (max_gemv > 0) {
    gemv_kernel<Rows, kGateUp><<<dim3(ceil_div(gemv.N, kGemvWarps), max_gemv),
                                 kGemvWarps * kWarpSize, 0, stream>>>(gemv);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (max_gemm > 0) {
    gemm_kernel<Rows, kGateUp><<<dim3(ceil_div(gemm.N, kBN), max_gemm), kGemmThreads, 0,
                                 stream>>>(gemm);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// ---------------------------------------------------------------------------
// Combine: out[t] = sum over t's choices j, in order, of weight * its row of y.

template <typename T>
__global__ void combine_kernel(T* __restrict__ out, const float* __restrict__ y,
                               const float* __restrict__ weights,
                               const int32_t* __restrict__ row_of_pair, int k, int H) {
  const int64_t t = blockIdx.x;
  for (int h = threadIdx.x; h < H; h += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < k; ++j) {
      const int64_t r = row_of_pair[t * k + j];
      if (r >= 0) acc += weights[t * k + j] * y[r * H + h];
    }
    out[t * H + h] = from_float<T>(acc);
  }
}

// ---------------------------------------------------------------------------
// Host side.

// The tile lists' storage: [3 * max] int32 each and the two counts.
struct TileBuffers {
  at::Tensor storage;
  Tiles gemv, gemm;
  int max_gemv, max_gemm;
};

TileBuffers tile_buffers(int64_t P, int64_t E, const at::TensorOptions& options) {
  // GEMV tiles: at most two per expert with few rows, and never more than rows.
  // GEMM tiles: experts with more than kGemvMaxRows rows, each ceil(rows / kBM).
  const int64_t max_gemv = std::min(P, 2 * E);
  const int64_t max_gemm = std::min(E, P / (kGemvMaxRows + 1)) + P / kBM;
  TORCH_CHECK(max_gemv <= 65535 && max_gemm <= 65535, "fused_moe: too many (token, expert) "
              "pairs for one call (", P, ")");
  TileBuffers b;
  b.storage = at::empty({3 * (max_gemv + max_gemm) + 2}, options.dtype(at::kInt));
  int32_t* s = b.storage.data_ptr<int32_t>();
  b.gemv = {s, s + max_gemv, s + 2 * max_gemv, s + 3 * (max_gemv + max_gemm)};
  s += 3 * max_gemv;
  b.gemm = {s, s + max_gemm, s + 2 * max_gemm, b.gemv.count + 1};
  b.max_gemv = static_cast<int>(max_gemv);
  b.max_gemm = static_cast<int>(max_gemm);
  return b;
}

template <typename In, typename T>
Products<In, T> products(const at::Tensor& w0, const at::Tensor* w1,
                         const std::optional<at::Tensor>& bias0,
                         const std::optional<at::Tensor>* bias1, const In* x, int64_t x_ld,
                         const int32_t* token, float* out, int64_t K, const MoeShape& s,
                         double alpha, double limit) {
  Products<In, T> p{};
  p.w0 = static_cast<const uint8_t*>(w0.const_data_ptr());
  p.w1 = w1 != nullptr ? static_cast<const uint8_t*>(w1->const_data_ptr()) : nullptr;
  p.row_bytes = w0.size(2) * w0.element_size();
  p.expert_bytes = w0.size(1) * p.row_bytes;
  p.bias0 = bias0.has_value() ? static_cast<const T*>(bias0->const_data_ptr()) : nullptr;
  p.bias1 = bias1 != nullptr && bias1->has_value()
                ? static_cast<const T*>((*bias1)->const_data_ptr())
                : nullptr;
  p.x = x;
  p.x_ld = x_ld;
  p.token = token;
  p.out = out;
  p.N = static_cast<int>(w0.size(1));
  p.K = static_cast<int>(K);
  p.swiglu = s.activation == MoeActivation::kSwigluOai;
  p.alpha = static_cast<float>(alpha);
  p.limit = static_cast<float>(limit);
  return p;
}

}  // namespace

void moe_topk(at::Tensor& topk_weights, at::Tensor& topk_ids, const at::Tensor& router_logits,
              bool renormalize) {
  check_moe_topk(topk_weights, topk_ids, router_logits);
  check_cuda(router_logits, "router_logits");
  if (router_logits.size(0) == 0) return;
  const c10::cuda::CUDAGuard device_guard(router_logits.device());
  route(topk_weights.data_ptr<float>(), topk_ids.data_ptr<int32_t>(), router_logits,
        topk_weights.size(1), renormalize, c10::cuda::getCurrentCUDAStream());
}

void fused_moe(at::Tensor& out, const at::Tensor& hidden, const at::Tensor& router_logits,
               int64_t top_k, bool renormalize, const at::Tensor& w_gate, const at::Tensor& w_up,
               const at::Tensor& w_down, int64_t gate_type, int64_t up_type, int64_t down_type,
               const std::optional<at::Tensor>& gate_bias,
               const std::optional<at::Tensor>& up_bias,
               const std::optional<at::Tensor>& down_bias, const std::string& activation,
               double alpha, double limit, int64_t expert_start, int64_t many_rows) {
  // many_rows is checked and not used: each expert's path here is its row count's.
  const MoeShape s = check_fused_moe(out, hidden, router_logits, top_k, w_gate, w_up, w_down,
                                     gate_type, up_type, down_type, gate_bias, up_bias,
                                     down_bias, activation, alpha, limit, expert_start,
                                     many_rows);
  check_cuda(hidden, "hidden");
  TORCH_CHECK_VALUE(up_type == gate_type, "up_type (", up_type, ") must equal gate_type (",
                    gate_type, ") on CUDA");
  TORCH_CHECK_VALUE(s.hidden <= INT_MAX && s.inter <= INT_MAX, "fused_moe: hidden_size and "
                    "intermediate_size must fit in int32");
  const int64_t tokens = s.tokens, P = tokens * top_k, H = s.hidden, I = s.inter;
  if (tokens == 0 || H == 0) return;
  const c10::cuda::CUDAGuard device_guard(hidden.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto options = hidden.options();

  at::Tensor weights = at::empty({tokens, top_k}, options.dtype(at::kFloat));
  at::Tensor ids = at::empty({tokens, top_k}, options.dtype(at::kInt));
  route(weights.data_ptr<float>(), ids.data_ptr<int32_t>(), router_logits, top_k, renormalize,
        stream);

  // The grouped row of each pair, then the token of each row.
  at::Tensor rows = at::empty({2 * P}, options.dtype(at::kInt));
  int32_t* row_of_pair = rows.data_ptr<int32_t>();
  int32_t* token_of_row = row_of_pair + P;
  TileBuffers tiles = tile_buffers(P, s.experts, options);
  const size_t group_smem = 3 * static_cast<size_t>(s.experts) * sizeof(int32_t);
  TORCH_CHECK(group_smem <= 48 * 1024, "fused_moe: too many experts (", s.experts, ")");
  group_kernel<<<1, kGroupThreads, group_smem, stream>>>(
      ids.data_ptr<int32_t>(), static_cast<int>(P), static_cast<int>(top_k),
      static_cast<int>(s.experts), static_cast<int>(expert_start), row_of_pair, token_of_row,
      tiles.gemv, tiles.gemm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  at::Tensor act = at::empty({P, I}, options.dtype(at::kFloat));
  at::Tensor y = at::empty({P, H}, options.dtype(at::kFloat));
  PYLLM_DISPATCH_FLOATING_TYPES(hidden.scalar_type(), "fused_moe", [&] {
    using T = device_t<scalar_t>;
    auto gate_up = products<T, T>(w_gate, &w_up, gate_bias, &up_bias,
                                  device_ptr<scalar_t>(hidden), hidden.stride(0), token_of_row,
                                  act.data_ptr<float>(), H, s, alpha, limit);
    auto down = products<float, T>(w_down, nullptr, down_bias, nullptr, act.data_ptr<float>(),
                                   I, nullptr, y.data_ptr<float>(), I, s, alpha, limit);
    auto gemv_gate_up = gate_up;
    auto gemv_down = down;
    gemv_gate_up.tiles = gemv_down.tiles = tiles.gemv;
    gate_up.tiles = down.tiles = tiles.gemm;
    if (I > 0) {
      dispatch_rows<scalar_t>(gate_type, [&](auto rows_of) {
        launch_products<decltype(rows_of), true>(gemv_gate_up, gate_up, tiles.max_gemv,
                                                 tiles.max_gemm, stream);
      });
    }
    dispatch_rows<scalar_t>(down_type, [&](auto rows_of) {
      launch_products<decltype(rows_of), false>(gemv_down, down, tiles.max_gemv, tiles.max_gemm,
                                                stream);
    });
    combine_kernel<T><<<static_cast<unsigned int>(tokens), 256, 0, stream>>>(
        device_ptr<scalar_t>(out), y.data_ptr<float>(), weights.data_ptr<float>(), row_of_pair,
        static_cast<int>(top_k), static_cast<int>(H));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace pyllm::cuda
