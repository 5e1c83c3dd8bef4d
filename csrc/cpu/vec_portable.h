// The portable back end of vec.h (include vec.h, which picks it): Vec16 as 16
// floats in plain loops, which the compiler vectorizes where it can.
#pragma once

namespace pyllm::vec {

constexpr int kRegisterVecs = 16;

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
  Vec16 abs() const {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = std::fabs(v[i]);
    return r;
  }
  int32_t store_rounded_int8(int8_t* p) const {
    int32_t sum = 0;
    for (int i = 0; i < kLanes; ++i) {
      const int q = static_cast<int>(std::nearbyint(v[i]));
      p[i] = static_cast<int8_t>(q);
      sum += q;
    }
    return sum;
  }
  Vec16 keep_first(int n, float fill) const {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = i < n ? v[i] : fill;
    return r;
  }
  Vec16 keep_bits(uint32_t bits, float fill) const {
    Vec16 r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = (bits >> i) & 1u ? v[i] : fill;
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
    for (int i = 0; i < kLanes; ++i) r.v[i] = v[i] < -125.0f ? 0.0f : std::exp2(v[i]);  // as AVX
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

}  // namespace pyllm::vec
