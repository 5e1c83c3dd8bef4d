// The CPU kernels' vector types: include this header, never a back end.
//
// Vec16 is 16 float32 lanes, written once over three back ends with one
// interface, picked by what the compiler targets (-march=native on the build
// machine):
//   vec_avx512.h    AVX-512: one zmm register (and, with AVX512-BF16, the bf16
//                   pair products BF16x32 / dot_pairs; Words16 for the kernels
//                   that move 32-bit words as stored)
//   vec_avx2.h      AVX2 + FMA + F16C: two ymm registers (most x86 CPUs without
//                   AVX-512)
//   vec_portable.h  plain loops elsewhere (the compiler vectorizes what it can)
// Results are the same up to float rounding.
//
// Kernels load float/at::Half/at::BFloat16 memory straight into Vec16 (always
// computing in float32) and keep the lane count fixed at kLanes = 16 so their
// blocking does not depend on the back end. Besides Vec16 each back end defines
//   fold<K>(a, b)   pairwise sums of groups of K lanes (to finish dot products)
//   kRegisterVecs   how many Vec16 its register file holds: kernels size their
//                   register tiles (accumulators held across a loop) from it, so
//                   that they do not spill.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pyllm::vec {

constexpr int kLanes = 16;

// Kernels that read a tensor as 32-bit words, as stored (the lane-row prefill, the
// word-packed linear): a word is one float, or a bf16 pair, which vdpbf16ps
// multiplies pairwise (exact products, float32 sums). WordOps<T>::kVectorized says
// whether this build has the instruction for T. load reads 16 words, broadcast
// puts one word in every lane, mac accumulates lane-wise products of two operands.
// A back end that has the instruction for a type specializes WordOps for it.
template <typename T>
struct WordOps {
  static constexpr bool kVectorized = false;
};

}  // namespace pyllm::vec

#if defined(__AVX512F__)
#include "vec_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "vec_avx2.h"
#else
#include "vec_portable.h"
#endif

namespace pyllm::vec {

// Converts a float32 result to the tensor's element type (round to nearest even).
template <typename T>
inline T from_float(float a) {
  return static_cast<T>(a);
}

template <>
struct WordOps<float> {
  static constexpr bool kVectorized = true;
  static constexpr int kElems = 1;  // elements per word
  using Operand = Vec16;
  static Operand load(const float* p) { return Vec16::load(p); }
  static Operand broadcast(const float* p) { return Vec16::set1(*p); }
  static Vec16 mac(Vec16 acc, Operand a, Operand b) { return Vec16::fmadd(a, b, acc); }
};

// Hints that p's cache line will be read soon: into L1, or only into L2 when
// it is wanted later and would be evicted from L1 before then (prefetcht0 and
// prefetcht1 on x86). On x86 they are volatile asm: GCC 12 deleted loops of
// __builtin_prefetch whose bound it could not follow (every strip kernel's, and
// some attention kernels'), leaving no prefetch in the built library.
#if defined(__x86_64__) || defined(__i386__)
// The address goes in as a register, not a memory operand: a memory operand (a char,
// which may alias anything) made GCC store every live accumulator array to the stack
// before each prefetch, 24 stores a step in packed_linear's float32 tile.
inline void prefetch_l1(const void* p) { asm volatile("prefetcht0 (%0)" : : "r"(p)); }
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 (%0)" : : "r"(p)); }
#else
inline void prefetch_l1(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
#endif

}  // namespace pyllm::vec
