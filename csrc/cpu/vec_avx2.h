// The AVX2 + FMA + F16C back end of vec.h (include vec.h, which picks it): Vec16
// in two ymm registers.
#pragma once

#include <immintrin.h>

namespace pyllm::vec {

constexpr int kRegisterVecs = 8;  // 16 ymm, two per Vec16

// Lanes 0-7 in lo, 8-15 in hi. A Vec16 takes two of the 16 ymm registers,
// so kernels keep fewer in flight here (kRegisterVecs).
struct Vec16 {
  __m256 lo, hi;

 private:
  static __m256 widen_bf16(const c10::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static __m256 widen_int8(const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static __m256 widen_half(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // 8 floats -> 8 bfloat16 bits in the low 16 bits of each 32-bit lane,
  // rounded to nearest even; NaN becomes the quiet NaN 0x7fc0.
  static __m256i round_bf16(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                                _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)),
                                                nan));
  }
  // p * 2^n for integral float n in [-252, 254], through two normal
  // powers of two (one alone could not reach below 2^-126).
  static __m256 scale_pow2(__m256 p, __m256 n) {
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1);
    const __m256i n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  }
  static __m256 exp8(__m256 v) {
    const __m256 x =
        _mm256_min_ps(_mm256_set1_ps(88.7f), _mm256_max_ps(_mm256_set1_ps(-120.0f), v));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    return scale_pow2(p, n);
  }
  // As Vec16::exp2_nonpositive of vec_avx512.h: 0 below -125, where the product
  // would be a denormal (a microcode assist per lane).
  static __m256 exp2_nonpositive8(__m256 v) {
    const __m256 live = _mm256_cmp_ps(v, _mm256_set1_ps(-125.0f), _CMP_NLT_UQ);
    const __m256 x = _mm256_max_ps(_mm256_set1_ps(-125.0f), v);  // NaN: v
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.3333558e-3f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.24022651f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.69314718f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    return _mm256_and_ps(live, scale_pow2(p, n));
  }
  static __m128 sum4(__m256 x) {
    return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  }
  static __m128 max4(__m256 x) {
    return _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  }
  // Lanes i with i < n (i counted from `first`) as a mask.
  static __m256 lanes_below(int n, float first) {
    const __m256 index = _mm256_add_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                       _mm256_set1_ps(first));
    return _mm256_cmp_ps(index, _mm256_set1_ps(float(n)), _CMP_LT_OQ);
  }

 public:
  static Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec16 set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
  static Vec16 iota() {
    return {_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15)};
  }

  static Vec16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Vec16 load(const c10::BFloat16* p) { return {widen_bf16(p), widen_bf16(p + 8)}; }
  static Vec16 load(const c10::Half* p) { return {widen_half(p), widen_half(p + 8)}; }
  // int8 (a quantized KV cache): 8 bytes per half sign-extended and converted.
  static Vec16 load(const int8_t* p) { return {widen_int8(p), widen_int8(p + 8)}; }
  static Vec16 load_halves(const int8_t* lo, const int8_t* hi) {
    return {widen_int8(lo), widen_int8(hi)};
  }

  // Lanes 0-7 from lo[0..8), lanes 8-15 from hi[0..8).
  static Vec16 load_halves(const float* lo, const float* hi) {
    return {_mm256_loadu_ps(lo), _mm256_loadu_ps(hi)};
  }
  static Vec16 load_halves(const c10::BFloat16* lo, const c10::BFloat16* hi) {
    return {widen_bf16(lo), widen_bf16(hi)};
  }
  static Vec16 load_halves(const c10::Half* lo, const c10::Half* hi) {
    return {widen_half(lo), widen_half(hi)};
  }

  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  // Rounded to nearest even; NaN stays a quiet NaN (as c10's conversions).
  void store(c10::BFloat16* p) const {
    // packus interleaves 128-bit halves; the 64-bit permute puts them back in order.
    const __m256i packed = _mm256_packus_epi32(round_bf16(lo), round_bf16(hi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
  }
  void store(c10::Half* p) const {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(lo, kRound));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(hi, kRound));
  }

  friend Vec16 operator+(Vec16 a, Vec16 b) {
    return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
  }
  friend Vec16 operator-(Vec16 a, Vec16 b) {
    return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
  }
  friend Vec16 operator*(Vec16 a, Vec16 b) {
    return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
  }
  friend Vec16 operator/(Vec16 a, Vec16 b) {
    return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)};
  }
  // a * b + c
  static Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  static Vec16 max(Vec16 a, Vec16 b) {
    return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
  }
  // 1 / x: the 12-bit estimate and one Newton step, r + r (1 - x r), good to
  // about 2 ulp (much cheaper than a division).
  Vec16 reciprocal() const {
    auto one = [](__m256 x) {
      const __m256 r = _mm256_rcp_ps(x);
      return _mm256_fmadd_ps(r, _mm256_fnmadd_ps(x, r, _mm256_set1_ps(1.0f)), r);
    };
    return {one(lo), one(hi)};
  }
  float reduce_add() const {
    __m128 s = sum4(_mm256_add_ps(lo, hi));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  float reduce_max() const {
    __m128 m = max4(_mm256_max_ps(lo, hi));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  Vec16 abs() const {
    const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return {_mm256_and_ps(lo, mask), _mm256_and_ps(hi, mask)};
  }
  int32_t store_rounded_int8(int8_t* p) const {
    const __m256i a = _mm256_cvtps_epi32(lo), b = _mm256_cvtps_epi32(hi);
    // packs works within 128-bit lanes: a0-3 b0-3 a4-7 b4-7, put back in order.
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
    const __m256i ab = _mm256_add_epi32(a, b);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(ab), _mm256_extracti128_si256(ab, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
  }

  // Lanes >= n become `fill`; a select, so garbage (NaN, inf) in them is dropped.
  Vec16 keep_first(int n, float fill) const {
    const __m256 f = _mm256_set1_ps(fill);
    return {_mm256_blendv_ps(f, lo, lanes_below(n, 0.0f)),
            _mm256_blendv_ps(f, hi, lanes_below(n, 8.0f))};
  }
  // Lanes whose bit (lane i: bit i) is 0 become `fill`.
  Vec16 keep_bits(uint32_t bits, float fill) const {
    const __m256i lane_bits_lo = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i lane_bits_hi = _mm256_slli_epi32(lane_bits_lo, 8);
    const __m256i b = _mm256_set1_epi32(static_cast<int>(bits));
    const __m256 f = _mm256_set1_ps(fill);
    const __m256i keep_lo = _mm256_cmpeq_epi32(_mm256_and_si256(b, lane_bits_lo), lane_bits_lo);
    const __m256i keep_hi = _mm256_cmpeq_epi32(_mm256_and_si256(b, lane_bits_hi), lane_bits_hi);
    return {_mm256_blendv_ps(f, lo, _mm256_castsi256_ps(keep_lo)),
            _mm256_blendv_ps(f, hi, _mm256_castsi256_ps(keep_hi))};
  }
  // Lanes where a > b become `fill` (a select, as keep_first).
  Vec16 keep_where_le(Vec16 a, Vec16 b, float fill) const {
    const __m256 f = _mm256_set1_ps(fill);
    return {_mm256_blendv_ps(f, lo, _mm256_cmp_ps(a.lo, b.lo, _CMP_LE_OQ)),
            _mm256_blendv_ps(f, hi, _mm256_cmp_ps(a.hi, b.hi, _CMP_LE_OQ))};
  }

  // As the AVX-512 back end's: within 3 ulp for normal results, exp(-inf) = 0,
  // NaN stays NaN, inputs above 88.7 give exp(88.7).
  Vec16 exp() const { return {exp8(lo), exp8(hi)}; }
  // 2^x for x <= 0, about 3e-6 relative error; -inf gives exactly 0.
  Vec16 exp2_nonpositive() const { return {exp2_nonpositive8(lo), exp2_nonpositive8(hi)}; }
};

// a and b each hold 16 / K groups of K consecutive lanes. Returns 32 / K groups
// of K / 2 lanes (a's groups, then b's), each the pairwise sum of its group's
// two halves: repeated folds turn per-lane partial dot products into one sum
// per group while keeping the groups in order. a's results land in lo, b's in hi.
namespace detail {
template <int K>
inline __m256 fold8(__m256 x, __m256 y) {  // x, y: lanes 0-7 and 8-15 of one Vec16
  if constexpr (K == 16) {
    return _mm256_add_ps(x, y);
  } else if constexpr (K == 8) {
    return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
  } else {
    static_assert(K == 4 || K == 2);
    // Within each 128-bit lane: K == 4 sums lanes (0,2), (1,3); K == 2 sums (0,1), (2,3).
    constexpr int kA = K == 4 ? _MM_SHUFFLE(1, 0, 1, 0) : _MM_SHUFFLE(2, 0, 2, 0);
    constexpr int kB = K == 4 ? _MM_SHUFFLE(3, 2, 3, 2) : _MM_SHUFFLE(3, 1, 3, 1);
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(x, y, kA), _mm256_shuffle_ps(x, y, kB));
    // s holds 64-bit groups (x lo, y lo, x hi, y hi): reorder to (x lo, x hi, y lo, y hi).
    return _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(s), _MM_SHUFFLE(3, 1, 2, 0)));
  }
}
}  // namespace detail

template <int K>
inline Vec16 fold(Vec16 a, Vec16 b) {
  return {detail::fold8<K>(a.lo, a.hi), detail::fold8<K>(b.lo, b.hi)};
}

}  // namespace pyllm::vec
