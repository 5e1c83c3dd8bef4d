// Causal prefill of bfloat16 on CPUs with AMX: the logits and the weighted sums of the
// values as tile products.
//
// An internal header of attention_cpu.cpp, its only includer: what it defines stays in
// that translation unit (anonymous namespace).
#pragma once

#include <ATen/ops/empty.h>

#include "../cpu/amx.h"
#include "attention_cpu_tasks.h"

#ifdef PYLLM_AMX

namespace pyllm::cpu {
namespace {

// The lane-row prefill (attention_cpu_prefill_lanes.h) runs its products on the
// vector units, 140-165 GFLOP/s on two cores of a Xeon with AMX; the tile unit
// multiplies bf16 several times faster (here 520-850 GFLOP/s, the softmax between
// the products now the larger part), so a task's 16 query rows are one A tile:
//   0. the keys and values of every (seq, kv head) are first packed as B tiles, once
//      per call (the tasks of a kv head all read them), 64 key tokens a step:
//        keys:   [4 key tiles of 16 tokens][D/2 pairs of dims][16 tokens][2]
//        values: [2 halves of 32 tokens][D/16 dim tiles][16 token pairs][16 dims][2]
//      Groups of 8 tokens (one cache block always holds them) past the last key, or
//      wholly before every window, are zeros and never looked up.
//   1. per step, the task's 16 x 64 logits are four float32 tiles: Q (16 rows x 32
//      dims a tile) . K^T, D/32 products each;
//   2. an online softmax in base 2 runs on them (a row's 64 keys are 4 vectors; the
//      16 rows' maxima, alphas and sums are one vector each, a row per lane),
//      masking by selection, and rounds the weights P to bf16;
//   3. P (16 rows x 32 tokens a tile) . V gives 16 x 64 dims at a time in four tiles,
//      added to the float32 output rows after their rescale by the softmax's alpha.
// alibi keeps the lane rows (its slopes bias the logits per key).
constexpr int kAmxRows = 16;   // query rows per task: one A tile
constexpr int kAmxStep = 64;   // key tokens per step: four tiles of logits
constexpr int kAmxGroup = 8;   // tokens a cache block always holds together

using Bf16 = c10::BFloat16;

// Where (seq, kv head)'s packed steps start; steps before first_step are not packed.
struct AmxPacked {
  std::vector<int64_t> offset;  // per (seq, kv head): elements, step first_step
  std::vector<int> first_step;  // per seq
  int64_t step_elems = 0;       // 2 * kAmxStep * D: keys, then values

  // Elements from the buffer's start to step s of (seq, kv_head).
  int64_t step(int64_t seq, int kv_head, int num_kv_heads, int s) const {
    return offset[seq * num_kv_heads + kv_head] + (s - first_step[seq]) * step_elems;
  }
};

// Word w (dims 2w, 2w + 1 of an x-group) of 16 tokens, from the x-groups of tokens
// 0-7 (a, two vectors of 4 tokens x 4 words) and 8-15 (b): a 4 x 16 word transpose.
inline void key_words(const __m512i (&a)[2], const __m512i (&b)[2], __m512i (&w)[4]) {
  // Token t's word w is element 4t + w of a vector pair: gather words 0 and 1 (2, 3)
  // of 8 tokens, then join the two halves of the tile.
  alignas(64) static constexpr int32_t kLow[16] = {0, 4, 8,  12, 16, 20, 24, 28,
                                                   1, 5, 9,  13, 17, 21, 25, 29};
  alignas(64) static constexpr int32_t kHigh[16] = {2, 6, 10, 14, 18, 22, 26, 30,
                                                    3, 7, 11, 15, 19, 23, 27, 31};
  alignas(64) static constexpr int32_t kFirst[16] = {0, 1, 2,  3,  4,  5,  6,  7,
                                                     16, 17, 18, 19, 20, 21, 22, 23};
  alignas(64) static constexpr int32_t kSecond[16] = {8,  9,  10, 11, 12, 13, 14, 15,
                                                      24, 25, 26, 27, 28, 29, 30, 31};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  const __m512i first = _mm512_load_si512(kFirst), second = _mm512_load_si512(kSecond);
  const __m512i a01 = _mm512_permutex2var_epi32(a[0], low, a[1]);
  const __m512i a23 = _mm512_permutex2var_epi32(a[0], high, a[1]);
  const __m512i b01 = _mm512_permutex2var_epi32(b[0], low, b[1]);
  const __m512i b23 = _mm512_permutex2var_epi32(b[0], high, b[1]);
  w[0] = _mm512_permutex2var_epi32(a01, first, b01);
  w[1] = _mm512_permutex2var_epi32(a01, second, b01);
  w[2] = _mm512_permutex2var_epi32(a23, first, b23);
  w[3] = _mm512_permutex2var_epi32(a23, second, b23);
}

// Packs step s of (seq, kv head): key tokens [64 s, 64 s + 64), of which
// [first_key, last_key] are read.
inline void pack_step(const PagedCache<Bf16>& cache, int64_t seq, int kv_head, int s,
                      int first_key, int last_key, Bf16* dst) {
  constexpr int X = PagedCache<Bf16>::kX;
  const int bs = cache.block_size, D = cache.head_size;
  const Bf16* key[kAmxStep / kAmxGroup];
  const Bf16* value[kAmxStep / kAmxGroup];
  int n[kAmxStep / kAmxGroup];  // tokens of group g read: [0, n)
  for (int g = 0; g < kAmxStep / kAmxGroup; ++g) {
    const int t = s * kAmxStep + g * kAmxGroup;
    n[g] = t + kAmxGroup <= first_key ? 0 : std::clamp(last_key - t + 1, 0, kAmxGroup);
    key[g] = value[g] = nullptr;
    if (n[g] > 0) {
      const int64_t block = cache.block_offset(seq, kv_head, t / bs);
      key[g] = cache.key_cache + block + (t % bs) * X;
      value[g] = cache.value_cache + block + t % bs;
    }
  }
  // Keys: an x-group of 4 tokens is 16 words; a group's 8 tokens, two vectors.
  auto x_groups = [&](int g, int c, __m512i (&v)[2]) {
    for (int h = 0; h < 2; ++h) {
      const int m = std::clamp(n[g] - 4 * h, 0, 4);
      v[h] = m > 0 ? _mm512_maskz_loadu_epi32(__mmask16((1u << (4 * m)) - 1),
                                              key[g] + int64_t(c) * bs * X + 4 * h * X)
                   : _mm512_setzero_si512();
    }
  };
  for (int tile = 0; tile < 4; ++tile) {
    Bf16* out = dst + tile * 16 * D;
    for (int c = 0; c < D / X; ++c) {
      __m512i a[2], b[2], w[4];
      x_groups(2 * tile, c, a);
      x_groups(2 * tile + 1, c, b);
      key_words(a, b, w);
      for (int i = 0; i < 4; ++i) _mm512_storeu_si512(out + (4 * c + i) * 32, w[i]);
    }
  }
  // Values: head dim d's 32 tokens of a half are 16 words (4 per group), transposed
  // 16 dims at a time to a row of 16 dims' words per token pair.
  Bf16* values = dst + kAmxStep * D;
  for (int half = 0; half < 2; ++half) {
    for (int e = 0; e < D / 16; ++e) {
      vec::Words16 rows[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t d = e * 16 + i;
        __m512i r = _mm512_setzero_si512();
        for (int q = 0; q < 4; ++q) {
          const int g = half * 4 + q;
          if (n[g] == 0) continue;
          const __m128i x = _mm_maskz_loadu_epi16(__mmask8((1u << n[g]) - 1), value[g] + d * bs);
          r = _mm512_mask_broadcast_i32x4(r, __mmask16(0xF << (4 * q)), x);
        }
        rows[i].v = r;
      }
      vec::transpose16(rows);
      Bf16* out = values + half * 32 * D + e * 16 * 32;
      for (int p = 0; p < 16; ++p) rows[p].store(out + p * 32);
    }
  }
}

// Packs every (seq, kv head)'s steps that some query row reads.
inline void pack_keys_values(const PagedCache<Bf16>& cache, int64_t num_seqs, const int32_t* lens,
                             const int32_t* starts, int sliding_window, AmxPacked& packed,
                             at::Tensor& buffer) {
  const int H = cache.num_kv_heads, D = cache.head_size;
  packed.step_elems = 2 * int64_t(kAmxStep) * D;
  packed.offset.assign(num_seqs * H, 0);
  packed.first_step.assign(num_seqs, 0);
  struct Item {
    int64_t seq;
    int kv_head;
    int step;
  };
  std::vector<Item> items;
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int q_len = starts[s + 1] - starts[s];
    if (q_len == 0) continue;
    const int first = window_start(lens[s] - q_len, sliding_window) / kAmxStep;
    const int last = (lens[s] - 1) / kAmxStep;
    packed.first_step[s] = first;
    for (int h = 0; h < H; ++h) {
      packed.offset[s * H + h] = total;
      total += (last - first + 1) * packed.step_elems;
      for (int step = first; step <= last; ++step) items.push_back({s, h, step});
    }
  }
  buffer = at::empty({std::max<int64_t>(total, 1)}, at::kBFloat16);
  Bf16* base = buffer.data_ptr<Bf16>();
  at::parallel_for(0, int64_t(items.size()), 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Item& it = items[i];
      const int q_len = starts[it.seq + 1] - starts[it.seq];
      const int first_key = window_start(lens[it.seq] - q_len, sliding_window);
      Bf16* dst = base + packed.step(it.seq, it.kv_head, H, it.step);
      pack_step(cache, it.seq, it.kv_head, it.step, first_key, lens[it.seq] - 1, dst);
    }
  });
}

// Per-thread scratch of a task.
struct AmxWorkspace {
  std::vector<Bf16> q;     // [16][D]: the rows' queries, zero past the task's rows
  std::vector<float> acc;  // [16][D]: running sum of p * v
  alignas(64) float logits[kAmxRows * kAmxStep];
  alignas(64) Bf16 p[kAmxRows * kAmxStep];
  alignas(64) float sums[kAmxRows * kAmxStep];  // 16 x 64 dims of p . v
  alignas(64) float max_logit[kAmxRows];        // a row per lane, as the two below
  alignas(64) float exp_sum[kAmxRows];
  alignas(64) float alpha[kAmxRows];
  int query_pos[kAmxRows], first_key[kAmxRows];
};

// Logits of the task's 16 rows for the 64 keys of one packed step (tiles 0-3).
inline void amx_logits(const Bf16* q, const Bf16* keys, int D, float* logits) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int j = 0; j < D / 32; ++j) {
    _tile_loadd(4, q + j * 32, D * 2);
    const Bf16* k = keys + j * 16 * 32;  // pairs [16 j, 16 j + 16) of each key tile
    _tile_loadd(5, k, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, k + 16 * D, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, k + 32 * D, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, k + 48 * D, 64);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, logits, kAmxStep * 4);
  _tile_stored(1, logits + 16, kAmxStep * 4);
  _tile_stored(2, logits + 32, kAmxStep * 4);
  _tile_stored(3, logits + 48, kAmxStep * 4);
}

// Lane r: the maximum (or the sum) of v[r]'s 16 lanes; v is overwritten. Folds of
// halves keep the rows in order (vec::fold), so no row waits on a horizontal
// reduction of its own.
template <bool kMax>
inline Vec16 reduce_rows(Vec16 (&v)[kAmxRows]) {
  auto fold = [](auto k, Vec16 a, Vec16 b) {
    constexpr int K = decltype(k)::value;
    if constexpr (!kMax) return vec::fold<K>(a, b);
    const __m512i lo = _mm512_load_si512(vec::detail::kFoldIndex<K>.lo);
    const __m512i hi = _mm512_load_si512(vec::detail::kFoldIndex<K>.hi);
    return Vec16{_mm512_max_ps(_mm512_permutex2var_ps(a.v, lo, b.v),
                               _mm512_permutex2var_ps(a.v, hi, b.v))};
  };
  for (int i = 0; i < 8; ++i) v[i] = fold(std::integral_constant<int, 16>{}, v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) v[i] = fold(std::integral_constant<int, 8>{}, v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 2; ++i) v[i] = fold(std::integral_constant<int, 4>{}, v[2 * i], v[2 * i + 1]);
  return fold(std::integral_constant<int, 2>{}, v[0], v[1]);
}

// Online softmax of the step's logits (base 2), the 16 rows' maxima, alphas and sums
// as vectors of a lane per row: P as bf16, and alpha for amx_values.
inline void amx_softmax(AmxWorkspace& ws, int step_first, float vscale, bool masked) {
  Vec16 top[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) {
    uint64_t keep = ~uint64_t(0);
    if (masked) {  // keys in [first_key, query_pos] of the row
      const int hi = std::clamp(ws.query_pos[r] - step_first + 1, 0, kAmxStep);
      const int lo = std::clamp(ws.first_key[r] - step_first, 0, kAmxStep);
      keep = hi == kAmxStep ? keep : (uint64_t(1) << hi) - 1;
      keep &= lo == kAmxStep ? 0 : ~uint64_t(0) << lo;
    }
    top[r] = Vec16::set1(kNegInf);
    for (int i = 0; i < 4; ++i) {
      float* logits = ws.logits + r * kAmxStep + 16 * i;
      Vec16 x = Vec16::load(logits) * Vec16::set1(vscale);
      if (masked) x = x.keep_bits(uint32_t(keep >> (16 * i)), kNegInf);
      x.store(logits);
      top[r] = Vec16::max(top[r], x);
    }
  }
  const Vec16 old = Vec16::load(ws.max_logit);
  const Vec16 now = Vec16::max(old, reduce_rows<true>(top));
  // A row that has seen no key yet (before its window) shifts by 0: its weights and
  // alpha are 2^-inf = 0, not NaN.
  const Vec16 shift =
      now.keep_where_le(Vec16::set1(-std::numeric_limits<float>::max()), now, 0.0f);
  const Vec16 alpha = (old - shift).exp2_nonpositive();
  alignas(64) float shifts[kAmxRows];
  now.store(ws.max_logit);
  alpha.store(ws.alpha);
  shift.store(shifts);
  Vec16 sums[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) {
    const Vec16 row_shift = Vec16::set1(shifts[r]);
    Vec16 p[4];
    for (int i = 0; i < 4; ++i) {
      p[i] = (Vec16::load(ws.logits + r * kAmxStep + 16 * i) - row_shift).exp2_nonpositive();
    }
    sums[r] = (p[0] + p[1]) + (p[2] + p[3]);
    for (int i = 0; i < 4; i += 2) {
      const __m512bh pair = _mm512_cvtne2ps_pbh(p[i + 1].v, p[i].v);
      _mm512_store_si512(ws.p + r * kAmxStep + 16 * i, (__m512i)pair);
    }
  }
  Vec16::fmadd(Vec16::load(ws.exp_sum), alpha, reduce_rows<false>(sums)).store(ws.exp_sum);
}

// acc = acc * alpha + P . V for the step's values, 64 dims (four tiles) at a time.
inline void amx_values(AmxWorkspace& ws, const Bf16* values, int D) {
  for (int d0 = 0; d0 < D; d0 += 64) {
    const int tiles = std::min(4, (D - d0) / 16);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int half = 0; half < 2; ++half) {
      _tile_loadd(4, ws.p + half * 32, kAmxStep * 2);
      const Bf16* v = values + half * 32 * D + (d0 / 16) * 16 * 32;
      _tile_loadd(5, v, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (tiles > 1) {
        _tile_loadd(6, v + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (tiles > 2) {
        _tile_loadd(5, v + 1024, 64);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (tiles > 3) {
        _tile_loadd(6, v + 1536, 64);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
    _tile_stored(0, ws.sums, kAmxStep * 4);
    if (tiles > 1) _tile_stored(1, ws.sums + 16, kAmxStep * 4);
    if (tiles > 2) _tile_stored(2, ws.sums + 32, kAmxStep * 4);
    if (tiles > 3) _tile_stored(3, ws.sums + 48, kAmxStep * 4);
    for (int r = 0; r < kAmxRows; ++r) {
      float* acc = ws.acc.data() + r * D + d0;
      const Vec16 alpha = Vec16::set1(ws.alpha[r]);
      for (int i = 0; i < tiles; ++i) {
        Vec16::fmadd(Vec16::load(acc + 16 * i), alpha,
                     Vec16::load(ws.sums + r * kAmxStep + 16 * i))
            .store(acc + 16 * i);
      }
    }
  }
}

// Causal prefill of all sequences' query rows on the tile unit: tasks (seq, kv head,
// 16 rows) longest first, claimed dynamically by at::parallel_for's threads.
inline void prefill_amx(const PagedCache<Bf16>& cache, const Bf16* query, int64_t q_stride,
                        Bf16* out, int64_t num_heads, int64_t num_seqs, const int32_t* lens,
                        const int32_t* starts, float scale, int sliding_window,
                        const float* sinks) {
  const int H = cache.num_kv_heads, D = cache.head_size;
  const int group = int(num_heads / H);
  AmxPacked packed;
  at::Tensor buffer;
  pack_keys_values(cache, num_seqs, lens, starts, sliding_window, packed, buffer);
  const Bf16* base = buffer.data_ptr<Bf16>();

  int64_t work = 0;
  const std::vector<RowTask> tasks =
      row_tasks(num_seqs, lens, starts, group, kAmxRows, sliding_window, work);

  auto run = [&](const RowTask& t, int kv_head, AmxWorkspace& ws) {
    const int q_len = starts[t.seq + 1] - starts[t.seq];
    const int pos0 = lens[t.seq] - q_len;  // position of query token 0
    const int64_t token0 = starts[t.seq];
    auto row_head = [&](int r) { return int64_t(kv_head) * group + (t.first_row + r) % group; };
    auto row_token = [&](int r) { return token0 + (t.first_row + r) / group; };
    for (int r = 0; r < kAmxRows; ++r) {
      Bf16* q = ws.q.data() + r * D;
      if (r < t.count) {
        std::memcpy(q, query + row_token(r) * q_stride + row_head(r) * D, D * sizeof(Bf16));
      } else {
        std::memset(q, 0, D * sizeof(Bf16));
      }
      const int pos = pos0 + (t.first_row + std::min(r, t.count - 1)) / group;
      ws.query_pos[r] = pos;
      ws.first_key[r] = window_start(pos, sliding_window);
      ws.max_logit[r] = kNegInf;
      ws.exp_sum[r] = 0.0f;
    }
    std::fill(ws.acc.begin(), ws.acc.end(), 0.0f);
    const int first_pos = ws.query_pos[0], last_pos = ws.query_pos[kAmxRows - 1];
    const int first_key = ws.first_key[0], last_first_key = ws.first_key[kAmxRows - 1];
    const float vscale = scale * kLog2e;
    for (int s = first_key / kAmxStep; s <= last_pos / kAmxStep; ++s) {
      const Bf16* step = base + packed.step(t.seq, kv_head, H, s);
      const int step_first = s * kAmxStep;
      const bool masked = step_first + kAmxStep - 1 > first_pos ||
                          (sliding_window > 0 && step_first < last_first_key);
      amx_logits(ws.q.data(), step, D, ws.logits);
      amx_softmax(ws, step_first, vscale, masked);
      amx_values(ws, step + kAmxStep * D, D);
    }
    for (int r = 0; r < t.count; ++r) {
      float inv = ws.exp_sum[r] > 0.0f ? 1.0f / ws.exp_sum[r] : 0.0f;
      if (sinks) {  // max_logit is in base 2, sink_scale's logits in base e
        inv = sink_scale(ws.max_logit[r] / kLog2e, ws.exp_sum[r], sinks[row_head(r)]);
      }
      Bf16* o = out + (row_token(r) * num_heads + row_head(r)) * D;
      const float* acc = ws.acc.data() + r * D;
      for (int d = 0; d < D; d += 16) (Vec16::load(acc + d) * Vec16::set1(inv)).store(o + d);
    }
  };

  std::atomic<int64_t> next{0};
  const int64_t num_tasks = int64_t(tasks.size()) * H;
  if (num_tasks == 0) return;
  const int64_t workers =
      work < kMinParallelWork ? 1 : std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    amx::load_config();
    AmxWorkspace ws;
    ws.q.resize(size_t(kAmxRows) * D);
    ws.acc.resize(size_t(kAmxRows) * D);
    for (int64_t i = next++; i < num_tasks; i = next++) {
      run(tasks[i / H], int(i % H), ws);
    }
    _tile_release();
  });
}

}  // namespace
}  // namespace pyllm::cpu

#endif  // PYLLM_AMX
