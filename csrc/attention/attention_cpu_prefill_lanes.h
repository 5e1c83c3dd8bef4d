// Causal prefill on AVX-512 CPUs, float32 and bfloat16: query rows in vector lanes.
//
// An internal header of attention_cpu.cpp, its only includer: what it defines stays in
// that translation unit (anonymous namespace), as when it was one file.
#pragma once

#include "attention_cpu_tasks.h"

namespace pyllm::cpu {
namespace {

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
//      <= the lane's query position, and with a sliding window > the query
//      position - window) on the tiles that cross a row's limit. Tiles past
//      every row's limit, or wholly before every row's window, are never read.
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

using vec::Words16;

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
  static Words16 out_word(const float* acc, int j, int rv, int r, Vec16 inv) {
    return Words16::bits(Vec16::load(acc + (size_t(j) * rv + r) * kLanes) * inv);
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
  static Words16 out_word(const float* acc, int j, int rv, int r, Vec16 inv) {
    const Vec16 even = Vec16::load(acc + (size_t(2 * j) * rv + r) * kLanes) * inv;
    const Vec16 odd = Vec16::load(acc + (size_t(2 * j + 1) * rv + r) * kLanes) * inv;
    return Words16::bits(BF16x32::interleave(even, odd));
  }
};
#endif

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
  Vec16 first_key[RV];  // the first key position each lane sees (its window's start)
  Vec16 slope[RV];      // alibi slopes times log2(e) (zero without alibi)
  Vec16 max_logit[RV];  // in base 2: logit * log2(e)
  Vec16 exp_sum[RV];
};

// The keys a lane-row task reads: [first_key, last_key] of (seq, kv_head).
// first_pos is the smallest query position of the rows (tiles wholly at or
// before it need no causal mask); with a sliding window, tiles that start
// before last_first_key (the last row's window start) need the window's mask.
struct LaneKeys {
  int first_key;
  int last_key;
  int first_pos;
  int last_first_key;
};

// Attends the task's rows to their keys (see LaneKeys) of (seq, kv_head).
template <typename T, int RV>
void attend_lanes(const PagedCache<T>& cache, int64_t seq, int kv_head, const LaneKeys& keys,
                  float scale, bool with_alibi, bool windowed, LaneRowsState<RV>& st,
                  LaneWorkspace<T>& ws) {
  const int last_key = keys.last_key;
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
  const Vec16 vscale = Vec16::set1(scale * kLog2e);
  for (int t0 = keys.first_key / kKeyTile * kKeyTile; t0 <= last_key; t0 += kKeyTile) {
    TileAddress<T> at;
    // A half wholly before every row's window may sit in a block the sequence
    // no longer owns: it is never looked up (the copy below zeroes it).
    const bool first_half_unseen = t0 + kHalfTile <= keys.first_key;
    if (t0 + kKeyTile - 1 <= last_key && !first_half_unseen) {
      for (int h = 0; h < 2; ++h) {
        at.key[h] = key_token(t0 + h * kHalfTile);
        at.value[h] = value_token(t0 + h * kHalfTile);
      }
      at.key_stride = int64_t(bs) * X;
      at.value_stride = bs;
    } else {
      // The last tile (or a first one that starts before the windows): copy the
      // tokens up to last_key, zeros after, with masked loads (masked-off
      // elements are neither read nor faulted on). A half with no such token is
      // all zeros and its block is not looked up: it may lie past the
      // sequence's blocks, or before its window.
      T* kt = ws.key_tile.data();
      T* vt = ws.value_tile.data();
      for (int h = 0; h < 2; ++h) {
        const bool unseen = h == 0 && first_half_unseen;
        const int n = unseen ? 0 : std::clamp(last_key - t0 - h * kHalfTile + 1, 0, kHalfTile);
        const T* k = nullptr;
        const T* v = nullptr;
        if (n > 0) {
          k = key_token(t0 + h * kHalfTile);
          v = value_token(t0 + h * kHalfTile);
        }
        // Keys: an x-group of 4 consecutive tokens is 64 bytes, 16 words (4 a token).
        for (int c = 0; c < D / X; ++c) {
          for (int quad = 0; quad < 2; ++quad) {
            const int m = std::clamp(n - quad * 4, 0, 4);
            const Words16::Mask words = Words16::first(4 * m);
            const Words16 x = m > 0 ? Words16::load(k + int64_t(c) * bs * X + quad * 4 * X, words)
                                    : Words16::zero();
            x.store(kt + (c * kKeyTile + h * kHalfTile + quad * 4) * X);
          }
        }
        // Values: 8 consecutive tokens of a head dimension are 8 contiguous elements.
        for (int d = 0; d < D; ++d) {
          vec::copy_first8(vt + d * kKeyTile + h * kHalfTile, v ? v + int64_t(d) * bs : v, n);
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
    // first_key <= t0 + i <= its query_pos.
    const bool masked = t0 + kKeyTile - 1 > keys.first_pos;
    const bool window_masked = windowed && t0 < keys.last_first_key;
    Vec16 alpha[RV];
    for (int r = 0; r < RV; ++r) {
      Vec16 tile_max = st.max_logit[r];
      for (int i = 0; i < kKeyTile; ++i) {
        Vec16 x = s[r][i] * vscale;
        const Vec16 key_pos = Vec16::set1(float(t0 + i));
        if (with_alibi) x = Vec16::fmadd(st.slope[r], key_pos - st.query_pos[r], x);
        if (masked) x = x.keep_where_le(key_pos, st.query_pos[r], kNegInf);
        if (window_masked) x = x.keep_where_le(st.first_key[r], key_pos, kNegInf);
        s[r][i] = x;
        tile_max = Vec16::max(tile_max, x);
      }
      // Without a window every lane sees the first tile's key 0, so max_logit is
      // finite from the first tile on and alpha = 2^-inf = 0 there. With one, a
      // lane may see nothing yet (max -inf): it shifts by 0, so its alpha and
      // weights are 2^-inf = 0 rather than NaN.
      const Vec16 shift =
          windowed ? tile_max.keep_where_le(Vec16::set1(-std::numeric_limits<float>::max()),
                                            tile_max, 0.0f)
                   : tile_max;
      alpha[r] = (st.max_logit[r] - shift).exp2_nonpositive();
      st.max_logit[r] = tile_max;
      Vec16 sum = Vec16::zero();
      for (int i = 0; i < kKeyTile; ++i) {
        s[r][i] = (s[r][i] - shift).exp2_nonpositive();
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
                   float scale, const float* alibi, int sliding_window, const float* sinks) {
  const int num_kv_heads = cache.num_kv_heads, D = cache.head_size;
  const int group = int(num_heads / num_kv_heads);
  int64_t work = 0;
  const std::vector<RowTask> tasks =
      row_tasks(num_seqs, lens, starts, group, kLaneRows, sliding_window, work);

  using W = LaneWords<T>;
  auto run = [&](auto rv_tag, const RowTask& t, int kv_head, LaneWorkspace<T>& ws) {
    constexpr int RV = decltype(rv_tag)::value;
    const int q_len = starts[t.seq + 1] - starts[t.seq];
    const int pos0 = lens[t.seq] - q_len;  // position of query token 0
    ws.reset(D, RV);
    LaneRowsState<RV> st;
    alignas(64) float qpos[RV * kLanes], first_key[RV * kLanes], slope[RV * kLanes];
    for (int lane = 0; lane < RV * kLanes; ++lane) {
      const int row = t.first_row + std::min(lane, t.count - 1);  // padding: repeat the last row
      const int token = row / group, g = row % group;
      qpos[lane] = float(pos0 + token);
      first_key[lane] = float(window_start(pos0 + token, sliding_window));
      slope[lane] = alibi ? alibi[kv_head * group + g] * kLog2e : 0.0f;  // base 2
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
        const Words16::Mask valid = Words16::first(n);
        Words16 w[kLanes];
        for (int l = 0; l < kLanes; ++l) {
          w[l] = rows_q[l] ? Words16::load(rows_q[l] + W::kElems * j0, valid) : Words16::zero();
        }
        vec::transpose16(w);
        for (int j = 0; j < n; ++j) {
          w[j].store(ws.q_words.data() + (size_t(j0 + j) * RV + r) * kLanes);
        }
      }
    }
    for (int r = 0; r < RV; ++r) {
      st.query_pos[r] = Vec16::load(qpos + r * kLanes);
      st.first_key[r] = Vec16::load(first_key + r * kLanes);
      st.slope[r] = Vec16::load(slope + r * kLanes);
    }
    LaneKeys keys;
    keys.first_pos = pos0 + t.first_row / group;
    keys.last_key = pos0 + (t.first_row + t.count - 1) / group;
    keys.first_key = window_start(keys.first_pos, sliding_window);
    keys.last_first_key = window_start(keys.last_key, sliding_window);
    attend_lanes<T, RV>(cache, t.seq, kv_head, keys, scale, alibi != nullptr, sliding_window > 0,
                        st, ws);
    // Normalize, make words of the dtype (bf16: dims 2j, 2j + 1 of a lane's row
    // in one word) and transpose 16 rows' words at a time back to rows.
    for (int r = 0; r < RV; ++r) {
      Vec16 inv;
      if (sinks) {
        // Each lane's head's sink as one more logit (base 2): rescale to
        // m = max(max_logit, sink); a lane that saw no key gets alpha = 2^-inf = 0.
        alignas(64) float sink[kLanes];
        for (int l = 0; l < kLanes; ++l) {
          const int row = t.first_row + std::min(r * kLanes + l, t.count - 1);
          sink[l] = sinks[kv_head * group + row % group] * kLog2e;
        }
        const Vec16 s = Vec16::load(sink);
        const Vec16 m = Vec16::max(st.max_logit[r], s);
        const Vec16 alpha = (st.max_logit[r] - m).exp2_nonpositive();
        inv = alpha / Vec16::fmadd(st.exp_sum[r], alpha, (s - m).exp2_nonpositive());
      } else {
        alignas(64) float sums[kLanes];
        st.exp_sum[r].store(sums);
        for (float& x : sums) x = x > 0.0f ? 1.0f / x : 0.0f;
        inv = Vec16::load(sums);
      }
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
        Words16 w[kLanes];
        for (int j = 0; j < kLanes; ++j) {
          w[j] = W::out_word(acc, std::min(j0 + j, words - 1), RV, r, inv);  // past n: any word
        }
        vec::transpose16(w);
        const Words16::Mask valid = Words16::first(n);
        for (int l = 0; l < kLanes; ++l) {
          if (rows_out[l]) w[l].store(rows_out[l] + W::kElems * j0, valid);
        }
      }
    }
  };

  // Pulls a task's query and output rows toward L2 while the task before it
  // runs: they are scattered (one head's row per token), and the packing and
  // the stores above would otherwise stall on each line.
  auto prefetch_rows = [&](int64_t i) {
    const RowTask& t = tasks[i / num_kv_heads];
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
      const RowTask& t = tasks[i / num_kv_heads];
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
}  // namespace pyllm::cpu
