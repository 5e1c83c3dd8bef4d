// Paged attention on the CPU: decode (v1, v2) and causal prefill over the paged
// KV cache. (Prefill on AVX-512 CPUs, float32 and bfloat16, takes its own path,
// query rows in vector lanes: see prefill_lanes. What follows describes the rest.)
//
// One task handles one (sequence, kv head) pair -- for v2 one partition of it,
// for prefill one tile of query tokens -- and all the query heads that share
// that kv head ("rows"), so each K/V block is read from memory once per task
// and reused from L1 by every row. Tasks are claimed dynamically by
// at::parallel_for's threads since their costs differ with sequence length.
//
// Within a task, keys are visited in chunks of kPartitionSize tokens (one
// chunk is exactly one v2 partition). Per chunk:
//   1. logits: for each block, q . k for every row. A key block is
//      [D/x, block_size, x]: each x-group of 16 bytes holds x consecutive head
//      dimensions of one token, so one vector of keys holds a few tokens with
//      several head dimensions each. Each row's query is pre-tiled to match
//      ("q_tiled"), partial products accumulate lane-wise over the D/x groups,
//      and a few folds (vec::fold) then sum each token's lanes, leaving one
//      logit per lane for 16 consecutive tokens. bf16 keys meet a bf16 query
//      through vdpbf16ps where the CPU has it (see KeyOps).
//   2. softmax: the chunk's max per row, rescaling of what earlier chunks
//      accumulated (online softmax), p = exp(logit - max) in place.
//   3. values: a value block is [D, block_size], so head dimension d of 16
//      consecutive tokens is one vector. p[row] * v[d] accumulates lane-wise
//      (one lane per token) over the whole chunk, and the lanes are summed once
//      per chunk, so value rows are used as stored, without a transpose.
// Softmax and accumulation are float32; bf16/f16 are converted on load.
//
// Masking is by selection, never arithmetic: logits of keys a row may not see
// (past its causal limit, or cache slots past the sequence end, which may hold
// garbage including NaN) are replaced by -inf, and value lanes past the range
// are replaced by zeros. A sequence with seq_len 0 gets zeros in out.
//
// Memory: at long contexts decode reads each K/V byte once and does little
// arithmetic per byte, so the aim is to stream the cache near the machine's
// copy bandwidth; scattered blocks defeat the hardware prefetcher, hence the
// software prefetches in attend().
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../cpu_vec.h"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "sizes.h"

namespace pyllm::cpu {
namespace {

using vec::kLanes;
using vec::Vec16;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Row tiles of at most this many query rows share each loaded key vector
// (4 where a Vec16 takes two of AVX2's 16 registers).
constexpr int kMaxRowTile = vec::kRegisterVecs >= 16 ? 8 : 4;
// Logits of one row for one chunk, plus one vector of slack: the last token
// group's 16-lane store may reach past the chunk's last token.
constexpr int kLogitsStride = static_cast<int>(kPartitionSize) + kLanes;
// Prefill: query tokens per task are chosen so a task holds about this many rows
// (query tokens x query heads per kv head): enough rows to reuse each K/V block,
// few enough to leave tasks for both cores on short prompts.
constexpr int kPrefillRowsPerTask = 32;

// ---------------------------------------------------------------------------
// The cache and the per-call shapes every task shares.

template <typename scalar_t>
struct PagedCache {
  // x elements of one key make 16 bytes.
  static constexpr int kX = 16 / sizeof(scalar_t);

  const scalar_t* key_cache;    // [num_blocks, num_kv_heads, D / x, block_size, x]
  const scalar_t* value_cache;  // [num_blocks, num_kv_heads, D, block_size]
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq]
  int64_t max_blocks_per_seq;
  int num_kv_heads;
  int head_size;
  int block_size;
  // Contiguous layout (ops.h) when seq_slots is set: the caches are views
  // [max_num_seqs, num_kv_heads, num_tiles, <one block>] whose outer strides
  // (elements, the same for both caches) are chosen by the KV arena, and
  // "logical block" t of a sequence is tile t of its slot.
  const int32_t* seq_slots = nullptr;  // [num_seqs]
  int64_t slot_stride = 0, head_stride = 0, tile_stride = 0;

  // Offset of (physical block of the seq's logical block, kv_head) in either cache;
  // both caches hold head_size * block_size elements per (block, kv head).
  int64_t block_offset(int64_t seq, int kv_head, int64_t logical_block) const {
    if (seq_slots != nullptr) {
      return seq_slots[seq] * slot_stride + kv_head * head_stride + logical_block * tile_stride;
    }
    const int64_t physical = block_tables[seq * max_blocks_per_seq + logical_block];
    return (physical * num_kv_heads + kv_head) * int64_t(head_size) * block_size;
  }
};

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
  using QueryElem = c10::BFloat16;
};
constexpr bool kHavePairDot = true;
#else
constexpr bool kHavePairDot = false;
#endif

template <typename scalar_t>
struct KeyOps : KeyOpsImpl<scalar_t, kHavePairDot && std::is_same_v<scalar_t, c10::BFloat16>> {
  static constexpr int kX = PagedCache<scalar_t>::kX;
  // Lanes that hold partial sums of one token's logit.
  static constexpr int kLanesPerToken = kX * kLanes / KeyOps::kElems;
};

// Query rows a task attends together, and their softmax state. Row-major
// arrays of `count` rows.
struct Rows {
  int count = 0;
  int head_size = 0;
  float scale = 1.0f;            // applied to q . k before the alibi bias
  std::vector<float> q_tiled;    // [count][D/x][64 bytes]: q's x-groups repeated (KeyOps)
  std::vector<int> last_key;     // [count] last key position the row attends (inclusive)
  std::vector<int> query_pos;    // [count] position of the row's query token (for alibi)
  std::vector<float> alibi;      // [count] slope, or empty when there is no alibi
  std::vector<float> max_logit;  // [count] running max of the logits seen
  std::vector<float> exp_sum;    // [count] running sum of exp(logit - max_logit)
  std::vector<float> acc;        // [count][D] running sum of exp(logit - max_logit) * v

  void reset(int rows, int head_size_, int x, float scale_, bool with_alibi) {
    count = rows;
    head_size = head_size_;
    scale = scale_;
    q_tiled.resize(size_t(rows) * (head_size / x) * kLanes);
    last_key.resize(rows);
    query_pos.resize(rows);
    alibi.resize(with_alibi ? rows : 0);
    max_logit.assign(rows, kNegInf);
    exp_sum.assign(rows, 0.0f);
    acc.assign(size_t(rows) * head_size, 0.0f);
  }

  // Loads row r's query (head_size packed elements), each x-group repeated to
  // fill the 64 bytes that meet one key vector (copied bytewise: the buffer
  // is float storage, the elements may be bf16).
  template <typename scalar_t>
  void set_query(int r, const scalar_t* q) {
    using Ops = KeyOps<scalar_t>;
    using Elem = typename Ops::QueryElem;
    constexpr int x = Ops::kX;
    static_assert(Ops::kElems * sizeof(Elem) == kLanes * sizeof(float));
    float* dst = &q_tiled[size_t(r) * (head_size / x) * kLanes];
    for (int c = 0; c < head_size / x; ++c) {
      Elem tile[Ops::kElems];
      for (int i = 0; i < Ops::kElems; ++i) tile[i] = static_cast<Elem>(q[c * x + i % x]);
      std::memcpy(dst + c * kLanes, tile, sizeof(tile));
    }
  }
};

// Per-thread scratch, reused across the tasks a thread runs.
struct Workspace {
  Rows rows;
  std::vector<float> logits;  // [rows][kLogitsStride]

  void reserve_scratch(int num_rows) { logits.resize(size_t(num_rows) * kLogitsStride); }
};

// ---------------------------------------------------------------------------
// Step 1: logits.

// Sums each token's L lanes of `wide` (n vectors, 16/L tokens each, tokens in
// order) into one vector holding one logit per token.
template <int L>
inline Vec16 fold_to_tokens(Vec16* wide, int n) {
  auto level = [&](auto fold_k) {
    int m = 0;
    for (int i = 0; i < n; i += 2)
      wide[m++] = fold_k(wide[i], i + 1 < n ? wide[i + 1] : Vec16::zero());
    n = m;
  };
  if constexpr (L >= 8) level([](Vec16 a, Vec16 b) { return vec::fold<8>(a, b); });
  if constexpr (L >= 4) level([](Vec16 a, Vec16 b) { return vec::fold<4>(a, b); });
  level([](Vec16 a, Vec16 b) { return vec::fold<2>(a, b); });
  return wide[0];
}

// Token-group vectors accumulated at once by a tile of RT rows: RT * NV
// independent multiply-add chains hide the FMA latency, and the RT * NV
// accumulators, NV keys and a query vector still fit in the registers.
constexpr int vecs_in_flight(int rows, int vecs) {
  int nv = 1;
  while (nv * 2 * rows <= vec::kRegisterVecs / 2 && nv * 2 <= vecs) nv *= 2;
  return nv;
}

// Logits of rows [r0, r0 + RT) for one token group: VECS vectors of key
// partial sums, 16 tokens (8 when block_size is 8) starting at `key` (key
// block + token offset * x). Written as 16 lanes at logits[row][offset], lanes
// past each row's limit -inf.
template <typename scalar_t, int RT, int VECS>
void qk_row_tile(const scalar_t* key, int block_size, int first_pos, int offset, int r0, Rows& rows,
                 float* logits) {
  using Ops = KeyOps<scalar_t>;
  constexpr int X = Ops::kX;
  constexpr int kTokens = VECS * kLanes / Ops::kLanesPerToken;
  constexpr int NV = vecs_in_flight(RT, VECS);
  const int num_groups = rows.head_size / X;
  const int64_t key_group_stride = int64_t(block_size) * X;  // elements between x-groups
  const size_t q_row_stride = size_t(num_groups) * kLanes;   // floats
  const float* q_tile = &rows.q_tiled[r0 * q_row_stride];
  Vec16 wide[RT][VECS];
  for (int v0 = 0; v0 < VECS; v0 += NV) {
    Vec16 acc[RT][NV];
    for (auto& row : acc) {
      for (auto& a : row) a = Vec16::zero();
    }
    const scalar_t* k = key + v0 * Ops::kElems;
    const float* q = q_tile;
    for (int c = 0; c < num_groups; ++c, k += key_group_stride, q += kLanes) {
      typename Ops::KeyVec kv[NV];
      for (int n = 0; n < NV; ++n) kv[n] = Ops::load_key(k + n * Ops::kElems);
      for (int r = 0; r < RT; ++r) {
        const auto qr = Ops::load_query(q + r * q_row_stride);
        for (int n = 0; n < NV; ++n) acc[r][n] = Ops::fma(acc[r][n], kv[n], qr);
      }
    }
    for (int r = 0; r < RT; ++r) {
      for (int n = 0; n < NV; ++n) wide[r][v0 + n] = acc[r][n];
    }
  }
  const Vec16 scale = Vec16::set1(rows.scale);
  for (int r = 0; r < RT; ++r) {
    const int row = r0 + r;
    Vec16 logit = fold_to_tokens<Ops::kLanesPerToken>(wide[r], VECS) * scale;
    if (!rows.alibi.empty()) {
      // bias = slope * (key_pos - query_pos), key_pos = first_pos + lane.
      const float slope = rows.alibi[row];
      logit =
          Vec16::fmadd(Vec16::set1(slope),
                       Vec16::iota() + Vec16::set1(float(first_pos - rows.query_pos[row])), logit);
    }
    const int visible = std::clamp(rows.last_key[row] - first_pos + 1, 0, kTokens);
    logit.keep_first(visible, kNegInf).store(logits + size_t(row) * kLogitsStride + offset);
  }
}

template <typename scalar_t, int VECS>
void qk_all_rows(const scalar_t* key, int block_size, int first_pos, int offset, Rows& rows,
                 float* logits) {
  int r = 0;
  for (; r + kMaxRowTile <= rows.count; r += kMaxRowTile) {
    qk_row_tile<scalar_t, kMaxRowTile, VECS>(key, block_size, first_pos, offset, r, rows, logits);
  }
#define PYLLM_QK_TAIL(N)                                                                 \
  case N:                                                                                \
    qk_row_tile<scalar_t, N, VECS>(key, block_size, first_pos, offset, r, rows, logits); \
    break;
  switch (rows.count - r) {
    PYLLM_QK_TAIL(1)
    PYLLM_QK_TAIL(2)
    PYLLM_QK_TAIL(3)
    PYLLM_QK_TAIL(4)
    PYLLM_QK_TAIL(5)
    PYLLM_QK_TAIL(6)
    PYLLM_QK_TAIL(7)
    default:
      break;
  }
#undef PYLLM_QK_TAIL
}

// ---------------------------------------------------------------------------
// Step 2: softmax over one chunk, merged into the running state.

// Turns rows' logits[0, n) into p = exp(logit - new_max) in place and folds the
// chunk into each row's running (max_logit, exp_sum, acc).
void softmax_chunk(Rows& rows, float* logits, int n) {
  const int padded = (n + kLanes - 1) / kLanes * kLanes;  // lanes past n hold -inf
  for (int r = 0; r < rows.count; ++r) {
    float* p = logits + size_t(r) * kLogitsStride;
    Vec16 vmax = Vec16::set1(kNegInf);
    for (int i = 0; i < padded; i += kLanes) vmax = Vec16::max(vmax, Vec16::load(p + i));
    const float chunk_max = vmax.reduce_max();
    if (chunk_max == kNegInf) {
      // The row sees no key in this chunk (causal prefill): nothing to add.
      std::fill(p, p + padded, 0.0f);
      continue;
    }
    const float old_max = rows.max_logit[r];
    const float new_max = std::max(old_max, chunk_max);
    if (new_max != old_max && old_max != kNegInf) {
      const float alpha = std::exp(old_max - new_max);
      rows.exp_sum[r] *= alpha;
      float* acc = &rows.acc[size_t(r) * rows.head_size];
      for (int d = 0; d < rows.head_size; ++d) acc[d] *= alpha;
    }
    rows.max_logit[r] = new_max;
    const Vec16 shift = Vec16::set1(new_max);
    Vec16 sum = Vec16::zero();
    for (int i = 0; i < padded; i += kLanes) {
      const Vec16 e = (Vec16::load(p + i) - shift).exp();
      e.store(p + i);
      sum = sum + e;
    }
    rows.exp_sum[r] += sum.reduce_add();
  }
}

// ---------------------------------------------------------------------------
// Step 3: values.

// Where the value rows of a chunk's 16-token groups start. A value block is
// [D, block_size], so head dimension d of 16 consecutive tokens is 16
// contiguous elements when block_size >= 16, and two 8-element halves from
// consecutive blocks when block_size is 8.
template <typename scalar_t>
struct ValueGroups {
  static constexpr int kMaxGroups = int(kPartitionSize) / kLanes;
  const scalar_t* lo[kMaxGroups];
  // block_size 8: the second half's block. Past the chunk's end it repeats lo
  // (any readable memory does: those lanes are masked).
  const scalar_t* hi[kMaxGroups];
  int count = 0;
  int last_tokens = 0;  // valid tokens in the last group (1..16)
  int row_stride = 0;   // elements between head dimensions d and d + 1: block_size

  void build(const PagedCache<scalar_t>& cache, int64_t seq, int kv_head, int chunk, int n) {
    const int bs = cache.block_size;
    count = (n + kLanes - 1) / kLanes;
    last_tokens = n - (count - 1) * kLanes;
    row_stride = bs;
    for (int g = 0; g < count; ++g) {
      const int tok = chunk + g * kLanes;
      lo[g] = cache.value_cache + cache.block_offset(seq, kv_head, tok / bs) + tok % bs;
      hi[g] = bs < kLanes && tok + bs < chunk + n
                  ? cache.value_cache + cache.block_offset(seq, kv_head, tok / bs + 1)
                  : lo[g];
    }
  }
};

// Horizontal sums of w[0..n) (n <= 16): lane k of the result is the sum of w[k]'s lanes.
inline Vec16 sum_each(Vec16* w, int n) {
  auto level = [&](auto fold_k) {
    int m = 0;
    for (int i = 0; i < n; i += 2) w[m++] = fold_k(w[i], i + 1 < n ? w[i + 1] : Vec16::zero());
    n = m;
  };
  level([](Vec16 a, Vec16 b) { return vec::fold<16>(a, b); });
  level([](Vec16 a, Vec16 b) { return vec::fold<8>(a, b); });
  level([](Vec16 a, Vec16 b) { return vec::fold<4>(a, b); });
  level([](Vec16 a, Vec16 b) { return vec::fold<2>(a, b); });
  return w[0];
}

// Prefetches a list of cache blocks into L2 a few lines per call, so that
// loading the next chunk's keys overlaps the value pass's arithmetic instead
// of stalling on a burst of misses.
struct LinePrefetcher {
  static constexpr int kMaxBlocks = int(kPartitionSize) / 8;
  const char* blocks[kMaxBlocks];
  int num_blocks = 0;
  int64_t block_bytes = 0;
  int block = 0;
  int64_t byte = 0;

  void issue(int lines) {
    // Locals, not members, in the loop: the compiler cannot keep members in
    // registers across the prefetches.
    int b = block;
    int64_t offset = byte;
    for (; lines > 0 && b < num_blocks; --lines) {
      vec::prefetch_l2(blocks[b] + offset);
      offset += 64;
      if (offset >= block_bytes) {
        offset = 0;
        ++b;
      }
    }
    block = b;
    byte = offset;
  }
};

// Head dimensions handled together in the value pass, per row tile of kValueRows:
// kValueDims * kValueRows accumulators, kValueRows weights and a value vector
// stay in registers (AVX2: 2 x 2, measured no slower than 1 x 4 or 4 x 1).
constexpr int kValueDims = vec::kRegisterVecs >= 16 ? 4 : 2;
constexpr int kValueRows = vec::kRegisterVecs >= 16 ? 4 : 2;
// Token groups walked together (value blocks, for block_size 16): fewer than
// the 12 ways of an L1 set (see pv_row_tile).
constexpr int kValueGroupsPerPass = 8;

// acc[row][d] += sum_t p[row][t] * v[t][d] over the chunk, rows [r0, r0 + RT).
// Products accumulate lane-wise (one lane per token of a group) over all of
// the chunk's groups and are summed across lanes once at the end, so value
// rows are used as stored, without transposing.
template <typename scalar_t, int RT, bool kHalves>
void pv_row_tile(const ValueGroups<scalar_t>& groups, int r0, Rows& rows, const float* logits,
                 LinePrefetcher& ahead, int lines_per_step) {
  const int64_t stride = groups.row_stride;
  const float* p[RT];
  for (int r = 0; r < RT; ++r) p[r] = logits + size_t(r0 + r) * kLogitsStride;
  // Groups in passes of kValueGroupsPerPass: every group's value block sits at
  // the same offset modulo 4 KiB, so walking all of a chunk's blocks in step
  // would map them to the same few L1 sets and evict each other.
  for (int g0 = 0; g0 < groups.count; g0 += kValueGroupsPerPass) {
    const int g1 = std::min(groups.count, g0 + kValueGroupsPerPass);
    for (int d0 = 0; d0 < rows.head_size; d0 += kValueDims) {
      ahead.issue(lines_per_step);
      // Accumulators indexed only by constants, so they stay in registers;
      // sum_each works on a copy.
      Vec16 wide[RT * kValueDims];
      for (auto& w : wide) w = Vec16::zero();
      auto accumulate = [&](int g, auto masked) {
        Vec16 pg[RT];
        for (int r = 0; r < RT; ++r) pg[r] = Vec16::load(p[r] + g * kLanes);
        const scalar_t* lo = groups.lo[g] + d0 * stride;
        const scalar_t* hi = groups.hi[g] + d0 * stride;
        for (int j = 0; j < kValueDims; ++j) {
          Vec16 v = kHalves ? Vec16::load_halves(lo + j * stride, hi + j * stride)
                            : Vec16::load(lo + j * stride);
          // Lanes past the chunk's end are zeroed by selection: the cache may
          // hold anything there, and 0 * NaN would not vanish.
          if constexpr (decltype(masked)::value) v = v.keep_first(groups.last_tokens, 0.0f);
          for (int r = 0; r < RT; ++r) {
            wide[r * kValueDims + j] = Vec16::fmadd(pg[r], v, wide[r * kValueDims + j]);
          }
        }
      };
      for (int g = g0; g < g1; ++g) {
        if (g + 1 < groups.count) {
          accumulate(g, std::false_type{});
        } else {
          accumulate(g, std::true_type{});
        }
      }
      Vec16 folded[RT * kValueDims];
      std::copy(wide, wide + RT * kValueDims, folded);
      alignas(64) float sums[kLanes];
      sum_each(folded, RT * kValueDims).store(sums);
      for (int r = 0; r < RT; ++r) {
        float* acc = &rows.acc[size_t(r0 + r) * rows.head_size + d0];
        for (int j = 0; j < kValueDims; ++j) acc[j] += sums[r * kValueDims + j];
      }
    }
  }
}

// `ahead` is prefetched during the first row tile's first pass over the groups.
template <typename scalar_t, bool kHalves>
void pv_all_rows(const ValueGroups<scalar_t>& groups, Rows& rows, const float* logits,
                 LinePrefetcher& ahead) {
  const int steps = rows.head_size / kValueDims;
  const int lines_per_step = int((ahead.num_blocks * ahead.block_bytes / 64 + steps - 1) / steps);
  int r = 0;
  for (; r + kValueRows <= rows.count; r += kValueRows) {
    pv_row_tile<scalar_t, kValueRows, kHalves>(groups, r, rows, logits, ahead, lines_per_step);
  }
  switch (rows.count - r) {
    case 1:
      pv_row_tile<scalar_t, 1, kHalves>(groups, r, rows, logits, ahead, lines_per_step);
      break;
    case 2:
      pv_row_tile<scalar_t, 2, kHalves>(groups, r, rows, logits, ahead, lines_per_step);
      break;
    case 3:
      pv_row_tile<scalar_t, 3, kHalves>(groups, r, rows, logits, ahead, lines_per_step);
      break;
    default:
      break;
  }
}

// ---------------------------------------------------------------------------
// One task: rows of one (seq, kv_head) over keys [t_begin, t_end).

template <typename scalar_t>
void prefetch_block(const scalar_t* block, int64_t elements, bool to_l1) {
  const char* p = reinterpret_cast<const char*>(block);
  for (int64_t byte = 0; byte < elements * int64_t(sizeof(scalar_t)); byte += 64) {
    if (to_l1) {
      vec::prefetch_l1(p + byte);
    } else {
      vec::prefetch_l2(p + byte);
    }
  }
}

// The keys [t_begin, t_end) of (seq, kv_head) a task reads; seq < 0 for none.
struct KeyRange {
  int64_t seq = -1;
  int kv_head = 0;
  int t_begin = 0;
  int t_end = 0;
};

// t_begin is a multiple of kPartitionSize; every row's last_key is < t_end.
// Memory: cache blocks are scattered, which defeats the hardware prefetcher at
// every block, so the key pass prefetches the key block two ahead (to L1) and
// the value block of the same position (to L2, for the value pass), and the
// value pass trickles the next chunk's key blocks into L2 -- after the last
// chunk, those of the task this thread runs next (`after`). That balances
// memory traffic between the passes (measured: decode at 67 MB of bf16 cache,
// one thread, ~10 -> ~11.5 GB/s).
template <typename scalar_t>
void attend(const PagedCache<scalar_t>& cache, int64_t seq, int kv_head, int t_begin, int t_end,
            const KeyRange& after, Workspace& ws) {
  constexpr int X = PagedCache<scalar_t>::kX;
  constexpr int kKeyAhead = 2;
  const int bs = cache.block_size;
  const int64_t block_elems = int64_t(cache.head_size) * bs;
  const int group = std::min(bs, kLanes);  // tokens per logits vector
  Rows& rows = ws.rows;
  ws.reserve_scratch(rows.count);
  float* logits = ws.logits.data();
  auto key_block = [&](int tok) {
    return cache.key_cache + cache.block_offset(seq, kv_head, tok / bs);
  };
  auto value_block = [&](int tok) {
    return cache.value_cache + cache.block_offset(seq, kv_head, tok / bs);
  };
  ValueGroups<scalar_t> groups;

  for (int chunk = t_begin; chunk < t_end; chunk += kPartitionSize) {
    const int chunk_end = std::min<int>(t_end, chunk + kPartitionSize);
    if (chunk == t_begin) {
      for (int i = 0; i < kKeyAhead && chunk + i * bs < chunk_end; ++i) {
        prefetch_block(key_block(chunk + i * bs), block_elems, true);
      }
    }
    for (int start = chunk; start < chunk_end; start += bs) {
      if (start + kKeyAhead * bs < chunk_end) {
        prefetch_block(key_block(start + kKeyAhead * bs), block_elems, true);
      }
      prefetch_block(value_block(start), block_elems, false);
      const scalar_t* key = key_block(start);
      const int end = std::min(chunk_end, start + bs);
      for (int tok = start; tok < end; tok += group) {
        // 16 tokens make kLanesPerToken key vectors; 8 tokens (block_size 8) half as many.
        constexpr int kVecs = KeyOps<scalar_t>::kLanesPerToken;  // per 16 tokens
        if (bs >= kLanes) {
          qk_all_rows<scalar_t, kVecs>(key + (tok - start) * X, bs, tok, tok - chunk, rows, logits);
        } else {
          qk_all_rows<scalar_t, kVecs / 2>(key, bs, tok, tok - chunk, rows, logits);
        }
      }
    }
    softmax_chunk(rows, logits, chunk_end - chunk);
    // The key blocks of the next chunk, of this task or the next one.
    const KeyRange next = chunk_end < t_end ? KeyRange{seq, kv_head, chunk_end, t_end} : after;
    LinePrefetcher next_keys;
    next_keys.block_bytes = block_elems * int64_t(sizeof(scalar_t));
    if (next.seq >= 0) {
      const int next_end = std::min<int>(next.t_end, next.t_begin + kPartitionSize);
      for (int start = next.t_begin; start < next_end; start += bs) {
        next_keys.blocks[next_keys.num_blocks++] = reinterpret_cast<const char*>(
            cache.key_cache + cache.block_offset(next.seq, next.kv_head, start / bs));
      }
    }
    groups.build(cache, seq, kv_head, chunk, chunk_end - chunk);
    if (bs >= kLanes) {
      pv_all_rows<scalar_t, false>(groups, rows, logits, next_keys);
    } else {
      pv_all_rows<scalar_t, true>(groups, rows, logits, next_keys);
    }
  }
}

// Writes row r's normalized output (zeros when it saw no key).
template <typename scalar_t>
void store_row(const Rows& rows, int r, scalar_t* out) {
  const float sum = rows.exp_sum[r];
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  const float* acc = &rows.acc[size_t(r) * rows.head_size];
  for (int d = 0; d < rows.head_size; ++d) out[d] = vec::from_float<scalar_t>(acc[d] * inv);
}

// ---------------------------------------------------------------------------
// Scheduling.

// Query rows x key tokens below which a call runs on the calling thread alone
// (about 8K products of head_size 64..128: tens of microseconds, the order of
// waking a sleeping OpenMP worker on a busy machine).
constexpr int64_t kMinParallelWork = 8192;

// Runs task(i, following, workspace) for i in [0, num_tasks) on
// at::parallel_for's threads; each thread claims the next unclaimed task, so
// tasks of different cost (listed longest first) spread evenly. `following`
// is the task the same thread runs next (claimed one ahead so that its first
// keys can be prefetched), or -1.
template <typename F>
void run_tasks(int64_t num_tasks, const F& task, int64_t work = kMinParallelWork) {
  if (num_tasks == 0) return;
  std::atomic<int64_t> next{0};
  // A tiny call (a short decode) finishes faster on this thread than it takes to wake
  // another: at::parallel_for over one worker runs inline.
  const int64_t workers =
      work < kMinParallelWork ? 1 : std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Workspace ws;
    for (int64_t i = next.fetch_add(1); i < num_tasks;) {
      const int64_t following = next.fetch_add(1);
      task(i, following < num_tasks ? following : -1, ws);
      i = following;
    }
  });
}

// ---------------------------------------------------------------------------
// Argument checks: what a direct torch.ops call could otherwise turn into an
// out-of-bounds access. pyllm/ops.py checks the rest with friendlier messages.

struct AttentionShape {
  int64_t num_tokens, num_heads, head_size, num_kv_heads, block_size, num_blocks;
};

AttentionShape check_attention(const char* op, const at::Tensor& out, const at::Tensor& query,
                               const at::Tensor& key_cache, const at::Tensor& value_cache,
                               int64_t num_kv_heads, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, int64_t block_size,
                               const std::optional<at::Tensor>& alibi_slopes) {
  for (const at::Tensor* t : {&out, &query, &key_cache, &value_cache, &block_tables, &seq_lens}) {
    TORCH_CHECK(t->device().is_cpu(), op, ": all tensors must be on the CPU, got ", t->device());
  }
  TORCH_CHECK(query.dim() == 3, op, ": query must be [num_tokens, num_heads, head_size], got ",
              query.sizes());
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  TORCH_CHECK(
      (num_heads <= 1 || query.stride(1) == head_size) && (head_size <= 1 || query.stride(2) == 1),
      op, ": each query token's [num_heads, head_size] must be packed, got strides ",
      query.strides());
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), op,
              ": out must be contiguous with the query's shape ", query.sizes());
  const auto dtype = query.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype && key_cache.scalar_type() == dtype &&
                  value_cache.scalar_type() == dtype,
              op, ": out, key_cache and value_cache must have the query's dtype ", dtype);
  TORCH_CHECK(is_listed(kHeadSizes, head_size), op, ": unsupported head_size ", head_size,
              " (supported: ", list_text(kHeadSizes), ")");
  TORCH_CHECK(is_listed(kBlockSizes, block_size), op, ": unsupported block_size ", block_size,
              " (supported: ", list_text(kBlockSizes), ")");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, op, ": num_kv_heads ",
              num_kv_heads, " must divide num_heads ", num_heads);
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), op,
              ": key_cache and value_cache must be contiguous");
  TORCH_CHECK(value_cache.dim() == 4 && value_cache.size(1) == num_kv_heads &&
                  value_cache.size(2) == head_size && value_cache.size(3) == block_size,
              op, ": value_cache must be [num_blocks, ", num_kv_heads, ", ", head_size, ", ",
              block_size, "], got ", value_cache.sizes());
  const int64_t num_blocks = value_cache.size(0);
  const int64_t x = 16 / int64_t(query.element_size());
  TORCH_CHECK(key_cache.dim() == 5 && key_cache.size(0) == num_blocks &&
                  key_cache.size(1) == num_kv_heads && key_cache.size(2) == head_size / x &&
                  key_cache.size(3) == block_size && key_cache.size(4) == x,
              op, ": key_cache must be [", num_blocks, ", ", num_kv_heads, ", ", head_size / x,
              ", ", block_size, ", ", x, "], got ", key_cache.sizes());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.is_contiguous(),
              op, ": block_tables must be a contiguous 2-D int32 tensor");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous() && seq_lens.size(0) == block_tables.size(0),
              op, ": seq_lens must be a contiguous int32 [num_seqs] matching block_tables, got ",
              seq_lens.sizes());
  if (alibi_slopes.has_value()) {
    const at::Tensor& a = *alibi_slopes;
    TORCH_CHECK(a.device().is_cpu() && a.scalar_type() == at::kFloat && a.dim() == 1 &&
                    a.size(0) == num_heads && a.is_contiguous(),
                op, ": alibi_slopes must be a contiguous float32 [", num_heads, "] CPU tensor");
  }
  return {num_tokens, num_heads, head_size, num_kv_heads, block_size, num_blocks};
}

// Reads seq_lens and the used block_tables entries once (a few microseconds)
// so that no task can index outside the cache or the outputs.
void check_block_tables(const char* op, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        const AttentionShape& shape, int64_t max_seq_len) {
  const int64_t num_seqs = seq_lens.size(0), max_blocks = block_tables.size(1);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 0 && lens[s] <= max_seq_len && lens[s] <= max_blocks * shape.block_size,
                op, ": seq_lens[", s, "] = ", lens[s], " is outside [0, ",
                std::min(max_seq_len, max_blocks * shape.block_size), "]");
    const int64_t used = (lens[s] + shape.block_size - 1) / shape.block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int32_t block = tables[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < shape.num_blocks, op, ": block_tables[", s, ", ", b,
                  "] = ", block, " is outside [0, ", shape.num_blocks, ")");
    }
  }
}

template <typename scalar_t>
PagedCache<scalar_t> make_cache(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& block_tables, const AttentionShape& shape) {
  return {key_cache.data_ptr<scalar_t>(),
          value_cache.data_ptr<scalar_t>(),
          block_tables.data_ptr<int32_t>(),
          block_tables.size(1),
          int(shape.num_kv_heads),
          int(shape.head_size),
          int(shape.block_size)};
}

// The contiguous layout's addressing: each sequence's slot and the views' outer
// strides (elements). capacity = num_tiles * kTokenTile, the most tokens a slot holds.
struct SlotAddressing {
  const int32_t* seq_slots;
  int64_t num_slots, capacity;
  int64_t slot_stride, head_stride, tile_stride;
};

void check_addressing(const char* op, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      const AttentionShape& shape, int64_t max_seq_len) {
  check_block_tables(op, block_tables, seq_lens, shape, max_seq_len);
}

// Reads seq_slots and seq_lens once so that no task reads outside the views.
void check_addressing(const char* op, const SlotAddressing& slots, const at::Tensor& seq_lens,
                      const AttentionShape&, int64_t max_seq_len) {
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t limit = std::min(max_seq_len, slots.capacity);
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    TORCH_CHECK(slots.seq_slots[s] >= 0 && slots.seq_slots[s] < slots.num_slots, op,
                ": seq_slots[", s, "] = ", slots.seq_slots[s], " is outside [0, ",
                slots.num_slots, ")");
    TORCH_CHECK(lens[s] >= 0 && lens[s] <= limit, op, ": seq_lens[", s, "] = ", lens[s],
                " is outside [0, ", limit, "]");
  }
}

template <typename scalar_t>
PagedCache<scalar_t> make_cache(const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const SlotAddressing& slots, const AttentionShape& shape) {
  PagedCache<scalar_t> cache{key_cache.data_ptr<scalar_t>(),
                             value_cache.data_ptr<scalar_t>(),
                             nullptr,
                             0,
                             int(shape.num_kv_heads),
                             int(shape.head_size),
                             int(kTokenTile)};
  cache.seq_slots = slots.seq_slots;
  cache.slot_stride = slots.slot_stride;
  cache.head_stride = slots.head_stride;
  cache.tile_stride = slots.tile_stride;
  return cache;
}

// The contiguous views (ops.h): key_cache [max_num_seqs, num_kv_heads, num_tiles,
// head_size / x, kTokenTile, x], value_cache [max_num_seqs, num_kv_heads, num_tiles,
// head_size, kTokenTile], the inner dimensions dense, the outer strides free but the
// same for both caches (the kernels address one tile of either with one offset).
SlotAddressing check_contiguous_cache(const char* op, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, int64_t num_kv_heads,
                                      int64_t head_size, at::ScalarType dtype,
                                      const at::Tensor& seq_slots) {
  TORCH_CHECK(key_cache.device().is_cpu() && value_cache.device().is_cpu() &&
                  seq_slots.device().is_cpu(),
              op, ": key_cache, value_cache and seq_slots must be CPU tensors");
  TORCH_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype, op,
              ": key_cache and value_cache must have dtype ", dtype);
  const int64_t x = 16 / int64_t(c10::elementSize(dtype));
  TORCH_CHECK(value_cache.dim() == 5 && value_cache.size(1) == num_kv_heads &&
                  value_cache.size(3) == head_size && value_cache.size(4) == kTokenTile,
              op, ": value_cache must be [max_num_seqs, ", num_kv_heads, ", num_tiles, ",
              head_size, ", ", kTokenTile, "], got ", value_cache.sizes());
  const int64_t num_slots = value_cache.size(0), num_tiles = value_cache.size(2);
  TORCH_CHECK(key_cache.dim() == 6 && key_cache.size(0) == num_slots &&
                  key_cache.size(1) == num_kv_heads && key_cache.size(2) == num_tiles &&
                  key_cache.size(3) == head_size / x && key_cache.size(4) == kTokenTile &&
                  key_cache.size(5) == x,
              op, ": key_cache must be [", num_slots, ", ", num_kv_heads, ", ", num_tiles, ", ",
              head_size / x, ", ", kTokenTile, ", ", x, "], got ", key_cache.sizes());
  TORCH_CHECK(key_cache.stride(5) == 1 && key_cache.stride(4) == x &&
                  key_cache.stride(3) == kTokenTile * x && value_cache.stride(4) == 1 &&
                  value_cache.stride(3) == kTokenTile,
              op, ": each tile of key_cache and value_cache must be dense, got strides ",
              key_cache.strides(), " and ", value_cache.strides());
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(key_cache.stride(d) == value_cache.stride(d) && key_cache.stride(d) >= 0, op,
                ": key_cache and value_cache must share their (slot, kv head, tile) strides, got ",
                key_cache.strides(), " and ", value_cache.strides());
  }
  TORCH_CHECK(seq_slots.scalar_type() == at::kInt && seq_slots.dim() == 1 &&
                  seq_slots.is_contiguous(),
              op, ": seq_slots must be a contiguous 1-D int32 tensor, got ", seq_slots.sizes());
  return {seq_slots.data_ptr<int32_t>(), num_slots,      num_tiles * kTokenTile,
          key_cache.stride(0),           key_cache.stride(1), key_cache.stride(2)};
}

// Query, out and seq_lens of the contiguous ops (the caches: check_contiguous_cache).
AttentionShape check_contiguous_attention(const char* op, const at::Tensor& out,
                                          const at::Tensor& query, int64_t num_kv_heads,
                                          const at::Tensor& seq_slots,
                                          const at::Tensor& seq_lens, int64_t num_seqs) {
  TORCH_CHECK(query.dim() == 3, op, ": query must be [num_tokens, num_heads, head_size], got ",
              query.sizes());
  const int64_t x = 16 / int64_t(query.element_size());
  TORCH_CHECK(out.device().is_cpu() && query.device().is_cpu() && seq_lens.device().is_cpu(), op,
              ": all tensors must be on the CPU");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  TORCH_CHECK(
      (num_heads <= 1 || query.stride(1) == head_size) && (head_size <= 1 || query.stride(2) == 1),
      op, ": each query token's [num_heads, head_size] must be packed, got strides ",
      query.strides());
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), op,
              ": out must be contiguous with the query's shape ", query.sizes());
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), op, ": out must have the query's dtype");
  TORCH_CHECK(is_listed(kHeadSizes, head_size), op, ": unsupported head_size ", head_size,
              " (supported: ", list_text(kHeadSizes), ")");
  TORCH_CHECK(head_size % x == 0, op, ": head_size must be a multiple of x = ", x);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, op, ": num_kv_heads ",
              num_kv_heads, " must divide num_heads ", num_heads);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous() && seq_lens.size(0) == num_seqs &&
                  seq_slots.dim() == 1 && seq_slots.size(0) == num_seqs,
              op, ": seq_slots and seq_lens must be contiguous int32 [num_seqs = ", num_seqs,
              "], got ", seq_slots.sizes(), " and ", seq_lens.sizes());
  return {num_tokens, num_heads, head_size, num_kv_heads, kTokenTile, 0};
}

// Sets up the decode rows of (seq, kv_head): its group of query heads, all at
// position seq_len - 1, limited to keys before t_end.
template <typename scalar_t>
void decode_rows(Rows& rows, const scalar_t* query, int64_t query_token_stride, int64_t seq,
                 int kv_head, int group, int head_size, float scale, const float* alibi,
                 int seq_len, int t_end) {
  constexpr int X = PagedCache<scalar_t>::kX;
  rows.reset(group, head_size, X, scale, alibi != nullptr);
  const scalar_t* q = query + seq * query_token_stride + int64_t(kv_head) * group * head_size;
  for (int g = 0; g < group; ++g) {
    rows.set_query(g, q + g * head_size);
    rows.query_pos[g] = seq_len - 1;
    rows.last_key[g] = std::min(seq_len, t_end) - 1;
    if (alibi) rows.alibi[g] = alibi[kv_head * group + g];
  }
}

int num_partitions(int seq_len) { return int((seq_len + kPartitionSize - 1) / kPartitionSize); }

// ---------------------------------------------------------------------------
// Prefill on AVX-512, float32 and bfloat16 (with AVX512-BF16): query rows in
// vector lanes.
//
// A prefill task has many query rows per kv head (query tokens x the heads
// sharing it), so it works like two small GEMMs instead of the per-row dot
// products above. A task holds up to kLaneRows consecutive rows of one (seq,
// kv head), row r of the sequence being (query token r / group, head r % group),
// one row per lane of RV vectors, and walks its keys in tiles of kKeyTile
// tokens. It works on the cache's 32-bit words as stored (LaneWords): a bf16
// pair, multiplied pairwise by vdpbf16ps (exact products, float32 sums), or one
// float, multiplied by an FMA.
//   1. logits s[t] = q . k[t] for the tile's 16 tokens: the query is packed once
//      per task as words [D/elements per word][RV][16 lanes] (lane = row), and
//      each word of a key token (an x-group of the key block [D/x, block_size,
//      x] is 16 bytes, 4 words) is broadcast and meets the query's word.
//   2. online softmax per lane, in base 2 (logits times scale * log2 e): the
//      tile's max and sum are plain vector ops over the 16 tokens (no
//      horizontal reductions), with causal masking by selection (key position
//      <= the lane's query position) on the tiles that cross a row's limit.
//      Tiles past every row's limit are never read.
//   3. values: p is made words of the dtype (bf16: tokens 2i, 2i + 1 rounded
//      and paired) and meets the value block's words ([D, block_size]: bf16
//      (v[2i][d], v[2i + 1][d]), or v[i][d]) broadcast per head dimension,
//      accumulating the output as [D][RV][16 lanes] float32.
// No key or value is repacked: the broadcasts read the cache as stored. The
// tile that holds the task's last key is copied into a zero-padded local tile
// first, so that no slot past the sequence (which may hold NaN, or sit in a
// block the sequence does not own) is ever read. Only the query (in) and the
// output (out) are transposed, 16 x 16 words at a time.
// float16, bfloat16 without AVX512-BF16 and everything without AVX-512 keep the
// design above.
#ifdef __AVX512F__

constexpr int kLaneRows = 2 * kLanes;  // rows per task: RV <= 2 vectors
constexpr int kKeyTile = 16;           // key tokens per tile
// Tokens of a tile that always share a cache block (block_size is a multiple of 8).
constexpr int kHalfTile = kKeyTile / 2;

// How the lane rows meet a dtype's 32-bit words (vec::WordOps), and the two
// conversions between words and the float32 rows of the softmax and output.
template <typename T>
struct LaneWords;

template <>
struct LaneWords<float> : vec::WordOps<float> {
  // The probabilities of word i's tokens for one row vector (token i).
  static Operand p_word(const Vec16* p_tokens, int i) { return p_tokens[i]; }
  // 16 lanes' output words of word j: head dimension j.
  static __m512i out_word(const float* acc, int j, int rv, int r, Vec16 inv) {
    return _mm512_castps_si512((Vec16::load(acc + (size_t(j) * rv + r) * kLanes) * inv).v);
  }
};

#ifdef __AVX512BF16__
using vec::BF16x32;

template <>
struct LaneWords<c10::BFloat16> : vec::WordOps<c10::BFloat16> {
  // Tokens 2i and 2i + 1, rounded to bf16 and paired.
  static Operand p_word(const Vec16* p_tokens, int i) {
    return BF16x32::interleave(p_tokens[2 * i], p_tokens[2 * i + 1]);
  }
  // Head dimensions 2j and 2j + 1, rounded to bf16 and paired.
  static __m512i out_word(const float* acc, int j, int rv, int r, Vec16 inv) {
    const Vec16 even = Vec16::load(acc + (size_t(2 * j) * rv + r) * kLanes) * inv;
    const Vec16 odd = Vec16::load(acc + (size_t(2 * j + 1) * rv + r) * kLanes) * inv;
    return (__m512i)BF16x32::interleave(even, odd).v;
  }
};
#endif

// Elements of one head dimension for 8 consecutive tokens (a tile half's values):
// n of them loaded (masked: the rest are neither read nor faulted on), zeros after.
inline void copy_value_half(c10::BFloat16* dst, const c10::BFloat16* src, int n) {
  const __m128i x = n > 0 ? _mm_maskz_loadu_epi16(__mmask8((1u << n) - 1), src) : _mm_setzero_si128();
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), x);
}
inline void copy_value_half(float* dst, const float* src, int n) {
  const __m256i x = n > 0 ? _mm256_maskz_loadu_epi32(__mmask8((1u << n) - 1), src)
                          : _mm256_setzero_si256();
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), x);
}

// Transposes a 16 x 16 matrix of 32-bit words held as 16 row vectors (four
// rounds of unpacks and 128-bit shuffles): turns 16 rows' words into one
// vector per word with a row per lane, and back.
inline void transpose_words(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
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
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
  }
}

// Per-thread scratch of the lane-row prefill.
template <typename T>
struct LaneWorkspace {
  std::vector<uint32_t> q_words;  // [D/kElems][RV][16]: the rows' queries, a row per lane
  std::vector<float> acc;         // [D][RV][16]: running sum of p * v
  std::vector<T> key_tile;        // [D/x][16][x]: the last tile's keys, zero past the end
  std::vector<T> value_tile;      // [D][16]: the last tile's values, zero past the end

  void reset(int head_size, int rv) {
    q_words.resize(size_t(head_size / LaneWords<T>::kElems) * rv * kLanes);  // all written
    acc.assign(size_t(head_size) * rv * kLanes, 0.0f);
    key_tile.resize(size_t(head_size) * kKeyTile);
    value_tile.resize(size_t(head_size) * kKeyTile);
  }
};

// Where a tile's keys and values are: tokens [0, 8) and [8, 16) of the tile
// each lie in one cache block. From half h's first token, x-group c of its
// token i is at key[h] + c * key_stride + i * x, head dimension d of token i at
// value[h] + d * value_stride + i.
template <typename T>
struct TileAddress {
  const T* key[2];
  const T* value[2];
  int64_t key_stride;    // elements between x-groups: block_size * x
  int64_t value_stride;  // elements between head dimensions: block_size
};

// Logits (unscaled) of the RV row vectors for 8 tokens of one tile half.
template <typename T, int RV>
inline void qk_half(const T* key, int64_t key_stride, const uint32_t* q_words, int head_size,
                    Vec16 (&s)[kHalfTile][RV]) {
  using W = LaneWords<T>;
  constexpr int X = PagedCache<T>::kX;
  for (auto& t : s) {
    for (auto& v : t) v = Vec16::zero();
  }
  for (int c = 0; c < head_size / X; ++c) {
    const T* k = key + c * key_stride;
    for (int w = 0; w < 4; ++w) {  // the 4 words of an x-group
      typename W::Operand q[RV];
      for (int r = 0; r < RV; ++r) {
        q[r] = W::load(reinterpret_cast<const T*>(q_words + (size_t(c * 4 + w) * RV + r) * kLanes));
      }
      for (int i = 0; i < kHalfTile; ++i) {
        const auto kw = W::broadcast(k + i * X + w * W::kElems);
        for (int r = 0; r < RV; ++r) s[i][r] = W::mac(s[i][r], q[r], kw);
      }
    }
  }
}

// acc = acc * alpha + p . v over the tile's 16 tokens (p already masked).
template <typename T, int RV>
inline void pv_tile(const TileAddress<T>& at, const Vec16 (&p)[RV][kKeyTile],
                    const Vec16 (&alpha)[RV], float* acc, int head_size) {
  using W = LaneWords<T>;
  constexpr int kDims = 4;  // head dimensions per step: 4 * RV independent sums
  constexpr int kWords = kKeyTile / W::kElems;  // words of one head dimension's 16 values
  typename W::Operand pw[kWords][RV];
  for (int i = 0; i < kWords; ++i) {
    for (int r = 0; r < RV; ++r) pw[i][r] = W::p_word(p[r], i);
  }
  const int64_t stride = at.value_stride;
  for (int d0 = 0; d0 < head_size; d0 += kDims) {
    Vec16 sum[kDims][RV];
    for (int k = 0; k < kDims; ++k) {
      for (int r = 0; r < RV; ++r) {
        sum[k][r] = Vec16::load(acc + (size_t(d0 + k) * RV + r) * kLanes) * alpha[r];
      }
    }
    for (int i = 0; i < kWords; ++i) {
      const int token = i * W::kElems;  // the word's first token in the tile
      const T* v = at.value[token / kHalfTile] + token % kHalfTile + d0 * stride;
      for (int k = 0; k < kDims; ++k) {
        const auto vw = W::broadcast(v + k * stride);
        for (int r = 0; r < RV; ++r) sum[k][r] = W::mac(sum[k][r], pw[i][r], vw);
      }
    }
    for (int k = 0; k < kDims; ++k) {
      for (int r = 0; r < RV; ++r) sum[k][r].store(acc + (size_t(d0 + k) * RV + r) * kLanes);
    }
  }
}

// The rows of one task, in lanes.
template <int RV>
struct LaneRowsState {
  Vec16 query_pos[RV];  // position of each lane's query token (padding lanes: the last row's)
  Vec16 slope[RV];      // alibi slopes times log2(e) (zero without alibi)
  Vec16 max_logit[RV];  // in base 2: logit * log2(e)
  Vec16 exp_sum[RV];
};

// Attends the task's rows to keys [0, last_key] of (seq, kv_head); first_pos is
// the smallest query position of the rows (tiles wholly at or before it need no mask).
template <typename T, int RV>
void attend_lanes(const PagedCache<T>& cache, int64_t seq, int kv_head, int first_pos,
                  int last_key, float scale, bool with_alibi, LaneRowsState<RV>& st,
                  LaneWorkspace<T>& ws) {
  constexpr int X = PagedCache<T>::kX;
  const int bs = cache.block_size, D = cache.head_size;
  for (int r = 0; r < RV; ++r) {
    st.max_logit[r] = Vec16::set1(kNegInf);
    st.exp_sum[r] = Vec16::zero();
  }
  // Token tok's x-group 0 in the key cache, head dimension 0 in the value cache.
  auto key_token = [&](int tok) {
    return cache.key_cache + cache.block_offset(seq, kv_head, tok / bs) + (tok % bs) * X;
  };
  auto value_token = [&](int tok) {
    return cache.value_cache + cache.block_offset(seq, kv_head, tok / bs) + tok % bs;
  };
  constexpr float kLog2e = 1.44269504f;
  const Vec16 vscale = Vec16::set1(scale * kLog2e);
  for (int t0 = 0; t0 <= last_key; t0 += kKeyTile) {
    TileAddress<T> at;
    if (t0 + kKeyTile - 1 <= last_key) {
      for (int h = 0; h < 2; ++h) {
        at.key[h] = key_token(t0 + h * kHalfTile);
        at.value[h] = value_token(t0 + h * kHalfTile);
      }
      at.key_stride = int64_t(bs) * X;
      at.value_stride = bs;
    } else {
      // The last tile: copy the tokens up to last_key, zeros after, with masked
      // loads (masked-off elements are neither read nor faulted on). A half
      // with no such token is all zeros and its block is not looked up: it may
      // lie past the sequence's blocks.
      T* kt = ws.key_tile.data();
      T* vt = ws.value_tile.data();
      for (int h = 0; h < 2; ++h) {
        const int n = std::clamp(last_key - t0 - h * kHalfTile + 1, 0, kHalfTile);
        const T* k = nullptr;
        const T* v = nullptr;
        if (n > 0) {
          k = key_token(t0 + h * kHalfTile);
          v = value_token(t0 + h * kHalfTile);
        }
        // Keys: an x-group of 4 consecutive tokens is 64 bytes, 8 64-bit words.
        for (int c = 0; c < D / X; ++c) {
          for (int quad = 0; quad < 2; ++quad) {
            const int m = std::clamp(n - quad * 4, 0, 4);
            const __mmask8 words = __mmask8((1u << (2 * m)) - 1);
            const __m512i x = m > 0 ? _mm512_maskz_loadu_epi64(
                                          words, k + int64_t(c) * bs * X + quad * 4 * X)
                                    : _mm512_setzero_si512();
            _mm512_storeu_si512(kt + (c * kKeyTile + h * kHalfTile + quad * 4) * X, x);
          }
        }
        // Values: 8 consecutive tokens of a head dimension are 8 contiguous elements.
        for (int d = 0; d < D; ++d) {
          copy_value_half(vt + d * kKeyTile + h * kHalfTile, v ? v + int64_t(d) * bs : v, n);
        }
      }
      at.key[0] = kt;
      at.key[1] = kt + kHalfTile * X;
      at.value[0] = vt;
      at.value[1] = vt + kHalfTile;
      at.key_stride = kKeyTile * X;
      at.value_stride = kKeyTile;
    }

    // 1. logits.
    Vec16 s[RV][kKeyTile];
    for (int h = 0; h < 2; ++h) {
      Vec16 half[kHalfTile][RV];
      qk_half<T, RV>(at.key[h], at.key_stride, ws.q_words.data(), D, half);
      for (int i = 0; i < kHalfTile; ++i) {
        for (int r = 0; r < RV; ++r) s[r][h * kHalfTile + i] = half[i][r];
      }
    }

    // 2. online softmax in base 2 (scale * log2(e) folded into the logits, so
    // exp(logit - max) is one exp2); key token t0 + i is visible to a lane iff
    // t0 + i <= its query_pos.
    const bool masked = t0 + kKeyTile - 1 > first_pos;
    Vec16 alpha[RV];
    for (int r = 0; r < RV; ++r) {
      Vec16 tile_max = st.max_logit[r];
      for (int i = 0; i < kKeyTile; ++i) {
        Vec16 x = s[r][i] * vscale;
        const Vec16 key_pos = Vec16::set1(float(t0 + i));
        if (with_alibi) x = Vec16::fmadd(st.slope[r], key_pos - st.query_pos[r], x);
        if (masked) x = x.keep_where_le(key_pos, st.query_pos[r], kNegInf);
        s[r][i] = x;
        tile_max = Vec16::max(tile_max, x);
      }
      // Every lane sees key 0, so max_logit is finite from the first tile on and
      // alpha = 2^-inf = 0 there.
      alpha[r] = (st.max_logit[r] - tile_max).exp2_nonpositive();
      st.max_logit[r] = tile_max;
      Vec16 sum = Vec16::zero();
      for (int i = 0; i < kKeyTile; ++i) {
        s[r][i] = (s[r][i] - tile_max).exp2_nonpositive();
        sum = sum + s[r][i];
      }
      st.exp_sum[r] = Vec16::fmadd(st.exp_sum[r], alpha[r], sum);
    }

    // 3. values.
    pv_tile<T, RV>(at, s, alpha, ws.acc.data(), D);
  }
}

// Causal prefill of all sequences' query rows, tasks (seq, kv head, kLaneRows
// rows) longest first, claimed dynamically by at::parallel_for's threads.
template <typename T>
void prefill_lanes(const PagedCache<T>& cache, const T* query, int64_t q_stride, T* out,
                   int64_t num_heads, int64_t num_seqs, const int32_t* lens, const int32_t* starts,
                   float scale, const float* alibi) {
  const int num_kv_heads = cache.num_kv_heads, D = cache.head_size;
  const int group = int(num_heads / num_kv_heads);
  struct Task {
    int64_t seq;
    int first_row;  // of the sequence's q_len * group rows
    int count;
    int64_t cost;
  };
  std::vector<Task> tasks;
  int64_t work = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int q_len = starts[s + 1] - starts[s];
    const int rows = q_len * group;
    for (int r = 0; r < rows; r += kLaneRows) {
      const int count = std::min(kLaneRows, rows - r);
      const int last_pos = lens[s] - q_len + (r + count - 1) / group;
      tasks.push_back({s, r, count, int64_t(last_pos + 1) * count});
      work += tasks.back().cost;
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });

  using W = LaneWords<T>;
  auto run = [&](auto rv_tag, const Task& t, int kv_head, LaneWorkspace<T>& ws) {
    constexpr int RV = decltype(rv_tag)::value;
    const int q_len = starts[t.seq + 1] - starts[t.seq];
    const int pos0 = lens[t.seq] - q_len;  // position of query token 0
    ws.reset(D, RV);
    LaneRowsState<RV> st;
    alignas(64) float qpos[RV * kLanes], slope[RV * kLanes];
    for (int lane = 0; lane < RV * kLanes; ++lane) {
      const int row = t.first_row + std::min(lane, t.count - 1);  // padding: repeat the last row
      const int token = row / group, g = row % group;
      qpos[lane] = float(pos0 + token);
      slope[lane] = alibi ? alibi[kv_head * group + g] * 1.44269504f : 0.0f;  // base 2
    }
    // Query words: 16 rows' words at a time, transposed to a row per lane
    // (padding lanes keep a zero query; head sizes of words not a multiple of 16
    // end in a partial block of words).
    const int words = D / W::kElems;
    const int64_t token0 = starts[t.seq];
    for (int r = 0; r < RV; ++r) {
      const T* rows_q[kLanes];
      for (int l = 0; l < kLanes; ++l) {
        const int lane = r * kLanes + l;
        const int row = t.first_row + lane;
        rows_q[l] = lane < t.count ? query + (token0 + row / group) * q_stride +
                                         (int64_t(kv_head) * group + row % group) * D
                                   : nullptr;
      }
      for (int j0 = 0; j0 < words; j0 += kLanes) {
        const int n = std::min(kLanes, words - j0);
        const __mmask16 valid = __mmask16((1u << n) - 1);
        __m512i w[kLanes];
        for (int l = 0; l < kLanes; ++l) {
          w[l] = rows_q[l] ? _mm512_maskz_loadu_epi32(valid, rows_q[l] + W::kElems * j0)
                           : _mm512_setzero_si512();
        }
        transpose_words(w);
        for (int j = 0; j < n; ++j) {
          _mm512_storeu_si512(ws.q_words.data() + (size_t(j0 + j) * RV + r) * kLanes, w[j]);
        }
      }
    }
    for (int r = 0; r < RV; ++r) {
      st.query_pos[r] = Vec16::load(qpos + r * kLanes);
      st.slope[r] = Vec16::load(slope + r * kLanes);
    }
    const int first_pos = pos0 + t.first_row / group;
    const int last_key = pos0 + (t.first_row + t.count - 1) / group;
    attend_lanes<T, RV>(cache, t.seq, kv_head, first_pos, last_key, scale, alibi != nullptr, st, ws);
    // Normalize, make words of the dtype (bf16: dims 2j, 2j + 1 of a lane's row
    // in one word) and transpose 16 rows' words at a time back to rows.
    for (int r = 0; r < RV; ++r) {
      alignas(64) float sums[kLanes];
      st.exp_sum[r].store(sums);
      for (float& x : sums) x = x > 0.0f ? 1.0f / x : 0.0f;
      const Vec16 inv = Vec16::load(sums);
      T* rows_out[kLanes];
      for (int l = 0; l < kLanes; ++l) {
        const int lane = r * kLanes + l;
        const int row = t.first_row + lane;
        rows_out[l] = lane < t.count ? out + ((token0 + row / group) * num_heads +
                                              int64_t(kv_head) * group + row % group) * D
                                     : nullptr;
      }
      const float* acc = ws.acc.data();
      for (int j0 = 0; j0 < words; j0 += kLanes) {
        const int n = std::min(kLanes, words - j0);
        __m512i w[kLanes];
        for (int j = 0; j < kLanes; ++j) {
          w[j] = W::out_word(acc, std::min(j0 + j, words - 1), RV, r, inv);  // past n: any word
        }
        transpose_words(w);
        const __mmask16 valid = __mmask16((1u << n) - 1);
        for (int l = 0; l < kLanes; ++l) {
          if (rows_out[l]) _mm512_mask_storeu_epi32(rows_out[l] + W::kElems * j0, valid, w[l]);
        }
      }
    }
  };

  // Pulls a task's query and output rows toward L2 while the task before it
  // runs: they are scattered (one head's row per token), and the packing and
  // the stores above would otherwise stall on each line.
  auto prefetch_rows = [&](int64_t i) {
    const Task& t = tasks[i / num_kv_heads];
    const int kv_head = int(i % num_kv_heads);
    for (int row = t.first_row; row < t.first_row + t.count; ++row) {
      const int64_t token = starts[t.seq] + row / group;
      const int head = kv_head * group + row % group;
      const char* q = reinterpret_cast<const char*>(query + token * q_stride + int64_t(head) * D);
      const char* o = reinterpret_cast<const char*>(out + (token * num_heads + head) * D);
      for (int byte = 0; byte < D * int(sizeof(T)); byte += 64) {
        vec::prefetch_l2(q + byte);
        vec::prefetch_l2(o + byte);
      }
    }
  };

  std::atomic<int64_t> next{0};
  const int64_t num_tasks = int64_t(tasks.size()) * num_kv_heads;
  if (num_tasks == 0) return;
  // work: query rows x key tokens, as in run_tasks.
  const int64_t workers =
      work < kMinParallelWork ? 1 : std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    LaneWorkspace<T> ws;
    for (int64_t i = next.fetch_add(1); i < num_tasks;) {
      const int64_t following = next.fetch_add(1);
      if (following < num_tasks) prefetch_rows(following);
      const Task& t = tasks[i / num_kv_heads];
      const int kv_head = int(i % num_kv_heads);
      if (t.count > kLanes) {
        run(std::integral_constant<int, 2>{}, t, kv_head, ws);
      } else {
        run(std::integral_constant<int, 1>{}, t, kv_head, ws);
      }
      i = following;
    }
  });
}

#endif  // __AVX512F__


}  // namespace

// ---------------------------------------------------------------------------
// Ops.

// Decode attention over either cache addressing (block tables, or seq slots of the
// contiguous layout): paged_attention_v1 and contiguous_attention_decode. The
// caller has checked the tensors' shapes (shape).
template <typename Addressing>
static void attention_decode(const char* op, const AttentionShape& shape, at::Tensor& out,
                             const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                             const Addressing& addressing, const at::Tensor& seq_lens,
                             int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes) {
  TORCH_CHECK(seq_lens.size(0) == shape.num_tokens, op, ": seq_lens has ", seq_lens.size(0),
              " entries but query has ", shape.num_tokens, " sequences");
  check_addressing(op, addressing, seq_lens, shape, max_seq_len);
  const int64_t num_seqs = shape.num_tokens;
  const int group = int(shape.num_heads / num_kv_heads), head_size = int(shape.head_size);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float* alibi = alibi_slopes ? alibi_slopes->data_ptr<float>() : nullptr;

  int64_t work = 0;  // query rows x key tokens of the whole call
  for (int64_t s = 0; s < num_seqs; ++s) work += int64_t(lens[s]) * shape.num_heads;

  // Tasks (seq, kv_head), longest sequences first.
  std::vector<int64_t> order(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) order[s] = s;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });

  PYLLM_DISPATCH_FLOATING_TYPES(query.scalar_type(), "paged_attention_v1", [&] {
    const auto cache = make_cache<scalar_t>(key_cache, value_cache, addressing, shape);
    const scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    // Task i: (seq, kv_head) = (order[i / num_kv_heads], i % num_kv_heads).
    auto keys_of = [&](int64_t i) {
      const int64_t seq = order[i / num_kv_heads];
      return KeyRange{seq, int(i % num_kv_heads), 0, lens[seq]};
    };
    run_tasks(num_seqs * num_kv_heads, [&](int64_t i, int64_t following, Workspace& ws) {
      const KeyRange keys = keys_of(i);
      const int64_t seq = keys.seq;
      const int kv_head = keys.kv_head;
      const int seq_len = keys.t_end;
      decode_rows(ws.rows, q, query.stride(0), seq, kv_head, group, head_size, float(scale), alibi,
                  seq_len, seq_len);
      attend(cache, seq, kv_head, 0, seq_len, following >= 0 ? keys_of(following) : KeyRange{}, ws);
      scalar_t* dst = o + (seq * shape.num_heads + int64_t(kv_head) * group) * head_size;
      for (int g = 0; g < group; ++g) store_row(ws.rows, g, dst + g * head_size);
    }, work);
  });
}

void paged_attention_v1(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes) {
  const char* op = "paged_attention_v1";
  const AttentionShape shape = check_attention(op, out, query, key_cache, value_cache, num_kv_heads,
                                               block_tables, seq_lens, block_size, alibi_slopes);
  attention_decode(op, shape, out, query, key_cache, value_cache, num_kv_heads, scale,
                   block_tables, seq_lens, max_seq_len, alibi_slopes);
}

void paged_attention_v2(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,
                        at::Tensor& tmp_out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes) {
  const char* op = "paged_attention_v2";
  const AttentionShape shape = check_attention(op, out, query, key_cache, value_cache, num_kv_heads,
                                               block_tables, seq_lens, block_size, alibi_slopes);
  const int64_t num_seqs = shape.num_tokens, num_heads = shape.num_heads;
  TORCH_CHECK(seq_lens.size(0) == num_seqs, op, ": seq_lens has ", seq_lens.size(0),
              " entries but query has ", num_seqs, " sequences");
  const int64_t needed = std::max<int64_t>(1, (max_seq_len + kPartitionSize - 1) / kPartitionSize);
  for (const at::Tensor* t : {&exp_sums, &max_logits}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 &&
                    t->is_contiguous() && t->size(0) == num_seqs && t->size(1) == num_heads &&
                    t->size(2) >= needed,
                op, ": exp_sums and max_logits must be contiguous float32 [", num_seqs, ", ",
                num_heads, ", >= ", needed, "], got ", t->sizes());
  }
  TORCH_CHECK(tmp_out.device().is_cpu() && tmp_out.scalar_type() == query.scalar_type() &&
                  tmp_out.is_contiguous() && tmp_out.dim() == 4 && tmp_out.size(0) == num_seqs &&
                  tmp_out.size(1) == num_heads && tmp_out.size(2) >= needed &&
                  tmp_out.size(3) == shape.head_size,
              op, ": tmp_out must be contiguous [", num_seqs, ", ", num_heads, ", >= ", needed,
              ", ", shape.head_size, "] in the query's dtype, got ", tmp_out.sizes());
  // Each workspace tensor may hold more partitions than needed; index each by its own.
  const int64_t sums_parts = exp_sums.size(2), maxes_parts = max_logits.size(2),
                partial_parts = tmp_out.size(2);
  check_block_tables(op, block_tables, seq_lens, shape, max_seq_len);

  const int group = int(num_heads / num_kv_heads), head_size = int(shape.head_size);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float* alibi = alibi_slopes ? alibi_slopes->data_ptr<float>() : nullptr;

  // Tasks (seq, kv_head, partition) for the partitions that hold tokens. All
  // but each sequence's last are full, so the order hardly matters.
  struct Part {
    int64_t seq;
    int partition;
  };
  std::vector<Part> parts;
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int p = 0; p < num_partitions(lens[s]); ++p) parts.push_back({s, p});
  }

  PYLLM_DISPATCH_FLOATING_TYPES(query.scalar_type(), "paged_attention_v2", [&] {
    const auto cache = make_cache<scalar_t>(key_cache, value_cache, block_tables, shape);
    const scalar_t* q = query.data_ptr<scalar_t>();
    float* sums = exp_sums.data_ptr<float>();
    float* maxes = max_logits.data_ptr<float>();
    scalar_t* partial = tmp_out.data_ptr<scalar_t>();
    // Task i: partition parts[i / num_kv_heads] of kv head i % num_kv_heads.
    auto keys_of = [&](int64_t i) {
      const Part part = parts[i / num_kv_heads];
      const int t_begin = part.partition * int(kPartitionSize);
      return KeyRange{part.seq, int(i % num_kv_heads), t_begin,
                      std::min<int>(lens[part.seq], t_begin + kPartitionSize)};
    };
    run_tasks(
        int64_t(parts.size()) * num_kv_heads, [&](int64_t i, int64_t following, Workspace& ws) {
          const Part part = parts[i / num_kv_heads];
          const KeyRange keys = keys_of(i);
          const int kv_head = keys.kv_head;
          const int seq_len = lens[part.seq];
          decode_rows(ws.rows, q, query.stride(0), part.seq, kv_head, group, head_size,
                      float(scale), alibi, seq_len, keys.t_end);
          attend(cache, part.seq, kv_head, keys.t_begin, keys.t_end,
                 following >= 0 ? keys_of(following) : KeyRange{}, ws);
          for (int g = 0; g < group; ++g) {
            const int64_t head = part.seq * num_heads + int64_t(kv_head) * group + g;
            maxes[head * maxes_parts + part.partition] = ws.rows.max_logit[g];
            sums[head * sums_parts + part.partition] = ws.rows.exp_sum[g];
            store_row(ws.rows, g, partial + (head * partial_parts + part.partition) * head_size);
          }
        });

    // Merge: out = sum_p w_p * tmp_out[p] / sum_p w_p, w_p = exp_sum_p * exp(max_p - max).
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_seqs * num_heads, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> merged(head_size);
      for (int64_t sh = begin; sh < end; ++sh) {
        const int parts_here = num_partitions(lens[sh / num_heads]);
        const float* m = maxes + sh * maxes_parts;
        const float* l = sums + sh * sums_parts;
        float global_max = kNegInf;
        for (int p = 0; p < parts_here; ++p) global_max = std::max(global_max, m[p]);
        std::fill(merged.begin(), merged.end(), 0.0f);
        float total = 0.0f;
        for (int p = 0; p < parts_here; ++p) {
          const float w = l[p] * std::exp(m[p] - global_max);
          total += w;
          const scalar_t* src = partial + (sh * partial_parts + p) * head_size;
          for (int d = 0; d < head_size; ++d) merged[d] += w * static_cast<float>(src[d]);
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;  // seq_len 0: zeros
        scalar_t* dst = o + sh * head_size;
        for (int d = 0; d < head_size; ++d) dst[d] = vec::from_float<scalar_t>(merged[d] * inv);
      }
    });
  });
}

// Causal prefill over either cache addressing: paged_attention_prefill and
// contiguous_attention_prefill. The caller has checked the tensors' shapes (shape).
template <typename Addressing>
static void attention_prefill(const char* op, const AttentionShape& shape, at::Tensor& out,
                              const at::Tensor& query, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                              const Addressing& addressing, const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc,
                              const std::optional<at::Tensor>& alibi_slopes) {
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.device().is_cpu() && query_start_loc.scalar_type() == at::kInt &&
                  query_start_loc.dim() == 1 && query_start_loc.is_contiguous() &&
                  query_start_loc.size(0) == num_seqs + 1,
              op, ": query_start_loc must be a contiguous int32 [num_seqs + 1 = ", num_seqs + 1,
              "] CPU tensor, got ", query_start_loc.sizes());
  check_addressing(op, addressing, seq_lens, shape, std::numeric_limits<int32_t>::max());
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == shape.num_tokens, op,
              ": query_start_loc must run from 0 to num_tokens = ", shape.num_tokens);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = int64_t(starts[s + 1]) - starts[s];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[s], op, ": sequence ", s, " has ", q_len,
                " query tokens but seq_lens ", lens[s]);
  }

  const int group = int(shape.num_heads / num_kv_heads), head_size = int(shape.head_size);
  const int tile = std::max(1, kPrefillRowsPerTask / group);  // query tokens per task
  const float* alibi = alibi_slopes ? alibi_slopes->data_ptr<float>() : nullptr;
#ifdef __AVX512F__
  // float32, and bfloat16 with AVX512-BF16: query rows in lanes (see prefill_lanes).
  if (query.scalar_type() == at::kFloat) {
    const auto cache = make_cache<float>(key_cache, value_cache, addressing, shape);
    prefill_lanes(cache, query.data_ptr<float>(), query.stride(0), out.data_ptr<float>(),
                  shape.num_heads, num_seqs, lens, starts, float(scale), alibi);
    return;
  }
#endif
#ifdef __AVX512BF16__
  if (query.scalar_type() == at::kBFloat16) {
    const auto cache = make_cache<c10::BFloat16>(key_cache, value_cache, addressing, shape);
    prefill_lanes(cache, query.data_ptr<c10::BFloat16>(), query.stride(0),
                  out.data_ptr<c10::BFloat16>(), shape.num_heads, num_seqs, lens, starts,
                  float(scale), alibi);
    return;
  }
#endif

  // Tasks (seq, kv_head, query tile), the most key positions first.
  struct Tile {
    int64_t seq;
    int first;  // first query token of the tile, relative to the sequence's
    int count;
    int64_t cost;
  };
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int q_len = starts[s + 1] - starts[s];
    for (int i = 0; i < q_len; i += tile) {
      const int count = std::min(tile, q_len - i);
      const int last_pos = lens[s] - q_len + i + count - 1;
      tiles.push_back({s, i, count, int64_t(last_pos + 1) * count});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.cost > b.cost; });

  PYLLM_DISPATCH_FLOATING_TYPES(query.scalar_type(), "paged_attention_prefill", [&] {
    constexpr int X = PagedCache<scalar_t>::kX;
    const auto cache = make_cache<scalar_t>(key_cache, value_cache, addressing, shape);
    const scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t q_stride = query.stride(0);
    // Task i: query tile tiles[i / num_kv_heads] of kv head i % num_kv_heads; it
    // reads keys up to its last query token's position.
    auto keys_of = [&](int64_t i) {
      const Tile& t = tiles[i / num_kv_heads];
      const int q_len = starts[t.seq + 1] - starts[t.seq];
      return KeyRange{t.seq, int(i % num_kv_heads), 0, lens[t.seq] - q_len + t.first + t.count};
    };
    run_tasks(
        int64_t(tiles.size()) * num_kv_heads, [&](int64_t i, int64_t following, Workspace& ws) {
          const Tile& t = tiles[i / num_kv_heads];
          const int kv_head = int(i % num_kv_heads);
          const int seq_len = lens[t.seq];
          const int q_len = starts[t.seq + 1] - starts[t.seq];
          Rows& rows = ws.rows;
          rows.reset(t.count * group, head_size, X, float(scale), alibi != nullptr);
          // Row (token j of the tile, head g) = j * group + g.
          for (int j = 0; j < t.count; ++j) {
            const int64_t token = starts[t.seq] + t.first + j;
            const int pos = seq_len - q_len + t.first + j;
            for (int g = 0; g < group; ++g) {
              const int r = j * group + g;
              rows.set_query(r, q + token * q_stride + (int64_t(kv_head) * group + g) * head_size);
              rows.query_pos[r] = pos;
              rows.last_key[r] = pos;
              if (alibi) rows.alibi[r] = alibi[kv_head * group + g];
            }
          }
          attend(cache, t.seq, kv_head, 0, rows.last_key[rows.count - 1] + 1,
                 following >= 0 ? keys_of(following) : KeyRange{}, ws);
          for (int j = 0; j < t.count; ++j) {
            const int64_t token = starts[t.seq] + t.first + j;
            scalar_t* dst = o + (token * shape.num_heads + int64_t(kv_head) * group) * head_size;
            for (int g = 0; g < group; ++g) store_row(rows, j * group + g, dst + g * head_size);
          }
        });
  });
}

void paged_attention_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t block_size,
                             int64_t max_query_len, const std::optional<at::Tensor>& alibi_slopes) {
  const char* op = "paged_attention_prefill";
  const AttentionShape shape = check_attention(op, out, query, key_cache, value_cache, num_kv_heads,
                                               block_tables, seq_lens, block_size, alibi_slopes);
  attention_prefill(op, shape, out, query, key_cache, value_cache, num_kv_heads, scale,
                    block_tables, seq_lens, query_start_loc, alibi_slopes);
}

// ---------------------------------------------------------------------------
// Contiguous KV layout (ops.h): the same kernels, addressed through seq_slots.

void contiguous_attention_decode(at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 int64_t num_kv_heads, double scale, const at::Tensor& seq_slots,
                                 const at::Tensor& seq_lens, int64_t max_seq_len) {
  const char* op = "contiguous_attention_decode";
  const AttentionShape shape = check_contiguous_attention(op, out, query, num_kv_heads, seq_slots,
                                                          seq_lens, query.dim() ? query.size(0) : 0);
  const SlotAddressing slots = check_contiguous_cache(
      op, key_cache, value_cache, num_kv_heads, shape.head_size, query.scalar_type(), seq_slots);
  attention_decode(op, shape, out, query, key_cache, value_cache, num_kv_heads, scale, slots,
                   seq_lens, max_seq_len, std::nullopt);
}

void contiguous_attention_prefill(at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  int64_t num_kv_heads, double scale, const at::Tensor& seq_slots,
                                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                  int64_t max_query_len) {
  const char* op = "contiguous_attention_prefill";
  const AttentionShape shape = check_contiguous_attention(op, out, query, num_kv_heads, seq_slots,
                                                          seq_lens, seq_lens.dim() == 1 ? seq_lens.size(0) : -1);
  const SlotAddressing slots = check_contiguous_cache(
      op, key_cache, value_cache, num_kv_heads, shape.head_size, query.scalar_type(), seq_slots);
  attention_prefill(op, shape, out, query, key_cache, value_cache, num_kv_heads, scale, slots,
                    seq_lens, query_start_loc, std::nullopt);
}

}  // namespace pyllm::cpu
