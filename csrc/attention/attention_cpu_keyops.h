// Step 1's key operations (KeyOps): how key vectors meet the query, per cache type and CPU.
//
// An internal header of attention_cpu_kernels.h, included after PagedCache: what it
// defines stays in attention_cpu.cpp's translation unit (anonymous namespace).
#pragma once

namespace pyllm::cpu {
namespace {
// How key vectors meet the query in step 1. A 16-lane step consumes kElems key
// elements: 16 converted to float32 (x head dimensions of 16/x tokens, one per
// lane), or, for bfloat16 where the CPU has AVX512-BF16, 32 as stored, paired
// by vdpbf16ps (x/2 lanes per token, two head dimensions per lane, exact
// products, float32 sums). The tiled query uses the same 64 bytes per x-group
// either way.
template <typename scalar_t, bool kPairs>
struct KeyOpsImpl {
  using KeyVec = Vec16;
  static constexpr int kElems = kLanes;
  static KeyVec load_key(const scalar_t* p) { return Vec16::load(p); }
  static KeyVec load_query(const float* p) { return Vec16::load(p); }
  static Vec16 fma(Vec16 acc, KeyVec k, KeyVec q) { return Vec16::fmadd(k, q, acc); }
  static Vec16 finish(Vec16 acc) { return acc; }
  using QueryElem = float;
};

#ifdef __AVX512BF16__
template <>
struct KeyOpsImpl<c10::BFloat16, true> {
  using KeyVec = vec::BF16x32;
  static constexpr int kElems = 2 * kLanes;
  static KeyVec load_key(const c10::BFloat16* p) { return KeyVec::load(p); }
  static KeyVec load_query(const float* p) {
    return KeyVec::load(reinterpret_cast<const c10::BFloat16*>(p));
  }
  static Vec16 fma(Vec16 acc, KeyVec k, KeyVec q) { return vec::dot_pairs(acc, k, q); }
  static Vec16 finish(Vec16 acc) { return acc; }
  using QueryElem = c10::BFloat16;
};
constexpr bool kHavePairDot = true;
#else
constexpr bool kHavePairDot = false;
#endif

#ifdef __AVX512BW__
// int8 keys on AVX-512: 32 keys sign-extended to int16 (vpmovsxbw, exact) meet a query
// quantized to int16 (Rows::q_scale, error ~1/65534 of its largest element, finer than
// bfloat16's) in int16 pair products summed to int32 (vpdpwssd, or vpmaddwd + vpaddd):
// one widening per 32 keys instead of two instructions per 16, half as many products
// and folds. The accumulators hold int32 in a Vec16's bits until finish() converts
// them; |sum| <= 127 * 32767 * D fits int32 for D <= 512 (set_query narrows q past it).
struct Int16x32 {
  __m512i v;
};
template <>
struct KeyOpsImpl<int8_t, false> {
  using KeyVec = Int16x32;
  static constexpr int kElems = 2 * kLanes;
  static KeyVec load_key(const int8_t* p) {
    return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static KeyVec load_query(const float* p) { return {_mm512_loadu_si512(p)}; }
  static Vec16 fma(Vec16 acc, KeyVec k, KeyVec q) {
    const __m512i a = _mm512_castps_si512(acc.v);
#ifdef __AVX512VNNI__
    return {_mm512_castsi512_ps(_mm512_dpwssd_epi32(a, k.v, q.v))};
#else
    return {_mm512_castsi512_ps(_mm512_add_epi32(a, _mm512_madd_epi16(k.v, q.v)))};
#endif
  }
  static Vec16 finish(Vec16 acc) { return {_mm512_cvtepi32_ps(_mm512_castps_si512(acc.v))}; }
  using QueryElem = int16_t;
};
#endif

template <typename scalar_t>
struct KeyOps : KeyOpsImpl<scalar_t, kHavePairDot && std::is_same_v<scalar_t, c10::BFloat16>> {
  static constexpr int kX = PagedCache<scalar_t>::kX;
  // Lanes that hold partial sums of one token's logit.
  static constexpr int kLanesPerToken = kX * kLanes / KeyOps::kElems;
};

}  // namespace
}  // namespace pyllm::cpu
