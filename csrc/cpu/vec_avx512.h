// The AVX-512 back end of vec.h (include vec.h, which picks it), for F + BW + DQ +
// VL (x86-64-v4): Vec16 in one zmm register; with AVX512-BF16, BF16x32 and
// dot_pairs (vdpbf16ps). Words16 and its operations serve the kernels that move
// 32-bit words as stored (AVX-512 only).
#pragma once

#include <immintrin.h>

// gcc 12 reports its own AVX-512 intrinsics' deliberately undefined
// pass-through operands (`__Y = __Y`) as maybe-uninitialized wherever they
// are inlined; the warning is about the header, not the kernels.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace pyllm::vec {

constexpr int kRegisterVecs = 32;  // 32 zmm

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
  // int8 (a quantized KV cache): 16 bytes sign-extended and converted (vpmovsxbd, vcvtdq2ps).
  static Vec16 load(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static Vec16 load_halves(const int8_t* lo, const int8_t* hi) {
    const __m128i l = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo));
    const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(hi));
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(l, h)))};
  }

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
  Vec16 abs() const { return {_mm512_abs_ps(v)}; }
  // Lanes rounded to integers by the current rounding mode (nearest even, as
  // std::nearbyint), stored as int8 at p (lanes must lie in [-128, 127]); returns
  // their sum.
  int32_t store_rounded_int8(int8_t* p) const {
    const __m512i i = _mm512_cvtps_epi32(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(i));
    return _mm512_reduce_add_epi32(i);
  }

  // Lanes >= n become `fill`; a select, so garbage (NaN, inf) in them is dropped.
  Vec16 keep_first(int n, float fill) const {
    __mmask16 keep = n >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n > 0 ? n : 0)) - 1);
    return {_mm512_mask_blend_ps(keep, _mm512_set1_ps(fill), v)};
  }
  // Lanes whose bit (lane i: bit i) is 0 become `fill`.
  Vec16 keep_bits(uint32_t bits, float fill) const {
    return {_mm512_mask_blend_ps(__mmask16(bits & 0xFFFF), _mm512_set1_ps(fill), v)};
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
  // Taylor polynomial, exact scaling by 2^n. Below -125 (-inf included) it gives
  // exactly 0: a denormal result costs a microcode assist per lane, about a hundred
  // times the polynomial (a masked causal tile's keys spent most of the AMX
  // prefill's time there). NaN stays NaN.
  Vec16 exp2_nonpositive() const {
    const __mmask16 live = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
    const __m512 x = _mm512_max_ps(_mm512_set1_ps(-125.0f), v);  // NaN: v
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);  // ln2^5 / 120
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291e-3f));  // ln2^4 / 24
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));  // ln2^3 / 6
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.24022651f));    // ln2^2 / 2
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.69314718f));    // ln2
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return {_mm512_maskz_scalef_ps(live, p, n)};
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

// 16 32-bit words as stored (floats, bf16 pairs), in one zmm: what a kernel moves
// and transposes without converting it.
struct Words16 {
  __m512i v;

  static Words16 zero() { return {_mm512_setzero_si512()}; }
  // The bits of 16 floats, or of 16 bf16 pairs.
  static Words16 bits(Vec16 x) { return {_mm512_castps_si512(x.v)}; }
#ifdef __AVX512BF16__
  static Words16 bits(BF16x32 x) { return {(__m512i)x.v}; }
#endif

  // Which words a masked load or store touches: the first n, n in [0, 16].
  struct Mask {
    __mmask16 k;
  };
  static Mask first(int n) { return {__mmask16((1u << n) - 1)}; }
  // The masked words of p, zeros elsewhere: words outside the mask are neither
  // read nor faulted on.
  static Words16 load(const void* p, Mask m) { return {_mm512_maskz_loadu_epi32(m.k, p)}; }
  void store(void* p) const { _mm512_storeu_si512(p, v); }
  // The masked words only; memory outside them is not touched.
  void store(void* p, Mask m) const { _mm512_mask_storeu_epi32(p, m.k, v); }
};

// Transposes a 16 x 16 matrix of words held as 16 row vectors (four rounds of
// unpacks and 128-bit shuffles): turns 16 rows' words into one vector per word
// with a row per lane, and back.
inline void transpose16(Words16 (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i].v, r[2 * i + 1].v);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i].v, r[2 * i + 1].v);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < 4; ++k) {
      t[8 * i + k] = _mm512_shuffle_i32x4(u[8 * i + k], u[8 * i + 4 + k], 0x88);
      t[8 * i + 4 + k] = _mm512_shuffle_i32x4(u[8 * i + k], u[8 * i + 4 + k], 0xdd);
    }
  }
  for (int k = 0; k < 8; ++k) {
    r[k].v = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[8 + k].v = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
  }
}

// dst[0, 8) = src[0, n) and zeros after, n in [0, 8]: a masked load, so src past n
// is neither read nor faulted on (with n = 0, src may be null).
inline void copy_first8(c10::BFloat16* dst, const c10::BFloat16* src, int n) {
  const __m128i x =
      n > 0 ? _mm_maskz_loadu_epi16(__mmask8((1u << n) - 1), src) : _mm_setzero_si128();
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), x);
}
inline void copy_first8(float* dst, const float* src, int n) {
  const __m256i x = n > 0 ? _mm256_maskz_loadu_epi32(__mmask8((1u << n) - 1), src)
                          : _mm256_setzero_si256();
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), x);
}

}  // namespace pyllm::vec
