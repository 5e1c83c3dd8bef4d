// CPU kernels of the small per-row layers: RMS norm (plain and fused with the
// residual add), the SiLU-gated product of the MLP, and the linear layer for a
// few rows (small_batch_linear, at the end).
//
// The norms stream each row through small float buffers: bf16/fp16 values are
// widened once on load and rounded once on store, and everything in between is
// float32 loops the compiler vectorizes. silu_and_mul and gelu_tanh_and_mul work in
// vec::Vec16 (their exp and division did not vectorize well enough). Rows are split
// across threads.
//
// Inputs are [..., width] with packed rows; dim 0 may be strided (a row view of a
// wider tensor, e.g. the gate/up projection), outputs are contiguous.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "../cpu/float_rows.h"
#include "../cpu/packed_tile.h"
#include "../cpu/vec.h"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "layers_checks.h"

namespace pyllm::cpu {
namespace {

// Elements per thread below which a second thread costs more than it saves.
constexpr int64_t kGrainElements = 1 << 14;
// Floats per staging buffer: a row is processed in pieces of this size.
constexpr int64_t kChunk = 256;

// e^x in a form the compiler vectorizes (std::exp is a scalar libm call unless
// built with -ffast-math). x = n ln2 + r with |r| <= ln2 / 2, e^r from its
// degree-6 Taylor polynomial (relative error below 2e-7), 2^n built in the
// exponent bits. The clamp keeps 2^n a normal float (e^-87 and e^88 are far
// enough out for silu, the only user); NaN passes through. Written with
// ternaries and a rounding constant because std::clamp and std::floor keep
// gcc 12 from vectorizing the loop.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  // Adding then subtracting 1.5 * 2^23 rounds to the nearest integer.
  constexpr float kRound = 12582912.0f;
  const float n = (x * 1.44269504f + kRound) - kRound;
  // ln 2 split in a part exact to 16 bits and the rest, so n * ln2_hi is exact.
  const float r = (x - n * 0.693145751953125f) - n * 1.428606820309417e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const auto exponent = static_cast<uint32_t>(static_cast<int32_t>(n) + 127);
  return p * std::bit_cast<float>(exponent << 23);
}

// ---------------------------------------------------------------------------
// Row addressing of a [..., width] tensor whose dim 0 may be strided.

struct Rows {
  int64_t count;           // number of rows: numel / width
  int64_t width;           // elements per row (the last dim)
  int64_t rows_per_outer;  // rows per index of dim 0
  int64_t outer_stride;    // stride of dim 0

  int64_t offset(int64_t row) const {
    return (row / rows_per_outer) * outer_stride + (row % rows_per_outer) * width;
  }
};

// The rows of a tensor whose dims but the first are packed (check_packed_rows).
Rows packed_rows(const at::Tensor& t) {
  const int64_t width = t.size(-1);
  const int64_t count = width == 0 ? 0 : t.numel() / width;
  int64_t inner = 1;
  for (int64_t d = 1; d < t.dim(); ++d) inner *= t.size(d);
  const int64_t rows_per_outer =
      t.dim() == 1 || width == 0 ? 1 : std::max<int64_t>(1, inner / width);
  return {count, width, rows_per_outer, t.dim() == 1 ? 0 : t.stride(0)};
}

int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, width));
}

// ---------------------------------------------------------------------------
// Row kernels.

template <typename scalar_t>
float sum_of_squares(const scalar_t* x, int64_t width) {
  alignas(64) float buf[kChunk];
  float sum = 0.0f;
  for (int64_t c = 0; c < width; c += kChunk) {
    const int64_t n = std::min(kChunk, width - c);
    load_floats(x + c, buf, n);
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += buf[i] * buf[i];
  }
  return sum;
}

// y = x * inv_rms * weight, one rounding at the end.
template <typename scalar_t>
void scale_row(const scalar_t* x, const scalar_t* weight, float inv_rms, scalar_t* y,
               int64_t width) {
  alignas(64) float buf[kChunk], w[kChunk];
  for (int64_t c = 0; c < width; c += kChunk) {
    const int64_t n = std::min(kChunk, width - c);
    load_floats(x + c, buf, n);
    load_floats(weight + c, w, n);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) buf[i] = buf[i] * inv_rms * w[i];
    store_floats(buf, y + c, n);
  }
}

template <typename scalar_t>
void rms_norm_rows(scalar_t* out, const scalar_t* input, const Rows& rows, const scalar_t* weight,
                   float eps) {
  at::parallel_for(0, rows.count, row_grain(rows.width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* x = input + rows.offset(r);
      const float inv_rms = 1.0f / std::sqrt(sum_of_squares(x, rows.width) / rows.width + eps);
      scale_row(x, weight, inv_rms, out + r * rows.width, rows.width);
    }
  });
}

// residual += input (rounded to the dtype, as the next layer reads it), then
// input = rms_norm(residual) * weight: the norm sees exactly the stored sum.
template <typename scalar_t>
void fused_add_rms_norm_rows(scalar_t* input, scalar_t* residual, int64_t count, int64_t width,
                             const scalar_t* weight, float eps) {
  at::parallel_for(0, count, row_grain(width), [&](int64_t begin, int64_t end) {
    alignas(64) float sum_buf[kChunk], x_buf[kChunk];
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* x = input + r * width;
      scalar_t* res = residual + r * width;
      float sum_sq = 0.0f;
      for (int64_t c = 0; c < width; c += kChunk) {
        const int64_t n = std::min(kChunk, width - c);
        load_floats(x + c, x_buf, n);
        load_floats(res + c, sum_buf, n);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) sum_buf[i] += x_buf[i];
        store_floats(sum_buf, res + c, n);
        if constexpr (!std::is_same_v<scalar_t, float>) {
          load_floats(res + c, sum_buf, n);  // the rounded sum, as stored
        }
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < n; ++i) sum_sq += sum_buf[i] * sum_buf[i];
      }
      const float inv_rms = 1.0f / std::sqrt(sum_sq / width + eps);
      scale_row(res, weight, inv_rms, x, width);
    }
  });
}

// Both gated activations are g * sigmoid(a(g)): SiLU's a(g) = g, and the tanh form of
// GELU, 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3), is g * sigmoid(2u)
// since 0.5 (1 + tanh(u)) = 1 / (1 + e^-2u).
enum class GatedAct { kSilu, kGeluTanh };

constexpr float kGeluLinear = 1.5957691216057308f;  // 2 sqrt(2 / pi)
constexpr float kGeluCubic = 0.0713548162726009f;   // 2 sqrt(2 / pi) 0.044715

// y[i] = g / (1 + e^-a(g)) * up[i] with g = gate[i], 16 lanes at a time (vec::Vec16:
// widen on load, vector exp and reciprocal, round on store), the last partial vector
// in scalar code with the same formula.
template <GatedAct kAct, typename scalar_t>
void act_and_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* y, int64_t d) {
  using vec::Vec16;
  const Vec16 one = Vec16::set1(1.0f);
  int64_t i = 0;
  for (; i + vec::kLanes <= d; i += vec::kLanes) {
    const Vec16 g = Vec16::load(gate + i);
    Vec16 a = g;
    if constexpr (kAct == GatedAct::kGeluTanh) {
      a = g * (Vec16::set1(kGeluLinear) + Vec16::set1(kGeluCubic) * g * g);
    }
    const Vec16 e = (Vec16::zero() - a).exp();
    (g * (one + e).reciprocal() * Vec16::load(up + i)).store(y + i);
  }
  for (; i < d; ++i) {
    const float g = static_cast<float>(gate[i]);
    const float a = kAct == GatedAct::kGeluTanh ? g * (kGeluLinear + kGeluCubic * g * g) : g;
    y[i] = static_cast<scalar_t>(g / (1.0f + exp_approx(-a)) * static_cast<float>(up[i]));
  }
}

// out = act(gate) * up, with input row = [gate (d) | up (d)].
template <GatedAct kAct, typename scalar_t>
void act_and_mul_rows(scalar_t* out, const scalar_t* input, const Rows& rows) {
  const int64_t d = rows.width / 2;
  at::parallel_for(0, rows.count, row_grain(rows.width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* in = input + rows.offset(r);
      act_and_mul_row<kAct>(in, in + d, out + r * d, d);
    }
  });
}

template <GatedAct kAct>
void act_and_mul(at::Tensor& out, const at::Tensor& input) {
  check_act_and_mul(out, input);
  const Rows rows = packed_rows(input);
  PYLLM_DISPATCH_FLOATING_TYPES(input.scalar_type(), "act_and_mul", [&] {
    act_and_mul_rows<kAct>(out.data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(), rows);
  });
}

// ---------------------------------------------------------------------------
// small_batch_linear: out[M, N] = input[M, K] . weight[N, K]^T (+ bias), M <= 4.
//
// With so few rows the product is a stream over the weight, bound by memory
// bandwidth (a decode step at batch 1 reads every weight once). Each weight row
// is read once and meets all M input rows (which stay in L1). Each thread takes
// one contiguous range of rows and reads it front to back, one row at a time: a
// single sequential stream, which the hardware prefetcher follows best (reading
// 4 rows side by side halved the stream: 15.5 vs 28 GB/s in bf16, 22 vs 39 GB/s
// in float32, 2 threads, a 49152 x 576 weight). Within a row, U independent accumulators per input row hide the
// multiply-add latency. A general GEMM library pays a fixed cost per call (tens
// of microseconds here) that this path does not, and streams the weight more
// slowly at M = 1 (measured on SmolLM2's 30 layers, float32, AVX2: 23.6 GB/s vs
// oneDNN's packed 18.4 GB/s).

// Accumulators per input row: M * U of them plus a weight and an input vector
// must fit in the registers; at most 4.
constexpr int accumulators_per_row(int m) {
  return std::clamp(vec::kRegisterVecs / (2 * m), 1, 4);
}

// One multiply-add step of small_batch_rows: acc gains w[0, kStep) . x[0, kStep)
// spread over its lanes. Where vec::WordOps has the dtype, 16 words as stored:
// float32, and bfloat16 pairs by vdpbf16ps on CPUs with AVX512-BF16 (exact
// products, float32 sums, no widening; on SmolLM2's 30 layers at batch 1,
// widening streamed the weights at 15.5 GB/s, slower than oneDNN's packed bf16
// at 17.6). Otherwise 16 elements widened to float32.
template <typename scalar_t, bool kWords = vec::WordOps<scalar_t>::kVectorized>
struct DotStep : vec::WordOps<scalar_t> {
  static constexpr int64_t kStep = vec::kLanes * vec::WordOps<scalar_t>::kElems;
};
template <typename scalar_t>
struct DotStep<scalar_t, false> {
  using Operand = vec::Vec16;
  static constexpr int64_t kStep = vec::kLanes;
  static Operand load(const scalar_t* p) { return vec::Vec16::load(p); }
  static vec::Vec16 mac(vec::Vec16 acc, Operand w, Operand x) {
    return vec::Vec16::fmadd(w, x, acc);
  }
};

// Output rows [n0, n1) of all M rows.
template <int M, typename scalar_t>
void small_batch_rows(const scalar_t* x, int64_t x_stride, const scalar_t* weight, int64_t K,
                      const scalar_t* bias, scalar_t* out, int64_t N, int64_t n0, int64_t n1) {
  using vec::Vec16;
  using Step = DotStep<scalar_t>;
  constexpr int U = accumulators_per_row(M);
  constexpr int64_t kUnrolled = U * Step::kStep;
  const int64_t k_unrolled = K / kUnrolled * kUnrolled;
  const int64_t k_vec = K / Step::kStep * Step::kStep;
  for (int64_t n = n0; n < n1; ++n) {
    const scalar_t* w = weight + n * K;
    Vec16 acc[M][U];
    for (auto& row : acc) {
      for (auto& a : row) a = Vec16::zero();
    }
    int64_t k = 0;
    for (; k < k_unrolled; k += kUnrolled) {
      for (int u = 0; u < U; ++u) {
        const auto wv = Step::load(w + k + u * Step::kStep);
        for (int m = 0; m < M; ++m) {
          const auto xv = Step::load(x + m * x_stride + k + u * Step::kStep);
          acc[m][u] = Step::mac(acc[m][u], wv, xv);
        }
      }
    }
    for (; k < k_vec; k += Step::kStep) {
      const auto wv = Step::load(w + k);
      for (int m = 0; m < M; ++m) acc[m][0] = Step::mac(acc[m][0], wv, Step::load(x + m * x_stride + k));
    }
    for (int m = 0; m < M; ++m) {
      Vec16 total = acc[m][0];
      for (int u = 1; u < U; ++u) total = total + acc[m][u];
      float sum = total.reduce_add();
      const scalar_t* xm = x + m * x_stride;
      for (int64_t j = k_vec; j < K; ++j) sum += static_cast<float>(w[j]) * static_cast<float>(xm[j]);
      if (bias != nullptr) sum += static_cast<float>(bias[n]);
      out[m * N + n] = static_cast<scalar_t>(sum);
    }
  }
}

template <typename scalar_t>
void small_batch_linear_rows(scalar_t* out, const scalar_t* x, int64_t x_stride, int64_t M,
                             const scalar_t* weight, int64_t N, int64_t K,
                             const scalar_t* bias) {
  // One contiguous range of rows per thread; a small weight stays on this thread
  // (waking another costs more than reading it).
  const int64_t threads = N * K < 4 * kGrainElements ? 1 : at::get_num_threads();
  const int64_t grain = std::max<int64_t>(1, (N + threads - 1) / threads);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1:
        small_batch_rows<1>(x, x_stride, weight, K, bias, out, N, n0, n1);
        break;
      case 2:
        small_batch_rows<2>(x, x_stride, weight, K, bias, out, N, n0, n1);
        break;
      case 3:
        small_batch_rows<3>(x, x_stride, weight, K, bias, out, N, n0, n1);
        break;
      default:
        small_batch_rows<4>(x, x_stride, weight, K, bias, out, N, n0, n1);
        break;
    }
  });
}

// ---------------------------------------------------------------------------
// packed_linear: out[M, N] = input[M, K] . W^T (+ bias), W word-packed as
// [N/16, K/E, 16, E] (E elements per 32-bit word: 1 float, 2 bf16 or f16): the
// words of 16 consecutive output columns at one step of K are one 64-byte
// vector, and a block of 16 columns is K/E such vectors in a row.
//
// The micro-kernel is a GEMM's: a tile of MB input rows x NB column blocks keeps
// MB * NB accumulators (16 columns each) in registers; per word of K it loads NB
// weight vectors, broadcasts each row's input word, and multiply-adds (an FMA,
// or vdpbf16ps on a bf16 pair). No horizontal sums, no repacking at run time.
// Each thread takes one contiguous range of column blocks and streams its part
// of the weight front to back once; for more than MB rows the NB blocks' panel
// (NB * K * 16 elements, tens of KB) is reused from L2 by every row tile.
// Where the build has no such kernel for the dtype (bf16 without AVX512-BF16, f16,
// CPUs without AVX-512) a plain loop computes the same sums, for correctness only.

// Rows [0, M) x column blocks [b0, b1), MB rows at a time. With several row
// tiles per panel of column blocks, the first reads the panel from memory and the
// others from L2, so the stream from memory would come in bursts; instead the
// tiles of one panel prefetch the next panel between them.
template <typename T, int MB>
void packed_row_tiles(const T* x, int64_t x_stride, int64_t rows, const T* w, int64_t K,
                      const T* bias, T* out, int64_t N, int64_t b0, int64_t b1) {
  constexpr int NB = tile_blocks(MB);
  const int64_t block = K * vec::kLanes;
  const int64_t row_tiles = rows / MB;
  auto tiles = [&](auto nb_tag, int64_t j) {
    constexpr int kNB = decltype(nb_tag)::value;
    const T* bj = bias ? bias + j * vec::kLanes : nullptr;
    const int64_t next_blocks =
        row_tiles > 1 ? std::clamp<int64_t>(b1 - j - kNB, 0, NB) : 0;  // none after b1
    const int64_t next_lines = next_blocks * block * int64_t(sizeof(T)) / 64;
    const char* next = reinterpret_cast<const char*>(w + (j + kNB) * block);
    for (int64_t t = 0; t < row_tiles; ++t) {
      const int64_t first = next_lines * t / row_tiles, last = next_lines * (t + 1) / row_tiles;
      packed_tile<T, MB, kNB>(x + t * MB * x_stride, x_stride, w + j * block, K, bj,
                              out + t * MB * N + j * vec::kLanes, N, next + first * 64,
                              last - first);
    }
  };
  int64_t j = b0;
  for (; j + NB <= b1; j += NB) tiles(std::integral_constant<int, NB>{}, j);
  for (; j < b1; ++j) tiles(std::integral_constant<int, 1>{}, j);
}

// rows (1 to kTileRows) x column blocks [b0, b1) as tiles of exactly that height.
template <typename T>
void packed_rows_as_one_tile(const T* x, int64_t x_stride, int64_t rows, const T* w, int64_t K,
                             const T* bias, T* out, int64_t N, int64_t b0, int64_t b1) {
  with_tile_rows(rows, [&](auto height) {
    packed_row_tiles<T, decltype(height)::value>(x, x_stride, rows, w, K, bias, out, N, b0, b1);
  });
}

template <typename T>
void packed_linear_vectorized(const T* x, int64_t x_stride, int64_t M, const T* w, int64_t N,
                              int64_t K, const T* bias, T* out) {
  const int64_t blocks = N / vec::kLanes;
  // Few products: one thread (waking another costs more than it saves).
  const int64_t threads = M * N * K < 4 * kGrainElements ? 1 : at::get_num_threads();
  const int64_t grain = std::max<int64_t>(1, (blocks + threads - 1) / threads);
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    if (M <= kTileRows) {
      packed_rows_as_one_tile(x, x_stride, M, w, K, bias, out, N, b0, b1);
      return;
    }
    // Whole tiles of 8 rows, then the rest as one smaller tile.
    const int64_t full = M / kTileRows * kTileRows;
    packed_row_tiles<T, kTileRows>(x, x_stride, full, w, K, bias, out, N, b0, b1);
    if (M > full) {
      packed_rows_as_one_tile(x + full * x_stride, x_stride, M - full, w, K, bias,
                              out + full * N, N, b0, b1);
    }
  });
}

// The same sums in plain code: where no vector path exists for the dtype.
template <typename T>
void packed_linear_plain(const T* x, int64_t x_stride, int64_t M, const T* w, int64_t N,
                         int64_t K, const T* bias, T* out) {
  constexpr int E = 4 / sizeof(T);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      // Element k of column n: block n / 16, word k / E, lane n % 16, slot k % E.
      const T* col = w + (n / vec::kLanes) * K * vec::kLanes + (n % vec::kLanes) * E;
      for (int64_t m = 0; m < M; ++m) {
        float sum = bias ? static_cast<float>(bias[n]) : 0.0f;
        for (int64_t k = 0; k < K; ++k) {
          sum += static_cast<float>(x[m * x_stride + k]) *
                 static_cast<float>(col[(k / E) * vec::kLanes * E + k % E]);
        }
        out[m * N + n] = static_cast<T>(sum);
      }
    }
  });
}

}  // namespace

void small_batch_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  check_small_batch_linear(out, input, weight, bias);
  const int64_t M = input.size(0), K = input.size(1), N = weight.size(0);
  const auto dtype = input.scalar_type();
  if (M == 0 || N == 0) return;
  PYLLM_DISPATCH_FLOATING_TYPES(dtype, "small_batch_linear", [&] {
    small_batch_linear_rows(out.data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
                            input.stride(0), M, weight.const_data_ptr<scalar_t>(), N, K,
                            bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr);
  });
}

void packed_linear(at::Tensor& out, const at::Tensor& input, const at::Tensor& packed_weight,
                   const std::optional<at::Tensor>& bias) {
  static_assert(vec::kLanes == 16, "pack_weight_words packs 16 output columns");
  const int64_t N = check_packed_linear(out, input, packed_weight, bias);
  const int64_t M = input.size(0), K = input.size(1);
  const auto dtype = input.scalar_type();
  if (M == 0 || N == 0) return;
  PYLLM_DISPATCH_FLOATING_TYPES(dtype, "packed_linear", [&] {
    const scalar_t* x = input.const_data_ptr<scalar_t>();
    const scalar_t* w = packed_weight.const_data_ptr<scalar_t>();
    const scalar_t* b = bias.has_value() ? bias->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* o = out.data_ptr<scalar_t>();
    if constexpr (kPackedLinearVectorized<scalar_t>) {
      packed_linear_vectorized(x, input.stride(0), M, w, N, K, b, o);
    } else {
      packed_linear_plain(x, input.stride(0), M, w, N, K, b, o);
    }
  });
}

bool packed_linear_vectorized_for(at::ScalarType dtype) {
  bool vectorized = false;
  PYLLM_DISPATCH_FLOATING_TYPES(dtype, "packed_linear_vectorized_for",
                                [&] { vectorized = kPackedLinearVectorized<scalar_t>; });
  return vectorized;
}

void rms_norm(at::Tensor& out, const at::Tensor& input, const at::Tensor& weight,
              double epsilon) {
  check_rms_norm(out, input, weight, epsilon);
  const Rows rows = packed_rows(input);
  PYLLM_DISPATCH_FLOATING_TYPES(input.scalar_type(), "rms_norm", [&] {
    rms_norm_rows(out.data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(), rows,
                  weight.const_data_ptr<scalar_t>(), static_cast<float>(epsilon));
  });
}

void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
                        double epsilon) {
  check_fused_add_rms_norm(input, residual, weight, epsilon);
  const int64_t width = input.size(-1);
  const int64_t count = width == 0 ? 0 : input.numel() / width;
  PYLLM_DISPATCH_FLOATING_TYPES(input.scalar_type(), "fused_add_rms_norm", [&] {
    fused_add_rms_norm_rows(input.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), count,
                            width, weight.const_data_ptr<scalar_t>(),
                            static_cast<float>(epsilon));
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& input) {
  act_and_mul<GatedAct::kSilu>(out, input);
}

void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& input) {
  act_and_mul<GatedAct::kGeluTanh>(out, input);
}

}  // namespace pyllm::cpu
