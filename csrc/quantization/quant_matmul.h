// The quantized-weight products that quant_linear and fused_moe share (an internal
// header of quant_cpu.cpp and moe_cpu.cpp): input rows quantized to int8
// (quantize_rows) and their integer dot products with a weight's blocks over a
// strip of output columns (dot_tile, quant_dot.h), and the many-row paths over
// dequantized weights: panels for packed_linear's register tile, AMX tiles for bf16
// where the build targets them, and float32 chunks for ATen's GEMM. quant_cpu.cpp
// tells how quant_linear combines them.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../cpu/amx.h"
#include "../cpu/packed_tile.h"
#include "../ops.h"  // batch_invariant
#include "gguf_blocks.h"
#include "quant_dot.h"  // dot_rows; with PYLLM_QUANT_AVX2 also <immintrin.h>
#include "quant_strips.h"

namespace pyllm::cpu {
namespace {

using namespace pyllm::quant;

// v[0, n) of a buffer that keeps its allocation.
template <typename T>
T* scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Input rows per register tile: each decoded group of 32 weights is used this many times.
constexpr int kTileRows = 8;
// Weights per thread below which a second thread costs more than it saves.
constexpr int64_t kGrainWeights = 1 << 16;

// ---------------------------------------------------------------------------
// Input rows to QuantizedRows (quant_dot.h), one span of G values at a time.

// G is a multiple of 16 (32 or 256). Vectorized, the results equal a scalar loop's
// (the same float products, rounded to nearest even as std::nearbyint); the scalar
// loop took 1.4-1.7 ns a value, as long as an 8-row tile's products with 256 columns.
template <typename scalar_t>
void quantize_span(const scalar_t* x, int64_t G, int8_t* q, float* d, float* s, int16_t* isum) {
  using vec::Vec16;
  Vec16 amax = Vec16::zero();
  for (int64_t i = 0; i < G; i += vec::kLanes) amax = Vec16::max(Vec16::load(x + i).abs(), amax);
  const float scale = amax.reduce_max() / 127.0f;
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  const Vec16 inv_v = Vec16::set1(inv);
  for (int64_t h = 0; h < G / 16; ++h) {
    const int32_t sum = (Vec16::load(x + 16 * h) * inv_v).store_rounded_int8(q + 16 * h);
    isum[h] = static_cast<int16_t>(sum);
    s[h] = scale * float(sum);
  }
  *d = scale;
}

// Sizes r for M rows of K values in spans of G; a buffer reused across calls keeps
// its allocation.
inline void size_rows(QuantizedRows& r, int64_t M, int64_t K, int64_t G) {
  r.K = K;
  r.G = G;
  r.span_shift = G == 256 ? 3 : 0;
  r.q.resize(M * K);
  r.d.resize(M * K / G);
  r.s.resize(M * K / 16);
  r.isum.resize(M * K / 16);
}

// Span [k, k + G) of row m of r (sized by size_rows) from x[0, G).
template <typename scalar_t>
void quantize_span_of(const scalar_t* x, QuantizedRows& r, int64_t m, int64_t k) {
  const int64_t h = m * (r.K / 16) + k / 16;
  quantize_span(x, r.G, r.q.data() + m * r.K + k, r.d.data() + (m * r.K + k) / r.G,
                r.s.data() + h, r.isum.data() + h);
}

template <typename scalar_t>
void quantize_rows(const scalar_t* x, int64_t x_stride, int64_t M, int64_t K, int64_t G,
                   QuantizedRows& r) {
  size_rows(r, M, K, G);
  at::parallel_for(0, M * (K / G), std::max<int64_t>(1, 8192 / G), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t m = g / (K / G), k = (g % (K / G)) * G;
      quantize_span_of(x + m * x_stride + k, r, m, k);
    }
  });
}

template <int64_t T>
void dot_tile(int rows, const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0,
              int64_t K, float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  with_tile_rows(rows, [&](auto r) {
    dot_rows<T, decltype(r)::value>(w, row_bytes, x, m0, K, out, out_stride, n0, n1);
  });
}

// Columns [n0, n1) of strips of type T: whole strips by the strip kernels, the rows
// past the last whole strip (GGUF's layout) by dot_tile. stop: strip_rows'.
template <int64_t T>
void strip_tile(int rows, const uint8_t* w, int64_t row_bytes, int64_t N, const QuantizedRows& x,
                int64_t m0, int64_t K, float* out, int64_t out_stride, int64_t n0, int64_t n1,
                const uint8_t* stop = nullptr) {
#ifdef PYLLM_QUANT_STRIPS
  if constexpr (has_strips(T)) {
    const int64_t whole = std::min(n1, N / kStripColumns * kStripColumns);
    if (n0 < whole) {
      with_tile_rows(rows, [&](auto r) {
        strip_rows<T, decltype(r)::value>(w, row_bytes, x, m0, K, out, out_stride, n0, whole,
                                          stop);
      });
      n0 = whole;
    }
  }
#endif
  if (n0 < n1) dot_tile<T>(rows, w, row_bytes, x, m0, K, out, out_stride, n0, n1);
}

// Float32 results [M, N] for all rows. Threads take strips of columns from a shared
// counter, each running every row tile over its strip (small enough for its weight
// bytes to stay in L2 between tiles). A fixed half each left one thread waiting for
// the other at the end of every call on a virtual machine's shared cores: two
// single-threaded processes streamed 13.6 GB/s together where one call split in
// halves made 9.5.
template <int64_t T>
void quant_matmul(const uint8_t* w, int64_t N, int64_t K, const QuantizedRows& x, int64_t M,
                  float* out, int64_t out_stride, bool strips = false) {
  using F = Format<T>;
  const int64_t row_bytes = K / F::kBlock * F::kBytes;
  int64_t strip = std::clamp<int64_t>((64 << 10) / std::max<int64_t>(row_bytes, 1), 1, N);
  const int64_t threads = N * K < kGrainWeights ? 1 : at::get_num_threads();
  if (strips) {
    // Whole strips, 4 times as many bytes a fetch (longer linear streams: 2 threads,
    // TinyLlama's Q4_K_M projections, 1 row, three rounds: 19.1-22.4 ms against
    // 20.4-23.6), but at least 4 fetches a thread.
    const int64_t most = std::max<int64_t>(1, N / (4 * threads * kStripColumns));
    strip = std::clamp<int64_t>(4 * strip / kStripColumns, 1, most) * kStripColumns;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t n0 = next.fetch_add(strip); n0 < N; n0 = next.fetch_add(strip)) {
      const int64_t n1 = std::min(N, n0 + strip);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        float* o = out + m0 * out_stride;
        if (strips) {
          strip_tile<T>(rows, w, row_bytes, N, x, m0, K, o, out_stride, n0, n1);
        } else {
          dot_tile<T>(rows, w, row_bytes, x, m0, K, o, out_stride, n0, n1);
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Dequantization of whole rows (portable: it runs once per looked-up token).

template <int64_t T, typename scalar_t>
void dequantize_row(const uint8_t* row, int64_t K, scalar_t* y) {
  using F = Format<T>;
  for (int64_t b = 0; b < K / F::kBlock; ++b) {
    const uint8_t* blk = row + b * F::kBytes;
    float a[2 * F::kGroups], off[2 * F::kGroups];
    F::scales(blk, a, off);
    for (int g = 0; g < F::kGroups; ++g) {
      uint8_t u[32];
      group_quants<T>(blk, g, u);
      scalar_t* yg = y + b * F::kBlock + g * 32;
      for (int l = 0; l < 32; ++l) {
        const float q = F::kSigned ? float(int8_t(u[l])) : float(u[l]);
        yg[l] = static_cast<scalar_t>(a[2 * g + l / 16] * q + off[2 * g + l / 16]);
      }
    }
  }
}

// Float32 values of one row: vectorized where group_vector exists.
template <int64_t T>
void dequantize_row_f32(const uint8_t* row, int64_t K, float* y) {
#ifdef PYLLM_QUANT_AVX2
  using F = Format<T>;
  for (int64_t b = 0; b < K / F::kBlock; ++b) {
    const uint8_t* blk = row + b * F::kBytes;
    float a[2 * F::kGroups], off[2 * F::kGroups];
    F::scales(blk, a, off);
    for (int g = 0; g < F::kGroups; ++g) {
      const __m256i u = group_vector<T>(blk, g);
      const __m128i halves[2] = {_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)};
      float* yg = y + b * F::kBlock + g * 32;
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = _mm256_set1_ps(a[2 * g + h]), offset = _mm256_set1_ps(off[2 * g + h]);
        const __m128i lo = halves[h], hi = _mm_srli_si128(halves[h], 8);
        const __m256i q0 = F::kSigned ? _mm256_cvtepi8_epi32(lo) : _mm256_cvtepu8_epi32(lo);
        const __m256i q1 = F::kSigned ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi);
        _mm256_storeu_ps(yg + 16 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), scale, offset));
        _mm256_storeu_ps(yg + 16 * h + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), scale, offset));
      }
    }
  }
#else
  dequantize_row<T>(row, K, y);
#endif
}

// ---------------------------------------------------------------------------
// Many rows: the int8 tiles above decode each group once per 8 rows, which leaves
// the arithmetic well below the float units' peak. Where packed_linear's register
// tile runs for the input dtype (AVX-512: float32 FMA, bf16 vdpbf16ps), each thread
// instead dequantizes a panel of 16 * NB columns into its word-packed layout in a
// buffer that stays in L2, and runs the tile over all input rows: the weight is
// decoded once per call, and the products are packed_linear's.

// Input rows from which the panel path is taken: decoding a panel costs about as
// much as 16 rows of products (benchmarks/quant_linear.py, SmolLM2 Q4_1 and Q4_K:
// 16 rows 48-52 ms by panels against about 45 by int8 tiles, 64 rows 79-81 ms).
constexpr int64_t kPanelMinRows = 32;

// Where the int8 products outrun the panels, the panels are never taken: a row's
// result then depends on nothing else in the call, at any count.
//  - Weights in strips: 2 cores of a Zen 4, eight 2048x2048 weights, bf16 inputs, int8
//    tiles against panels 1.10-1.45x at 32 rows, 1.01-1.26x at 512 (Q4_0, Q4_1, Q8_0,
//    Q4_K, Q6_K, MXFP4), float32 inputs 2.3x (each weight by quant_linear in the
//    batch-invariant mode against the default, before strips left the panels);
//    TinyLlama Q4_K_M prefill 512 1.37x end to end. The GGUF rows' own int8 kernels
//    lose to the panels (Q5_0, Q5_K: 0.4-0.7x), so they keep them.
//  - The 4-bit formats whose int8 products run by octets (quant_octets_avx512.h),
//    for float32 inputs: 2880x2880 Q4_0 and MXFP4, 32-512 rows, int8 tiles 265-319
//    GFLOP/s against the float32 panels' 155-212; Q4_K 2048x2048 331-343 GFLOP/s at
//    32-64 rows by int8 tiles.
template <typename scalar_t>
int64_t panel_min_rows(int64_t type, bool strips) {
  if (batch_invariant()) return INT64_MAX;  // only the int8 products (ops.h)
  // Strips: faster by int8 products where panels could read them (ZMM builds), and
  // no panel decoder reads them elsewhere.
  if (strips) return INT64_MAX;
#if defined(PYLLM_QUANT_ZMM)
  const bool octets = is_octet_format(type) || type == kQ4_K;
  if (octets && std::is_same_v<scalar_t, float>) return INT64_MAX;
#endif
  return kPanelMinRows;
}

#if defined(PYLLM_QUANT_AVX2) && defined(__AVX512BF16__)
#define PYLLM_QUANT_BF16_ROWS 1
// One weight row as bf16, for the bf16 panels and AMX tiles (AVX512-BF16 rounds
// as Vec16's bf16 stores do).
template <int64_t T>
void dequantize_row_bf16(const uint8_t* row, int64_t K, c10::BFloat16* y) {
  using F = Format<T>;
  for (int64_t b = 0; b < K / F::kBlock; ++b) {
    const uint8_t* blk = row + b * F::kBytes;
    float a[2 * F::kGroups], off[2 * F::kGroups];
    F::scales(blk, a, off);
    for (int g = 0; g < F::kGroups; ++g) {
      const __m256i u = group_vector<T>(blk, g);
      __m512 half[2];
      for (int h = 0; h < 2; ++h) {
        const __m128i q = h ? _mm256_extracti128_si256(u, 1) : _mm256_castsi256_si128(u);
        const __m512i i = F::kSigned ? _mm512_cvtepi8_epi32(q) : _mm512_cvtepu8_epi32(q);
        half[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(a[2 * g + h]),
                                  _mm512_set1_ps(off[2 * g + h]));
      }
      _mm512_storeu_si512(y + b * F::kBlock + g * 32,
                          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(half[1], half[0])));
    }
  }
}
#endif

// Columns [n0, n0 + cols) of W into the panel's nb blocks of 16 (columns past cols
// are zeros). A block's 16 columns are dequantized as rows of words (rows: 16 * K
// floats, row_words: 16 * K elements of S), then moved into the block's layout 16 x
// 16 words at a time by an in-register transpose: a store per word was most of the
// decoding's time.
template <int64_t T, typename S>
void dequantize_panel(const uint8_t* w, int64_t row_bytes, int64_t n0, int nb, int64_t K,
                      float* rows, S* row_words, S* panel, int cols) {
  constexpr int E = vec::WordOps<S>::kElems, L = vec::kLanes;
  const int64_t words = K / E;  // per column
  const void* block_words = std::is_same_v<S, float> ? static_cast<const void*>(rows)
                                                     : static_cast<const void*>(row_words);
  const auto* src = static_cast<const uint32_t*>(block_words);  // column c at c * words
  for (int b = 0; b < nb; ++b) {
    for (int c = 0; c < L; ++c) {
      const int64_t col = n0 + b * L + c;
#ifdef PYLLM_QUANT_BF16_ROWS
      if constexpr (std::is_same_v<S, c10::BFloat16>) {  // straight to bf16, as rounded below
        if (b * L + c < cols) {
          dequantize_row_bf16<T>(w + col * row_bytes, K, row_words + c * K);
        } else {
          std::fill(row_words + c * K, row_words + (c + 1) * K, S(0.0f));
        }
        continue;
      }
#endif
      float* row = rows + c * K;
      if (b * L + c < cols) {
        dequantize_row_f32<T>(w + col * row_bytes, K, row);
      } else {
        std::fill(row, row + K, 0.0f);
      }
      if constexpr (!std::is_same_v<S, float>) {
        for (int64_t k = 0; k < K; k += L) vec::Vec16::load(row + k).store(row_words + c * K + k);
      }
    }
    // Word i of column c goes to word i, lane c of the block.
    auto* dst = reinterpret_cast<uint32_t*>(panel + b * K * L);
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + L <= words; i += L) {
      vec::Words16 r[L];
      for (int c = 0; c < L; ++c) {
        r[c] = vec::Words16::load(src + c * words + i, vec::Words16::first(L));
      }
      vec::transpose16(r);
      for (int j = 0; j < L; ++j) r[j].store(dst + (i + j) * L);
    }
#endif
    for (; i < words; ++i) {
      for (int c = 0; c < L; ++c) dst[i * L + c] = src[c * words + i];
    }
  }
}

// out (in x's dtype S, or float32) = rows [0, M) of x . the panel (+ bias).
template <typename S, int NB, typename O = S>
void panel_rows(const S* x, int64_t x_stride, int64_t M, const S* panel, int64_t K,
                const S* bias, O* out, int64_t ld) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows) {
    packed_tile<S, kTileRows, NB>(x + m * x_stride, x_stride, panel, K, bias, out + m * ld, ld,
                                  nullptr, 0);
  }
  if (m == M) return;
  with_tile_rows(M - m, [&](auto rows) {  // the last M - m < kTileRows rows
    packed_tile<S, decltype(rows)::value, NB>(x + m * x_stride, x_stride, panel, K, bias,
                                              out + m * ld, ld, nullptr, 0);
  });
}

// Whether dequantize_weight_panel reads strips: their panel decoders are AVX-512 VNNI
// builds' (quant_strips_avx512.h).
#ifdef PYLLM_QUANT_ZMM
constexpr bool kStripPanels = true;
#else
constexpr bool kStripPanels = false;
#endif

// The panel of W's columns [c0, c0 + 16 nb) (cols of them real) from GGUF rows, or
// where `strips` (a build with PYLLM_QUANT_ZMM) each block of 16 inside a whole strip
// by dequantize_strip_panel (the same values) and the rest from the rows past the
// last whole strip of W's N.
template <int64_t T, typename S>
void dequantize_weight_panel(const uint8_t* w, int64_t row_bytes, int64_t N, bool strips,
                             int64_t c0, int nb, int64_t K, float* rows, S* words, S* panel,
                             int cols) {
#ifdef PYLLM_QUANT_ZMM
  if constexpr (has_strips(T)) {
    if (strips) {
      const int64_t whole = N / kStripColumns * kStripColumns;
      for (int b = 0; b < nb; ++b) {
        const int64_t c = c0 + b * vec::kLanes;
        S* block = panel + b * K * vec::kLanes;
        if (c + vec::kLanes <= whole) {
          dequantize_strip_panel<T>(w + c * row_bytes, K, block);
        } else {
          dequantize_panel<T>(w, row_bytes, c, 1, K, rows, words, block, cols - b * vec::kLanes);
        }
      }
      return;
    }
  }
#endif
  dequantize_panel<T>(w, row_bytes, c0, nb, K, rows, words, panel, cols);
}

// Columns [0, N / 16 * 16) of out = x . W^T (+ bias), in x's dtype S; W in GGUF rows
// (strips never take the panels: panel_min_rows).
template <int64_t T, typename S>
void panel_matmul(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const S* x,
                  int64_t x_stride, int64_t M, const S* bias, S* out, int64_t ld) {
  constexpr int NB = tile_blocks(kTileRows);
  const int64_t panels = (N / vec::kLanes + NB - 1) / NB;
  // Panels from a shared counter, as quant_matmul's strips.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(panels, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    std::vector<float> row(vec::kLanes * K);
    std::vector<S> row_words(vec::kLanes * K), panel(NB * vec::kLanes * K);
    for (int64_t p = next++; p < panels; p = next++) {
      const int64_t n0 = p * NB * vec::kLanes;
      const int nb = static_cast<int>(std::min<int64_t>(NB, N / vec::kLanes - p * NB));
      dequantize_panel<T>(w, row_bytes, n0, nb, K, row.data(), row_words.data(), panel.data(),
                          nb * vec::kLanes);
      const S* b = bias ? bias + n0 : nullptr;
      if (nb == NB) {
        panel_rows<S, NB>(x, x_stride, M, panel.data(), K, b, out + n0, ld);
      } else if (nb == 2) {
        panel_rows<S, 2>(x, x_stride, M, panel.data(), K, b, out + n0, ld);
      } else {
        panel_rows<S, 1>(x, x_stride, M, panel.data(), K, b, out + n0, ld);
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Many rows on CPUs with AMX (a build whose -march names one): the tile unit
// multiplies bf16 at several times the vector units' rate. Its B operand holds pairs
// of K for 16 columns per 64-byte row: the word-packed layout of packed_linear's
// panels, so a panel of 32 weight columns is dequantized as for panel_matmul (from
// strips straight, a strip per 16 columns) into a buffer that stays in L1/L2, and
// is B; the inputs, laid out once per call as 16 x 32 tiles (input_tiles), are A;
// each 16 x 16 float32 tile of sums is a tile of out. For bf16 inputs only: rounding
// float32 inputs and weights to bf16 moved SmolLM2's float32 logits visibly
// (correlation with the widened model's down to 0.9975 against >= 0.999 for the
// float32 panels), so float32 keeps float products.
#ifdef PYLLM_AMX
#define PYLLM_QUANT_AMX 1

// Input rows from which the tile unit takes over from the int8 tiles: decoding a
// panel costs about as much as 16-48 rows of int8 products over GGUF rows, more over
// strips, whose int8 kernels are faster (2 cores of a Xeon with AMX, bf16, TinyLlama
// Q4_K_M / Q8_0 / Q5_K_M and SmolLM2 Q4_1 strips, tiles against int8 products: 16
// rows 0.58-0.80x, 32 rows 0.87-1.02x, 48 rows 0.79-1.06x, Q4_K 64 rows 1.40x).
// INT64_MAX: never (strips where no panel decoder reads them).
inline int64_t amx_min_rows(bool strips) {
  if (strips) return kStripPanels ? 64 : INT64_MAX;
  return 16;
}

// Rows [0, M) of x in bf16, as A tiles: 16 rows x 32 values a tile, 1 KiB each, those
// of rows [16g, 16g + 16) at g * K / 32 tiles (rows of K apart lay the 16 rows a tile
// reads on the same L1 set when K * 2 is a multiple of 4 KiB); rows past M are zero,
// up to a multiple of 32. In a buffer of the calling thread that keeps its memory up
// to kKeepTileBytes: a new one per call was zeroed whole and faulted in, 11% of a
// 512 x 576 x 3072 call's time.
constexpr size_t kKeepTileBytes = size_t{16} << 20;

template <typename S>
const c10::BFloat16* input_tiles(const S* x, int64_t x_stride, int64_t M, int64_t K,
                                 std::vector<c10::BFloat16>& y) {
  const int64_t rows = (M + 31) / 32 * 32;
  c10::BFloat16* tiles = scratch(y, rows * K);
  at::parallel_for(0, rows, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      c10::BFloat16* dst = tiles + (m / 16) * 16 * K + (m % 16) * 32;
      const S* src = x + m * x_stride;
      for (int64_t k = 0; k < K; k += 32) {
        c10::BFloat16* to = dst + (k / 32) * 512;
        if (m >= M) {
          std::memset(to, 0, 64);
        } else if constexpr (std::is_same_v<S, c10::BFloat16>) {
          std::memcpy(to, src + k, 64);
        } else {
          vec::Vec16::load(src + k).store(to);
          vec::Vec16::load(src + k + 16).store(to + 16);
        }
      }
    }
  });
  return tiles;
}

// sums[m][n] (32 x 32) = input rows [0, 32) (input_tiles) . the panel's two blocks
// of 16 columns.
inline void amx_chunk(const c10::BFloat16* in, const c10::BFloat16* panel, int64_t K,
                      float* sums) {
  const c10::BFloat16* second = panel + K * vec::kLanes;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, in + k * 16, 64);
    _tile_loadd(5, in + 16 * K + k * 16, 64);
    _tile_loadd(6, panel + k * vec::kLanes, 64);
    _tile_loadd(7, second + k * vec::kLanes, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, sums, 128);
  _tile_stored(1, sums + 16, 128);
  _tile_stored(2, sums + 16 * 32, 128);
  _tile_stored(3, sums + 16 * 32 + 16, 128);
}

// Columns [0, N / 32 * 32) of out = x . W^T (+ bias); returns how many.
// strips: W is strips of type T, two of them per panel of 32 columns.
template <int64_t T, typename S>
int64_t amx_matmul(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const S* x,
                   int64_t x_stride, int64_t M, const S* bias, S* out, int64_t ld,
                   bool strips = false) {
  const int64_t panels = N / 32;
  thread_local std::vector<c10::BFloat16> tiles;
  const c10::BFloat16* in = input_tiles(x, x_stride, M, K, tiles);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(panels, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    amx::load_config();  // tiles 0-3: sums; 4, 5: input rows; 6, 7: weight pairs
    // The decoder's buffers, kept by each thread (a few KiB per K).
    thread_local std::vector<float> rows;
    thread_local std::vector<c10::BFloat16> words, panel;
    rows.resize(vec::kLanes * K);
    words.resize(vec::kLanes * K);
    panel.resize(2 * vec::kLanes * K);
    alignas(64) float sums[32 * 32];
    for (int64_t p = next++; p < panels; p = next++) {
      const int64_t n0 = p * 32;
      dequantize_weight_panel<T>(w, row_bytes, N, strips, n0, 2, K, rows.data(), words.data(),
                                 panel.data(), 32);
      const vec::Vec16 b0 = bias ? vec::Vec16::load(bias + n0) : vec::Vec16::zero();
      const vec::Vec16 b1 = bias ? vec::Vec16::load(bias + n0 + 16) : vec::Vec16::zero();
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        amx_chunk(in + m0 * K, panel.data(), K, sums);
        for (int64_t m = m0; m < std::min(M, m0 + 32); ++m) {
          const float* row = sums + (m - m0) * 32;
          (vec::Vec16::load(row) + b0).store(out + m * ld + n0);
          (vec::Vec16::load(row + 16) + b1).store(out + m * ld + n0 + 16);
        }
      }
    }
    _tile_release();
  });
  if (tiles.size() * sizeof(c10::BFloat16) > kKeepTileBytes) {
    std::vector<c10::BFloat16>().swap(tiles);
  }
  return panels * 32;
}
#endif

// ---------------------------------------------------------------------------
// Many float32 rows where neither AMX nor packed_linear's tile runs (AVX2 and
// portable builds): W in chunks dequantized to float32 (about 2 MiB each, so that
// a chunk stays in L2 while it is multiplied), each multiplied by ATen's matmul,
// the GEMM that float weights take on these CPUs.
constexpr int64_t kGemmMinRows = 64;

// The rows from which a weight of `type` takes that GEMM. On AVX2 the K-quants keep
// the int8 products at every count: 2 cores of a Zen 4 running an x86-64-v3 build,
// eight 2048x2048 weights, float32, int8 products against the GEMM at 64-512 rows
// Q4_K 1.22-2.04x, Q6_K 1.06-1.41x (Q8_0 and Q4_0: 1.38-1.70x at 64 rows, 0.64-0.88x
// from 128; the GEMM keeps those), TinyLlama Q4_K_M prefill 512 1.35x. With blocks of
// 32 scaled once per eight blocks, at 64-127 rows TinyLlama Q8_0's int8 products were
// 1.04-1.25x the GEMM but SmolLM2 Q4_1's 0.81-0.93x: no one threshold is better.
// Weights in strips keep the int8 products at every count: there they were 1.2-1.8x
// the GEMM at 64-512 rows (TinyLlama Q8_0's and SmolLM2 Q4_1's projections).
inline int64_t gemm_min_rows(int64_t type, bool strips) {
  if (batch_invariant() || strips) return INT64_MAX;
#if defined(PYLLM_QUANT_AVX2)
  if (type == kQ4_K || type == kQ6_K) return INT64_MAX;
#endif
  return kGemmMinRows;
}

template <int64_t T>
void gemm_matmul(const at::Tensor& input, const uint8_t* w, int64_t row_bytes, int64_t N,
                 const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t K = input.size(1);
  const int64_t chunk = std::clamp<int64_t>((2 << 20) / (4 * K) / 16 * 16, 16, N);
  at::Tensor dense = at::empty({chunk, K}, input.options());
  float* d = dense.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t c = std::min(chunk, N - n0);
    at::parallel_for(0, c, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        dequantize_row_f32<T>(w + (n0 + r) * row_bytes, K, d + r * K);
      }
    });
    at::Tensor part = out.narrow(1, n0, c);
    const at::Tensor wt = dense.narrow(0, 0, c).t();
    if (bias.has_value()) {
      at::addmm_out(part, bias->narrow(0, n0, c), input, wt);
    } else {
      at::mm_out(part, input, wt);
    }
  }
}

int64_t block_size_of(int64_t type) {
  int64_t size = 0;
  dispatch_type(type, [&](auto t) { size = Format<decltype(t)::value>::kBlock; });
  return size;
}

}  // namespace
}  // namespace pyllm::cpu
