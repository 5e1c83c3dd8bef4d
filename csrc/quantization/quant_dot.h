// quant_linear's integer dot products (an internal header of quant_cpu.cpp, its
// only includer): the quantized input rows they read, what every back end shares,
// and the back end this build targets, one header each (as cpu/vec.h picks Vec16's):
//   quant_dot_avx512.h    AVX-512 BW + VL + VNNI: 64-byte dot products, two groups
//                         of 32 weights per instruction
//   quant_dot_avx2.h      AVX2 + FMA: 32-byte dot products (vpdpbusd with AVX-VNNI,
//                         vpmaddubsw + vpmaddwd without)
//   quant_dot_portable.h  plain loops
// Each defines dot_rows<T, R>(w, row_bytes, x, m0, K, out, out_stride, n0, n1): the
// float32 sums of output columns [n0, n1) for input rows [m0, m0 + R). Where
// PYLLM_QUANT_AVX2 is defined, group_vector<T> (quant_groups_avx2.h) also serves
// the dequantization paths. Both vector back ends also read strips (quant_strips.h,
// quant_strips_avx512.h, quant_strips_avx2.h): strip_rows<T, R>, the same sums.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../cpu/vec.h"
#include "gguf_blocks.h"

#if defined(__AVX2__) && defined(__FMA__)
#define PYLLM_QUANT_AVX2 1
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PYLLM_QUANT_ZMM 1  // 64-byte integer dot products
#endif
#define PYLLM_QUANT_STRIPS 1  // the kernels read strips as they lie
#endif

namespace pyllm::cpu {
namespace {

using namespace pyllm::quant;

// Activations, quantized per row in spans of G values (32; 256 for the K formats,
// whose integer sums run over a whole block): q[K] int8 in [-127, 127], d[K / G] the
// span's scale, and per 16 values the sum of q (isum) and the scaled sum d * isum (s).

struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> s;
  std::vector<int16_t> isum;  // |sum| <= 16 * 127
  int64_t K = 0, G = 32;
  int span_shift = 0;  // log2(G / 32)
  const int8_t* q_row(int64_t m) const { return q.data() + m * K; }
  // The scale of group `group` (of 32) of row m.
  float dx(int64_t m, int64_t group) const { return d[m * (K / G) + (group >> span_shift)]; }
  const float* s_row(int64_t m) const { return s.data() + m * (K / 16); }
  const int16_t* isum_row(int64_t m) const { return isum.data() + m * (K / 16); }
};

// The weight stream runs this far ahead of the block being decoded (a strip's rows
// are contiguous, so it runs on across rows). The hardware prefetchers alone left
// batch-1 decode latency-bound: all of TinyLlama Q4_K_M's projections, 2 threads,
// 10.6 GB/s; 1 KiB ahead 12.0, 4 KiB 16.5, 8 KiB 17.4, 16 KiB 16.9 (the machine
// reads 26-30 GB/s with 2 threads; benchmarks/quant_linear.py).
constexpr int kPrefetchBytes = 8192;

// Rows from this long are prefetched into L2 only (to_l2), where the AVX-512 kernels
// read two of them at once: 2048x2048, 2 threads, 1 row: Q4_K 15-18 GB/s, Q8_0
// 19-21 into L1 against 23-25 and 29-32 into L2; SmolLM2 Q4_1's projections (rows of
// 360 and 960 bytes) 3.9-4.3 ms into L1, 4.3-4.6 into L2.
constexpr int64_t kL2PrefetchRowBytes = 1024;

template <int kBytes>
inline void prefetch_ahead(const uint8_t* blk, bool to_l2 = false) {
  for (int line = 0; line < kBytes; line += 64) {
    if (to_l2) {
      vec::prefetch_l2(blk + kPrefetchBytes + line);
    } else {
      vec::prefetch_l1(blk + kPrefetchBytes + line);
    }
  }
}

// Strips are prefetched into L2 this far ahead, twice kPrefetchBytes: a
// thread reads one stream where the GGUF rows' kernels read two (4 rows over
// TinyLlama's projections, three rounds: 23.8-26.6 ms against 26.1-28.9 at 8 KiB).
constexpr int kStripPrefetchBytes = 16384;

// On AMD CPUs, kernels over fewer input rows than this leave the stream to the
// hardware prefetchers: Zen 4, 2 threads, 57 random 4096x2048 weights
// (benchmarks/quant_linear.py --matrix), 1 row: Q4_K strips 7.8-8.9 ms without,
// 8.2-9.7 with; 2 rows even; 3 rows 10.0-11.5 against 9.3-10.1, 8 rows 21.4 against
// 15.9. Intel's cores keep fewer misses in flight per core, and there every row count
// prefetches: a Xeon with AMX (family 6 model 167), 2 threads, Q4_K_M experts of the
// qwen3-30b-a3b shape (benchmarks/bench_moe.py --strips), 1 token 15.4 -> 17.8 GB/s,
// 8 tokens 15.7 -> 17.7; a dense layer at 1 row 15.1 -> 18.1.
constexpr int kStripPrefetchMinRows = 3;

inline bool strip_prefetch_few_rows() {
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return intel;
}

// A strip kernel over R rows, at the block at p: the block kStripPrefetchBytes
// ahead into L2. Not past `stop` where given: fused_moe's items end where weights
// nobody reads may begin (an expert no token chose).
template <int kBytes, int R>
inline void strip_prefetch(const uint8_t* p, const uint8_t* stop) {
  if constexpr (R < kStripPrefetchMinRows) {
    if (!strip_prefetch_few_rows()) return;
  }
  const uint8_t* from = p + kStripPrefetchBytes;
  int64_t bytes = kBytes;
  if (stop != nullptr) bytes = std::clamp<int64_t>(stop - from, 0, kBytes);
  for (int64_t line = 0; line < bytes; line += 64) vec::prefetch_l2(from + line);
}

// Per input row and block, the int8 inputs' sums per 32 (sub-block), as int16 pairs
// (sub-blocks 2p, 2p + 1 in dword p): the mins' vpdpwssd (AVX2: vpmaddwd) operand.
inline const int32_t* strip_input_sums(const QuantizedRows& x, int64_t m0, int R,
                                       int64_t blocks) {
  thread_local std::vector<int32_t> pairs;
  pairs.resize(static_cast<size_t>(R * blocks * 4));
  for (int r = 0; r < R; ++r) {
    const int16_t* isum = x.isum_row(m0 + r);
    for (int64_t i = 0; i < blocks * 4; ++i) {
      const int32_t lo = isum[4 * i] + isum[4 * i + 1], hi = isum[4 * i + 2] + isum[4 * i + 3];
      pairs[r * blocks * 4 + i] = static_cast<int32_t>(static_cast<uint16_t>(lo) |
                                                       static_cast<uint32_t>(hi) << 16);
    }
  }
  return pairs.data();
}

// The K formats (blocks of 256 with small integer sub-block scales), against inputs
// quantized with one scale per 256: the sub-block scales multiply the 16-bit pair
// sums as integers, so a whole block's products stay in one int32 accumulator and
// become float once per block. Offsets: mins (or Q6_K's -32) times the inputs'
// integer sums per 16, also once per block. (gguf_formats.h's k_scales_mins unpacks
// Q4_K's and Q5_K's scales.)

}  // namespace
}  // namespace pyllm::cpu

#if defined(PYLLM_QUANT_ZMM)
#include "quant_dot_avx512.h"
#include "quant_strips_avx512.h"
#elif defined(PYLLM_QUANT_AVX2)
#include "quant_dot_avx2.h"
#include "quant_strips_avx2.h"
#else
#include "quant_dot_portable.h"
#endif
