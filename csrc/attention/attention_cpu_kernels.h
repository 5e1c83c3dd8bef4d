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
// int8 cache (x = 16, a float16 scale per token and kv head for K and for V): the
// scales are factored out of both products, q . k = s_k * (q . k_int8) (one multiply
// per logit after step 1) and sum_t p_t v_t = sum_t (p_t s_v,t) v_int8_t (p scaled
// once per chunk before step 3), so the inner loops only widen int8 to float32
// (vpmovsxbd + vcvtdq2ps) and stream a quarter of float32's bytes.
//
// Masking is by selection, never arithmetic: logits of keys a row may not see
// (past its causal limit, before its sliding window, or cache slots past the
// sequence end, which may hold garbage including NaN) are replaced by -inf, and
// value lanes past the range are replaced by zeros. A sequence with seq_len 0
// gets zeros in out.
//
// Sliding window (sliding_window > 0): the query at position p sees keys
// (p - sliding_window, p]. A task starts at the cache block holding its first
// row's first key, so blocks wholly before every row's window are never read
// (they may have been handed to another sequence).
//
// Sinks (gpt-oss): one logit per query head joins each row's softmax with no value.
// It changes only the normalization, so it is folded in once at the end (store_row;
// v2: the merge of the partitions): the running max becomes max(max, sink) and the
// sum gains exp(sink - max). Without sinks nothing is added to the key loop.
//
// Memory: at long contexts decode reads each K/V byte once and does little
// arithmetic per byte, so the aim is to stream the cache near the machine's
// copy bandwidth; scattered blocks defeat the hardware prefetcher, hence the
// software prefetches in attend().
//
// An internal header of attention_cpu.cpp, its only includer: what it defines stays in
// that translation unit (anonymous namespace), as when it was one file.
#pragma once

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

#include "../cpu/vec.h"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "sizes.h"

namespace pyllm::cpu {
namespace {


using vec::kLanes;
using vec::Vec16;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// The prefill kernels' softmax runs in base 2: logits, alibi slopes and sinks times log2(e).
constexpr float kLog2e = 1.44269504f;
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
  // int8 cache: float16 scales per (block or tile, kv head, token), dense, shaped like
  // the cache without head_size; null for a float cache.
  const c10::Half* key_scale = nullptr;
  const c10::Half* value_scale = nullptr;
  int64_t num_tiles = 0;  // contiguous layout: tiles per slot of the scales

  static constexpr bool kQuantized = std::is_same_v<scalar_t, int8_t>;

  // Offset of (physical block of the seq's logical block, kv_head) in either cache;
  // both caches hold head_size * block_size elements per (block, kv head).
  int64_t block_offset(int64_t seq, int kv_head, int64_t logical_block) const {
    if (seq_slots != nullptr) {
      return seq_slots[seq] * slot_stride + kv_head * head_stride + logical_block * tile_stride;
    }
    const int64_t physical = block_tables[seq * max_blocks_per_seq + logical_block];
    return (physical * num_kv_heads + kv_head) * int64_t(head_size) * block_size;
  }

  // Offset of the same (block, kv_head)'s block_size scales in key_scale / value_scale.
  int64_t scale_offset(int64_t seq, int kv_head, int64_t logical_block) const {
    if (seq_slots != nullptr) {
      return ((seq_slots[seq] * int64_t(num_kv_heads) + kv_head) * num_tiles + logical_block) *
             block_size;
    }
    const int64_t physical = block_tables[seq * max_blocks_per_seq + logical_block];
    return (physical * num_kv_heads + kv_head) * int64_t(block_size);
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
  std::vector<int> first_key;    // [count] first key position it attends (its window's start)
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
    first_key.assign(rows, 0);
    query_pos.resize(rows);
    alibi.resize(with_alibi ? rows : 0);
    max_logit.assign(rows, kNegInf);
    exp_sum.assign(rows, 0.0f);
    acc.assign(size_t(rows) * head_size, 0.0f);
  }

  // Loads row r's query (head_size packed elements), each x-group repeated to
  // fill the 64 bytes that meet one key vector (copied bytewise: the buffer
  // is float storage, the elements may be bf16).
  // cache_t: the cache's element type, whose key vectors the query meets.
  template <typename scalar_t, typename cache_t = scalar_t>
  void set_query(int r, const scalar_t* q) {
    using Ops = KeyOps<cache_t>;
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
  if constexpr (L >= 16) level([](Vec16 a, Vec16 b) { return vec::fold<16>(a, b); });
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
// key_scale (int8 cache): the group's tokens' scales, factored out of q . k.
template <typename scalar_t, int RT, int VECS>
void qk_row_tile(const scalar_t* key, const c10::Half* key_scale, int block_size, int first_pos,
                 int offset, int r0, Rows& rows, float* logits) {
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
  Vec16 scale = Vec16::set1(rows.scale);
  if constexpr (std::is_same_v<scalar_t, int8_t>) {
    // 8 tokens (block_size 8): the upper lanes repeat them and are masked below.
    scale = scale * (kTokens < kLanes ? Vec16::load_halves(key_scale, key_scale)
                                      : Vec16::load(key_scale));
  }
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
    logit = logit.keep_first(visible, kNegInf);
    const int before_window = rows.first_key[row] - first_pos;  // lanes below it are hidden
    if (before_window > 0) {
      logit = logit.keep_where_le(Vec16::set1(float(before_window)), Vec16::iota(), kNegInf);
    }
    logit.store(logits + size_t(row) * kLogitsStride + offset);
  }
}

template <typename scalar_t, int VECS>
void qk_all_rows(const scalar_t* key, const c10::Half* key_scale, int block_size, int first_pos,
                 int offset, Rows& rows, float* logits) {
  int r = 0;
  for (; r + kMaxRowTile <= rows.count; r += kMaxRowTile) {
    qk_row_tile<scalar_t, kMaxRowTile, VECS>(key, key_scale, block_size, first_pos, offset, r,
                                             rows, logits);
  }
#define PYLLM_QK_TAIL(N)                                                                  \
  case N:                                                                                 \
    qk_row_tile<scalar_t, N, VECS>(key, key_scale, block_size, first_pos, offset, r, rows, \
                                   logits);                                               \
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
  // int8 cache: the groups' value scales, as lo / hi.
  const c10::Half* scale_lo[kMaxGroups];
  const c10::Half* scale_hi[kMaxGroups];

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
      if constexpr (PagedCache<scalar_t>::kQuantized) {
        scale_lo[g] = cache.value_scale + cache.scale_offset(seq, kv_head, tok / bs) + tok % bs;
        scale_hi[g] = bs < kLanes && tok + bs < chunk + n
                          ? cache.value_scale + cache.scale_offset(seq, kv_head, tok / bs + 1)
                          : scale_lo[g];
      }
    }
  }

  // int8 cache: p[row][t] *= the value scale of token t, so that the value pass
  // sums p * v_int8 (sum_t p_t v_t = sum_t (p_t s_t) q_t). Lanes past the chunk's
  // end get 0 (their scales may be anything).
  void scale_probs(Rows& rows, float* logits) const {
    for (int g = 0; g < count; ++g) {
      Vec16 s = row_stride < kLanes ? Vec16::load_halves(scale_lo[g], scale_hi[g])
                                    : Vec16::load(scale_lo[g]);
      if (g + 1 == count) s = s.keep_first(last_tokens, 0.0f);
      for (int r = 0; r < rows.count; ++r) {
        float* p = logits + size_t(r) * kLogitsStride + g * kLanes;
        (Vec16::load(p) * s).store(p);
      }
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

// t_begin is a multiple of the block size; every row's last_key is < t_end.
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
  auto key_scales = [&](int tok) -> const c10::Half* {
    if constexpr (PagedCache<scalar_t>::kQuantized) {
      return cache.key_scale + cache.scale_offset(seq, kv_head, tok / bs) + tok % bs;
    }
    return nullptr;
  };
  // int8: a block's scales travel with it (a line per 16 tokens, a miss each if not).
  auto prefetch = [&](const scalar_t* block, const c10::Half* scales, int tok, bool to_l1) {
    prefetch_block(block + cache.block_offset(seq, kv_head, tok / bs), block_elems, to_l1);
    if constexpr (PagedCache<scalar_t>::kQuantized) {
      prefetch_block(scales + cache.scale_offset(seq, kv_head, tok / bs), bs, to_l1);
    }
  };
  ValueGroups<scalar_t> groups;

  for (int chunk = t_begin; chunk < t_end; chunk += kPartitionSize) {
    const int chunk_end = std::min<int>(t_end, chunk + kPartitionSize);
    if (chunk == t_begin) {
      for (int i = 0; i < kKeyAhead && chunk + i * bs < chunk_end; ++i) {
        prefetch(cache.key_cache, cache.key_scale, chunk + i * bs, true);
      }
    }
    for (int start = chunk; start < chunk_end; start += bs) {
      if (start + kKeyAhead * bs < chunk_end) {
        prefetch(cache.key_cache, cache.key_scale, start + kKeyAhead * bs, true);
      }
      prefetch(cache.value_cache, cache.value_scale, start, false);
      const scalar_t* key = key_block(start);
      const int end = std::min(chunk_end, start + bs);
      for (int tok = start; tok < end; tok += group) {
        // 16 tokens make kLanesPerToken key vectors; 8 tokens (block_size 8) half as many.
        constexpr int kVecs = KeyOps<scalar_t>::kLanesPerToken;  // per 16 tokens
        if (bs >= kLanes) {
          qk_all_rows<scalar_t, kVecs>(key + (tok - start) * X, key_scales(tok), bs, tok,
                                       tok - chunk, rows, logits);
        } else {
          qk_all_rows<scalar_t, kVecs / 2>(key, key_scales(tok), bs, tok, tok - chunk, rows,
                                           logits);
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
    if constexpr (PagedCache<scalar_t>::kQuantized) groups.scale_probs(rows, logits);
    if (bs >= kLanes) {
      pv_all_rows<scalar_t, false>(groups, rows, logits, next_keys);
    } else {
      pv_all_rows<scalar_t, true>(groups, rows, logits, next_keys);
    }
  }
}

}  // namespace
}  // namespace pyllm::cpu
