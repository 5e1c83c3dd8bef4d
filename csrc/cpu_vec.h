// A 16-lane float vector for the CPU kernels, written once over three back
// ends, chosen by what the compiler targets (-march=native on the build
// machine): AVX-512 intrinsics (one zmm register), AVX2 + FMA + F16C
// intrinsics (two ymm registers: most x86 CPUs without AVX-512), and plain
// loops elsewhere (the compiler vectorizes what it can). Results are the same
// up to float rounding.
//
// Kernels load float/at::Half/at::BFloat16 memory straight into Vec16 (always
// computing in float32) and keep the lane count fixed at 16 so their blocking
// does not depend on the back end.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#ifdef __AVX512F__
// gcc 12 reports its own AVX-512 intrinsics' deliberately undefined
// pass-through operands (`__Y = __Y`) as maybe-uninitialized wherever they
// are inlined; the warning is about the header, not the kernels.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace pyllm::vec {

constexpr int kLanes = 16;
// How many Vec16 the register file holds: kernels size their register tiles
// (accumulators held across a loop) from this, so that they do not spill.
#if defined(__AVX512F__)
constexpr int kRegisterVecs = 32;  // 32 zmm
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kRegisterVecs = 8;  // 16 ymm, two per Vec16
#else
constexpr int kRegisterVecs = 16;
#endif

#ifdef __AVX512F__

struct Vec16 {
  __m512 v;

 private:
  template <typename T>
  static __m256i load16(const T* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  // bfloat16 is the top half of a float32: widen and shift.
  static Vec16 widen(__m256i raw, const c10::BFloat16*) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
  }
  static Vec16 widen(__m256i raw, const c10::Half*) { return {_mm512_cvtph_ps(raw)}; }

 public:
  static Vec16 zero() { return {_mm512_setzero_ps()}; }
  static Vec16 set1(float a) { return {_mm512_set1_ps(a)}; }
  // 0, 1, ..., 15.
  static Vec16 iota() {
    return {_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)};
  }

  static Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec16 load(const c10::BFloat16* p) { return widen(load16(p), p); }
  static Vec16 load(const c10::Half* p) { return widen(load16(p), p); }

  // Lanes 0-7 from lo[0..8), lanes 8-15 from hi[0..8).
  static Vec16 load_halves(const float* lo, const float* hi) {
    return {
        _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(lo)), _mm256_loadu_ps(hi), 1)};
  }
  template <typename T>  // at::BFloat16 or at::Half: 8 elements are 16 bytes
  static Vec16 load_halves(const T* lo, const T* hi) {
    const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo));
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi));
    return widen(_mm256_inserti128_si256(_mm256_castsi128_si256(l), h, 1), lo);
  }

  void store(float* p) const { _mm512_storeu_ps(p, v); }
  // Rounded to nearest even; NaN stays a quiet NaN (as c10's conversions;
  // vcvtneps2bf16, where the CPU has it, also flushes float32 denormals to zero).
  void store(c10::BFloat16* p) const {
#ifdef __AVX512BF16__
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r,
                                _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
  }
  void store(c10::Half* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  friend Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec16 operator/(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
  friend Vec16 operator-(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  // a * b + c
  static Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec16 max(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
  // 1 / x to about 1 ulp: the 14-bit estimate and one Newton step, r + r (1 - x r)
  // (much cheaper than a division). Inputs past 2^126 give 0.
  Vec16 reciprocal() const {
    const __m512 r = _mm512_rcp14_ps(v);
    return {_mm512_fmadd_ps(r, _mm512_fnmadd_ps(v, r, _mm512_set1_ps(1.0f)), r)};
  }
  float reduce_add() const { return _mm512_reduce_add_ps(v); }
  float reduce_max() const { return _mm512_reduce_max_ps(v); }

  // Lanes >= n become `fill`; a select, so garbage (NaN, inf) in them is dropped.
  Vec16 keep_first(int n, float fill) const {
    __mmask16 keep = n >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n > 0 ? n : 0)) - 1);
    return {_mm512_mask_blend_ps(keep, _mm512_set1_ps(fill), v)};
  }

  // Lanes where a > b become `fill` (a select, as keep_first).
  Vec16 keep_where_le(Vec16 a, Vec16 b, float fill) const {
    const __mmask16 keep = _mm512_cmp_ps_mask(a.v, b.v, _CMP_LE_OQ);
    return {_mm512_mask_blend_ps(keep, _mm512_set1_ps(fill), v)};
  }

  // exp(x) within 3 ulp where the result is a normal float (checked against
  // double exp over [-103, 88.7]); exp(-inf) = 0 exactly, NaN stays NaN, and
  // inputs above 88.7 give exp(88.7) rather than inf (softmax only feeds it
  // values <= 0). Range reduction x = n ln2 + r with |r| <= ln2 / 2, a
  // degree-6 Taylor polynomial for exp(r), then exact scaling by 2^n. Inputs
  // are clamped to [-120, 88.7] (max/min return their second operand for NaN,
  // so NaN passes through); 2^-173 scales to exactly zero.
  Vec16 exp() const {
    const __m512 x =
        _mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-120.0f), v));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return {_mm512_scalef_ps(p, n)};
  }

  // 2^x within about 3e-6 relative error, for x <= 0 (softmax weights that
  // are rounded to bfloat16 next): n = round(x), 2^(x - n) from its degree-5
  // Taylor polynomial, exact scaling by 2^n. -inf (and anything below -150)
  // gives exactly 0; NaN stays NaN.
  Vec16 exp2_nonpositive() const {
    const __m512 x = _mm512_max_ps(_mm512_set1_ps(-150.0f), v);
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);  // ln2^5 / 120
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291e-3f));  // ln2^4 / 24
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));  // ln2^3 / 6
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.24022651f));    // ln2^2 / 2
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.69314718f));    // ln2
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return {_mm512_scalef_ps(p, n)};
  }
};

namespace detail {
// Permutation indices for fold<K> below: lane i of the low (high) half-sums.
template <int K>
struct FoldIndex {
  alignas(64) int32_t lo[kLanes];
  alignas(64) int32_t hi[kLanes];
  constexpr FoldIndex() : lo(), hi() {
    constexpr int half = K / 2, groups = kLanes / K;
    for (int i = 0; i < kLanes; ++i) {
      const int group = i / half, lane = i % half;
      lo[i] = group < groups ? group * K + lane : kLanes + (group - groups) * K + lane;
      hi[i] = lo[i] + half;
    }
  }
};
template <int K>
inline constexpr FoldIndex<K> kFoldIndex{};
}  // namespace detail

// a and b each hold 16 / K groups of K consecutive lanes. Returns 32 / K groups
// of K / 2 lanes (a's groups, then b's), each the pairwise sum of its group's
// two halves: repeated folds turn per-lane partial dot products into one sum
// per group while keeping the groups in order.
template <int K>
inline Vec16 fold(Vec16 a, Vec16 b) {
  const __m512i lo = _mm512_load_si512(detail::kFoldIndex<K>.lo);
  const __m512i hi = _mm512_load_si512(detail::kFoldIndex<K>.hi);
  return {
      _mm512_add_ps(_mm512_permutex2var_ps(a.v, lo, b.v), _mm512_permutex2var_ps(a.v, hi, b.v))};
}

#ifdef __AVX512BF16__
// 32 bfloat16 values as stored, for dot_pairs.
struct BF16x32 {
  __m512bh v;
  static BF16x32 load(const c10::BFloat16* p) {
    return {(__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p))};
  }
  // The pair p[0], p[1] in every lane.
  static BF16x32 broadcast_pair(const c10::BFloat16* p) {
    int32_t pair;
    std::memcpy(&pair, p, sizeof(pair));
    return {(__m512bh)_mm512_set1_epi32(pair)};
  }
  // Lane i holds (even[i], odd[i]), each rounded to nearest even: the pairs
  // dot_pairs multiplies with (b[2i], b[2i + 1]).
  static BF16x32 interleave(Vec16 even, Vec16 odd) {
    // cvtne2ps puts even's 16 values in elements 0-15 and odd's in 16-31.
    alignas(64) static constexpr int16_t kIndex[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                       21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                       11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(odd.v, even.v);
    return {(__m512bh)_mm512_permutexvar_epi16(_mm512_load_si512(kIndex), halves)};
  }
};

// acc + a[2i] * b[2i] + a[2i + 1] * b[2i + 1] in lane i (vdpbf16ps): products
// of bfloat16 are exact in float32, sums are float32.
inline Vec16 dot_pairs(Vec16 acc, BF16x32 a, BF16x32 b) {
  return {_mm512_dpbf16_ps(acc.v, a.v, b.v)};
}
#endif

// Hints that p's cache line will be read soon: into L1, or only into L2 when
// it is wanted later and would be evicted from L1 before then.
inline void prefetch_l1(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// Lanes 0-7 in lo, 8-15 in hi. A Vec16 takes two of the 16 ymm registers,
// so kernels keep fewer in flight here (kRegisterVecs).
struct Vec16 {
  __m256 lo, hi;

 private:
  static __m256 widen_bf16(const c10::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
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
  static __m256 exp2_nonpositive8(__m256 v) {
    const __m256 x = _mm256_max_ps(_mm256_set1_ps(-150.0f), v);
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.3333558e-3f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.24022651f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.69314718f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    return scale_pow2(p, n);
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

  // Lanes >= n become `fill`; a select, so garbage (NaN, inf) in them is dropped.
  Vec16 keep_first(int n, float fill) const {
    const __m256 f = _mm256_set1_ps(fill);
    return {_mm256_blendv_ps(f, lo, lanes_below(n, 0.0f)),
            _mm256_blendv_ps(f, hi, lanes_below(n, 8.0f))};
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

inline void prefetch_l1(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

#else  // portable back end

struct Vec16 {
  float v[kLanes];

  static Vec16 zero() { return set1(0.0f); }
  static Vec16 set1(float a) {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = a;
    return r;
  }
  static Vec16 iota() {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = float(i);
    return r;
  }
  template <typename T>
  static Vec16 load(const T* p) {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  template <typename T>
  static Vec16 load_halves(const T* lo, const T* hi) {
    Vec16 r;
    for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(lo[i]);
    for (int i = 0; i < 8; ++i) r.v[8 + i] = static_cast<float>(hi[i]);
    return r;
  }
  void store(float* p) const { std::memcpy(p, v, sizeof(v)); }
  template <typename T>  // at::BFloat16 or at::Half, rounded to nearest even
  void store(T* p) const {
    for (int i = 0; i < kLanes; ++i) p[i] = static_cast<T>(v[i]);
  }

#define PYLLM_VEC16_BINARY(OP)                                  \
  friend Vec16 operator OP(Vec16 a, Vec16 b) {                  \
    Vec16 r;                                                    \
    for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] OP b.v[i]; \
    return r;                                                   \
  }
  PYLLM_VEC16_BINARY(+)
  PYLLM_VEC16_BINARY(-)
  PYLLM_VEC16_BINARY(*)
  PYLLM_VEC16_BINARY(/)
#undef PYLLM_VEC16_BINARY

  static Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
    return r;
  }
  static Vec16 max(Vec16 a, Vec16 b) {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
    return r;
  }
  Vec16 reciprocal() const {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = 1.0f / v[i];
    return r;
  }
  float reduce_add() const {
    float s = 0.0f;
    for (int i = 0; i < kLanes; ++i) s += v[i];
    return s;
  }
  float reduce_max() const {
    float m = v[0];
    for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
    return m;
  }
  Vec16 keep_first(int n, float fill) const {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = i < n ? v[i] : fill;
    return r;
  }
  Vec16 keep_where_le(Vec16 a, Vec16 b, float fill) const {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] <= b.v[i] ? v[i] : fill;
    return r;
  }
  Vec16 exp() const {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = std::exp(v[i]);
    return r;
  }
  Vec16 exp2_nonpositive() const {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = std::exp2(v[i]);
    return r;
  }
};

template <int K>
inline Vec16 fold(Vec16 a, Vec16 b) {
  constexpr int half = K / 2, groups = kLanes / K;
  Vec16 r;
  for (int i = 0; i < kLanes; ++i) {
    const int group = i / half, lane = i % half;
    const Vec16& src = group < groups ? a : b;
    const int base = (group < groups ? group : group - groups) * K + lane;
    r.v[i] = src.v[base] + src.v[base + half];
  }
  return r;
}

inline void prefetch_l1(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

#endif

// Converts a float32 result to the tensor's element type (round to nearest even).
template <typename T>
inline T from_float(float a) {
  return static_cast<T>(a);
}

// Kernels that read a tensor as 32-bit words, as stored (the lane-row prefill, the
// word-packed linear): a word is one float, or a bf16 pair, which vdpbf16ps
// multiplies pairwise (exact products, float32 sums). WordOps<T>::kVectorized says
// whether this build has the instruction for T. load reads 16 words, broadcast
// puts one word in every lane, mac accumulates lane-wise products of two operands.
template <typename T>
struct WordOps {
  static constexpr bool kVectorized = false;
};

template <>
struct WordOps<float> {
  static constexpr bool kVectorized = true;
  static constexpr int kElems = 1;  // elements per word
  using Operand = Vec16;
  static Operand load(const float* p) { return Vec16::load(p); }
  static Operand broadcast(const float* p) { return Vec16::set1(*p); }
  static Vec16 mac(Vec16 acc, Operand a, Operand b) { return Vec16::fmadd(a, b, acc); }
};

#ifdef __AVX512BF16__
template <>
struct WordOps<c10::BFloat16> {
  static constexpr bool kVectorized = true;
  static constexpr int kElems = 2;
  using Operand = BF16x32;
  static Operand load(const c10::BFloat16* p) { return BF16x32::load(p); }
  static Operand broadcast(const c10::BFloat16* p) { return BF16x32::broadcast_pair(p); }
  static Vec16 mac(Vec16 acc, Operand a, Operand b) { return dot_pairs(acc, a, b); }
};
#endif

}  // namespace pyllm::vec
