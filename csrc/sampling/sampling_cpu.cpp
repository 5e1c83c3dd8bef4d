// CPU apply_token_bitmask: the grammar masks of structured output applied to the
// logits in place. Token t of masked row i stays when bit t % 32 of word t / 32 of
// bitmask[i] is set, and becomes -inf otherwise (tokens past the mask's words too).
//
// A mask word covers 32 tokens; most words of a grammar's mask are all zeros or all
// ones, so a word of ones is skipped and the others go through two Vec16 selects
// (16 lanes each, one lane per bit) in the tensor's own dtype.
#include <algorithm>
#include <cstdint>
#include <limits>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../cpu/vec.h"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "sampling_checks.h"

namespace pyllm::cpu {
namespace {

// Logits per thread below which a second thread costs more than it saves.
constexpr int64_t kGrainElements = 1 << 16;

template <typename T>
void mask_row(T* row, const int32_t* words, int64_t num_words, int64_t vocab) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  const int64_t covered = std::min(vocab, num_words * 32);
  for (int64_t w = 0; w * 32 < covered; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    if (word == 0xFFFFFFFFu) continue;
    for (int64_t half = 0; half < 2; ++half) {
      const int64_t start = w * 32 + half * vec::kLanes;
      if (start >= covered) break;
      const uint32_t bits = (word >> (half * vec::kLanes)) & 0xFFFFu;
      if (bits == 0xFFFFu) continue;
      if (start + vec::kLanes <= covered) {
        vec::Vec16::load(row + start).keep_bits(bits, kMinusInf).store(row + start);
      } else {
        for (int64_t t = start; t < covered; ++t) {
          if (!((bits >> (t - start)) & 1u)) row[t] = static_cast<T>(kMinusInf);
        }
      }
    }
  }
  for (int64_t t = covered; t < vocab; ++t) row[t] = static_cast<T>(kMinusInf);
}

}  // namespace

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  check_apply_token_bitmask(logits, bitmask, rows);
  const int64_t n = rows.size(0);
  const int64_t num_seqs = logits.size(0);
  const int64_t vocab = logits.size(1);
  const int64_t num_words = bitmask.size(1);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_INDEX(row_ids[i] >= 0 && row_ids[i] < num_seqs, "rows[", i, "] is ", row_ids[i],
                      ", outside the ", num_seqs, " rows of logits");
  }
  if (n == 0 || vocab == 0) return;
  const int32_t* words = bitmask.data_ptr<int32_t>();
  const int64_t stride = logits.stride(0);
  PYLLM_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "apply_token_bitmask", [&] {
    scalar_t* base = logits.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, kGrainElements / vocab);
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        mask_row(base + row_ids[i] * stride, words + i * num_words, num_words, vocab);
      }
    });
  });
}

}  // namespace pyllm::cpu
