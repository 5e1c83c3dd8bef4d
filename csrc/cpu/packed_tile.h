// The register tile of packed_linear's GEMM micro-kernel, shared by the kernels that
// multiply weights in its word-packed layout: packed_linear (weights packed once at
// load) and quant_linear's many-row path (weights dequantized a panel at a time).
//
// W is word-packed as [N/16, K/E, 16, E] (E elements per 32-bit word: 1 float, 2
// bf16 or f16): the words of 16 consecutive output columns at one step of K are one
// 64-byte vector, and a block of 16 columns is K/E such vectors in a row.
#pragma once

#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace pyllm::cpu {

// Rows and column blocks of the register tile: M <= 4 rows take 4 blocks (a
// weight stream with 4 independent sums per row), more rows 8 x 3. Sized for
// AVX-512's 32 vector registers: with fewer (AVX2: 8 Vec16) the tile would spill,
// so there the plain loop stands in and the engine keeps its other kernels.
constexpr int kTileRows = 8;
constexpr int tile_blocks(int rows) { return rows <= 4 ? 4 : 3; }
// f(std::integral_constant<int, rows>{}) for rows in [1, kTileRows), else with
// kTileRows: a call's row count as a kernel's compile-time tile height.
template <typename F>
inline void with_tile_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, kTileRows>{}); break;
  }
}

template <typename T>
constexpr bool kPackedLinearVectorized = vec::WordOps<T>::kVectorized && vec::kRegisterVecs >= 32;

// One register tile, its sums stored as T or (O = float) in float32; meanwhile
// `ahead_lines` cache lines from `ahead` are prefetched into L2, one per step of K
// (or a few, if fewer steps than lines).
template <typename T, int MB, int NB, typename O = T>
inline void packed_tile(const T* x, int64_t x_stride, const T* w, int64_t K, const T* bias, O* out,
                 int64_t out_stride, const char* ahead, int64_t ahead_lines) {
  using W = vec::WordOps<T>;
  using vec::Vec16;
  constexpr int E = W::kElems;
  const int64_t block = K * vec::kLanes;  // elements of one column block
  const int64_t steps = K / E;
  const int64_t lines_per_step = (ahead_lines + steps - 1) / steps;
  Vec16 acc[MB][NB];
  for (auto& row : acc) {
    for (auto& a : row) a = Vec16::zero();
  }
  int64_t line = 0;
  for (int64_t k = 0; k < K; k += E) {
    for (int64_t l = 0; l < lines_per_step && line < ahead_lines; ++l, ++line) {
      vec::prefetch_l2(ahead + line * 64);
    }
    typename W::Operand b[NB];
    for (int j = 0; j < NB; ++j) b[j] = W::load(w + j * block + k * vec::kLanes);
    for (int i = 0; i < MB; ++i) {
      const auto a = W::broadcast(x + i * x_stride + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = W::mac(acc[i][j], a, b[j]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < NB; ++j) {
      Vec16 y = acc[i][j];
      if (bias != nullptr) y = y + Vec16::load(bias + j * vec::kLanes);
      y.store(out + i * out_stride + j * vec::kLanes);
    }
  }
}

}  // namespace pyllm::cpu
