// The portable back end of quant_dot.h: plain loops over group_quants' integers
// (gguf_blocks.h).
#pragma once

#include "quant_dot.h"

namespace pyllm::cpu {
namespace {

// Output columns [n0, n1) for input rows [m0, m0 + R).
template <int64_t T, int R>
void dot_rows(const uint8_t* w, int64_t row_bytes, const QuantizedRows& x, int64_t m0, int64_t K,
              float* out, int64_t out_stride, int64_t n0, int64_t n1) {
  using F = Format<T>;
  const int64_t blocks = K / F::kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float acc[R] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * F::kBytes;
      float a[2 * F::kGroups], off[2 * F::kGroups];
      F::scales(blk, a, off);
      for (int g = 0; g < F::kGroups; ++g) {
        const int64_t group = b * F::kGroups + g;
        uint8_t u[32];
        group_quants<T>(blk, g, u);
        for (int r = 0; r < R; ++r) {
          const int8_t* q = x.q_row(m0 + r) + group * 32;
          int32_t dot[2] = {0, 0};
          for (int l = 0; l < 32; ++l) {
            const int32_t wv = F::kSigned ? int32_t(int8_t(u[l])) : int32_t(u[l]);
            dot[l / 16] += wv * int32_t(q[l]);
          }
          const float dx = x.dx(m0 + r, group);
          const float* s = x.s_row(m0 + r) + 2 * group;
          // dx * a first, as the vector paths: MXFP4's a reaches 2^127, and a times
          // the integer sum alone may overflow where the product with dx does not.
          acc[r] += dx * a[2 * g] * float(dot[0]) + dx * a[2 * g + 1] * float(dot[1]) +
                    off[2 * g] * s[0] + off[2 * g + 1] * s[1];
        }
      }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride + n] = acc[r];
  }
}

}  // namespace
}  // namespace pyllm::cpu
