// The argument contract of apply_token_bitmask, checked first by its CPU and CUDA
// implementations.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../check_utils.h"

namespace pyllm {

// logits [num_seqs, vocab] (rows packed, any row stride), bitmask int32 [n, words]
// contiguous, rows int64 [n]: all on one device.
inline void check_apply_token_bitmask(const at::Tensor& logits, const at::Tensor& bitmask,
                                      const at::Tensor& rows) {
  check_float_dtype("logits", logits);
  check_ndim("logits", logits, 2, "[num_seqs, vocab_size]");
  TORCH_CHECK_VALUE(logits.size(1) <= 1 || logits.stride(1) == 1,
                    "logits rows must be packed (stride 1 along the vocabulary)");
  check_dtype("bitmask", bitmask, at::kInt);
  check_ndim("bitmask", bitmask, 2, "[num_masked_rows, ceil(vocab_size / 32)]");
  check_contiguous("bitmask", bitmask);
  check_device("bitmask", bitmask, logits.device());
  check_dtype("rows", rows, at::kLong);
  check_ndim("rows", rows, 1, "[num_masked_rows]");
  check_contiguous("rows", rows);
  check_device("rows", rows, logits.device());
  TORCH_CHECK_VALUE(rows.size(0) == bitmask.size(0), "rows has ", rows.size(0),
                    " entries but bitmask has ", bitmask.size(0), " rows");
}

}  // namespace pyllm
