// CPU kernels of the mixture-of-experts ops: moe_topk (routing) and fused_moe (a
// whole MoE feed-forward: routing, the experts' gate/up and down projections, the
// activation, and the weighted sum back into each token's row).
//
// fused_moe runs in five phases, two of them parallel regions:
//  1. routing: each token's softmax and top-k;
//  2. grouping: the (token, expert) pairs sorted by local expert (a counting sort; an
//     expert's pairs of prompt tokens apart from its others where their paths differ),
//     each token's activations quantized to int8 once and copied to the rows of
//     its pairs whose expert takes the int8 tiles (or its float row, where the
//     expert takes a float path: moe_cpu_columns.h picks it from the expert's rows
//     with quant_linear's thresholds);
//  3. gate/up: work items (expert, strip of its columns), taken from one shared
//     counter by every thread: an item computes the strip's gate and up columns for
//     all the expert's rows (its weights read once, tiles of up to 8 rows), adds the
//     biases, applies the activation and stores it for the down projection, in
//     int8 (each span quantized by the item that completes it) or floats;
//  4. down: items (expert, strip of hidden columns) into float32 rows, + bias;
//  5. combine: out[t] = the weighted sum of t's rows, in t's own top-k order, so the
//     results do not depend on the thread count (nor on which thread took an item).
// At batch 1 both threads stream all top_k experts' weights with no join per expert;
// in a prefill the busy experts take the dequantized panels and the rest the int8
// tiles, within the same region. Buffers are thread-local and keep their memory.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "../cpu/float_rows.h"
#include "../dispatch_utils.h"
#include "../ops.h"
#include "moe_checks.h"
#include "moe_cpu_columns.h"

namespace pyllm::cpu {
namespace {

// ---------------------------------------------------------------------------
// Routing.

// Softmax of one row of logits (float32), then its top_k experts, largest first (the
// lower id first on ties), their weights renormalized to sum to 1 if asked: equal to
// a softmax over the top_k logits alone (gpt-oss's order of the two). prob: [E].
template <typename scalar_t>
void route_row(const scalar_t* logits, int64_t E, int64_t k, bool renormalize, float* weights,
               int32_t* ids, float* prob) {
  float max = -INFINITY;
  for (int64_t e = 0; e < E; ++e) max = std::max(max, static_cast<float>(logits[e]));
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) {
    prob[e] = std::exp(static_cast<float>(logits[e]) - max);
    sum += prob[e];
  }
  // Insertion into ids[0, found), kept in order; ids are scanned upwards, so an
  // equal probability stays behind the lower id.
  int64_t found = 0;
  for (int64_t e = 0; e < E; ++e) {
    const float p = prob[e];
    if (found == k && !(p > prob[ids[k - 1]])) continue;
    int64_t j = found < k ? found++ : k - 1;
    for (; j > 0 && p > prob[ids[j - 1]]; --j) ids[j] = ids[j - 1];
    ids[j] = static_cast<int32_t>(e);
  }
  float chosen = 0.0f;
  for (int64_t j = 0; j < k; ++j) chosen += prob[ids[j]];
  const float scale = renormalize ? 1.0f / chosen : 1.0f / sum;
  for (int64_t j = 0; j < k; ++j) weights[j] = prob[ids[j]] * scale;
}

void route(const at::Tensor& router_logits, int64_t k, bool renormalize, float* weights,
           int32_t* ids) {
  const int64_t T = router_logits.size(0), E = router_logits.size(1);
  PYLLM_DISPATCH_FLOATING_TYPES(router_logits.scalar_type(), "moe_topk", [&] {
    const scalar_t* logits = router_logits.const_data_ptr<scalar_t>();
    at::parallel_for(0, T, std::max<int64_t>(1, 4096 / E), [&](int64_t t0, int64_t t1) {
      thread_local std::vector<float> prob;
      float* p = scratch(prob, E);
      for (int64_t t = t0; t < t1; ++t) {
        route_row(logits + t * E, E, k, renormalize, weights + t * k, ids + t * k, p);
      }
    });
  });
}

// ---------------------------------------------------------------------------
// Phase times for benchmarks/bench_moe.py: with PYLLM_MOE_PROFILE naming a file,
// each call appends one line of microseconds (routing, grouping and the activations'
// quantization, gate/up products, down products, combine). Off by default: one getenv.
class PhaseTimes {
 public:
  enum Phase { kRoute, kGroup, kGateUp, kDown, kCombine, kPhases };
  PhaseTimes() : path_(std::getenv("PYLLM_MOE_PROFILE")) {
    if (path_ != nullptr && *path_ == '\0') path_ = nullptr;
    if (path_ != nullptr) last_ = Clock::now();
  }
  // The time since the previous mark belongs to `phase`.
  void mark(Phase phase) {
    if (path_ == nullptr) return;
    const auto now = Clock::now();
    us_[phase] += std::chrono::duration<double, std::micro>(now - last_).count();
    last_ = now;
  }
  ~PhaseTimes() {
    if (path_ == nullptr) return;
    if (std::FILE* f = std::fopen(path_, "a")) {
      std::fprintf(f, "%.2f %.2f %.2f %.2f %.2f\n", us_[0], us_[1], us_[2], us_[3], us_[4]);
      std::fclose(f);
    }
  }

 private:
  using Clock = std::chrono::steady_clock;
  const char* path_;
  Clock::time_point last_;
  double us_[kPhases] = {};
};

// ---------------------------------------------------------------------------
// The step's state, in thread-local buffers of the calling thread (reused across
// calls; a prefill's large ones are let go at the end of the call).

template <typename S>
struct MoeStep {
  int64_t T, H, I, E, k;
  MoeActivation activation;
  float alpha, limit;
  MoeWeight gate, up, down;
  int64_t prompt_tokens;  // tokens [0, prompt_tokens) take the many-row paths
  // Routing: weights and ids [T * k]; the grouped row of each pair (-1: not local).
  std::vector<float> weights;
  std::vector<int32_t> ids;
  std::vector<int64_t> row;
  // Grouping, E groups of rows, two per local expert: group 2e holds expert e's rows of
  // prompt tokens, 2e + 1 its other rows where their paths differ (else group 2e holds
  // them all). Group g's rows are [start[g], start[g + 1]), row r is token token[r].
  std::vector<int64_t> start, token;
  std::vector<int32_t> order;  // the groups with rows, most rows first
  std::vector<MoePath> gate_path, up_path, down_path;  // per group
  // Gate/up inputs per grouped row: int8 (per type's span, G of gate / up) or S.
  QuantizedRows tokens_q, gate_q, up_q;
  std::vector<S> x;
  // Down inputs: the activations in float32 until quantized, int8, or S; spans
  // completed so far per (expert, span of the down type).
  std::vector<float> act;
  QuantizedRows act_q;
  std::vector<S> act_s;
  std::vector<int32_t> spans_done;
  const QuantizedRows* up_in = nullptr;  // gate_q or up_q
  // Down outputs [n, H] float32 (+ bias).
  std::vector<float> y;

  int64_t rows(int64_t g) const { return start[g + 1] - start[g]; }
  static int64_t expert(int64_t g) { return g / 2; }
};

// Frees buffers past this many bytes when a call ends, so that one prefill does not
// hold its memory for good.
constexpr size_t kKeepBytes = size_t{64} << 20;

template <typename V>
void release_if_large(V& v) {
  if (v.capacity() * sizeof(typename V::value_type) > kKeepBytes) V().swap(v);
}

template <typename S>
void release_large(MoeStep<S>& s) {
  for (QuantizedRows* q : {&s.tokens_q, &s.gate_q, &s.up_q, &s.act_q}) {
    release_if_large(q->q);
    release_if_large(q->d);
    release_if_large(q->s);
    release_if_large(q->isum);
  }
  release_if_large(s.x);
  release_if_large(s.act);
  release_if_large(s.act_s);
  release_if_large(s.y);
}

int64_t span_of(int64_t type) {
  int64_t span = 32;
  dispatch_type(type, [&](auto t) { span = Format<decltype(t)::value>::kBlock == 256 ? 256 : 32; });
  return span;
}

// ---------------------------------------------------------------------------
// Grouping.

// Rows per chunk of the small passes (quantizing, copying, combining) when each row
// costs about `width` operations: a chunk of 2^18, so that a decode step's passes run
// on the calling thread (a fork and join costs more than they do).
inline int64_t grain_rows(int64_t width) {
  return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(width, 1));
}

// Whether expert e's prompt rows (a of them) and other rows (b) take one path in each
// projection, so that they run as one group (the expert's weights read once).
template <typename S>
bool one_group(const MoeStep<S>& s, int64_t a, int64_t b) {
  if (a == 0 || b == 0) return true;
  for (const MoeWeight* w : {&s.gate, &s.up, &s.down}) {
    if (moe_path<S>(w->type, w->strips, a, true) != moe_path<S>(w->type, w->strips, b)) {
      return false;
    }
  }
  return true;
}

// Counting sort of the pairs by group (local expert, and prompt token or not), and
// each group's paths.
template <typename S>
void group_pairs(MoeStep<S>& s, int64_t expert_start) {
  const int64_t P = s.T * s.k, G = s.E, experts = G / 2;
  // Per expert: its rows of prompt tokens (count[2e]) and its others (count[2e + 1]),
  // and whether they run apart.
  thread_local std::vector<int64_t> count, group;  // group: of each pair (-1: not local)
  thread_local std::vector<bool> apart;
  count.assign(G, 0);
  group.assign(P, -1);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t e = s.ids[p] - expert_start;
    if (e >= 0 && e < experts) ++count[2 * e + (p / s.k >= s.prompt_tokens)];
  }
  apart.resize(experts);
  for (int64_t e = 0; e < experts; ++e) apart[e] = !one_group(s, count[2 * e], count[2 * e + 1]);
  s.start.assign(G + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t e = s.ids[p] - expert_start;
    if (e < 0 || e >= experts) continue;
    group[p] = 2 * e + (apart[e] && p / s.k >= s.prompt_tokens);
    ++s.start[group[p] + 1];
  }
  std::partial_sum(s.start.begin(), s.start.end(), s.start.begin());
  const int64_t n = s.start[G];
  s.row.resize(P);
  s.token.resize(n);
  thread_local std::vector<int64_t> next;
  next.assign(s.start.begin(), s.start.end() - 1);
  for (int64_t p = 0; p < P; ++p) {
    s.row[p] = group[p] >= 0 ? next[group[p]]++ : -1;
    if (s.row[p] >= 0) s.token[s.row[p]] = p / s.k;
  }
  s.order.clear();
  for (int64_t g = 0; g < G; ++g) {
    if (s.rows(g) > 0) s.order.push_back(static_cast<int32_t>(g));
  }
  std::stable_sort(s.order.begin(), s.order.end(),
                   [&](int32_t a, int32_t b) { return s.rows(a) > s.rows(b); });
  s.gate_path.resize(G);
  s.up_path.resize(G);
  s.down_path.resize(G);
  for (int32_t g : s.order) {
    // Group 2e holds prompt rows where the expert has any: its first row's token says.
    const bool many = g % 2 == 0 && s.token[s.start[g]] < s.prompt_tokens;
    s.gate_path[g] = moe_path<S>(s.gate.type, s.gate.strips, s.rows(g), many);
    s.up_path[g] = moe_path<S>(s.up.type, s.up.strips, s.rows(g), many);
    s.down_path[g] = moe_path<S>(s.down.type, s.down.strips, s.rows(g), many);
  }
}

// Copies row `from` of a to row `to` of b (both sized alike).
void copy_quantized_row(const QuantizedRows& a, int64_t from, QuantizedRows& b, int64_t to) {
  const int64_t K = a.K, spans = K / a.G, halves = K / 16;
  std::memcpy(b.q.data() + to * K, a.q.data() + from * K, K);
  std::memcpy(b.d.data() + to * spans, a.d.data() + from * spans, spans * sizeof(float));
  std::memcpy(b.s.data() + to * halves, a.s.data() + from * halves, halves * sizeof(float));
  std::memcpy(b.isum.data() + to * halves, a.isum.data() + from * halves, halves * 2);
}

// Rows of int8 inputs for the experts whose path for this projection is kInt8:
// each token quantized once (spans of `span`), copied to its pairs' rows.
template <typename S>
void gather_quantized(MoeStep<S>& s, const S* hidden, int64_t hidden_ld, int64_t span,
                      const std::vector<MoePath>& path, QuantizedRows& rows) {
  const int64_t n = s.start[s.E], H = s.H;
  size_rows(s.tokens_q, s.T, H, span);
  at::parallel_for(0, s.T, grain_rows(H), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t k = 0; k < H; k += span) {
        quantize_span_of(hidden + t * hidden_ld + k, s.tokens_q, t, k);
      }
    }
  });
  size_rows(rows, n, H, span);
  at::parallel_for(0, n, grain_rows(H / 4), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t e = std::upper_bound(s.start.begin(), s.start.end(), r) - s.start.begin() - 1;
      if (takes_int8(path[e])) copy_quantized_row(s.tokens_q, s.token[r], rows, r);
    }
  });
}

// The gate/up inputs of each grouped row: int8 rows where the expert takes the int8
// tiles, the token's own row where it takes a float path.
template <typename S>
void gather_inputs(MoeStep<S>& s, const S* hidden, int64_t hidden_ld) {
  const int64_t n = s.start[s.E], H = s.H;
  bool gate_int8 = false, up_int8 = false, floats = false;
  for (int32_t e : s.order) {
    gate_int8 |= takes_int8(s.gate_path[e]);
    up_int8 |= takes_int8(s.up_path[e]);
    floats |= !takes_int8(s.gate_path[e]) || !takes_int8(s.up_path[e]);
  }
  const int64_t gate_span = span_of(s.gate.type), up_span = span_of(s.up.type);
  if (gate_int8) gather_quantized(s, hidden, hidden_ld, gate_span, s.gate_path, s.gate_q);
  // Quantized gate and up take the same path per expert: one copy serves both when
  // their spans agree.
  s.up_in = gate_int8 && up_span == gate_span ? &s.gate_q : &s.up_q;
  if (up_int8 && s.up_in == &s.up_q) {
    gather_quantized(s, hidden, hidden_ld, up_span, s.up_path, s.up_q);
  }
  if (floats) {
    S* x = scratch(s.x, size_t(n) * H);
    at::parallel_for(0, n, grain_rows(H / 4), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        std::memcpy(x + r * H, hidden + s.token[r] * hidden_ld, H * sizeof(S));
      }
    });
  }
}

// ---------------------------------------------------------------------------
// The parallel regions: items (expert, columns [n0, n1)) from one shared counter.

struct Item {
  int32_t group;  // of an expert's rows (MoeStep)
  int32_t n0, n1;
};

// Items over N columns of each group in s.order (the busiest first, so that the
// longest items are not the last ones taken), `columns` wide.
template <typename S, typename Width>
void make_items(const MoeStep<S>& s, int64_t N, Width columns, std::vector<Item>& items) {
  items.clear();
  for (int32_t e : s.order) {
    const int64_t w = columns(e);
    for (int64_t n0 = 0; n0 < N; n0 += w) {
      items.push_back({e, static_cast<int32_t>(n0), static_cast<int32_t>(std::min(N, n0 + w))});
    }
  }
}

// Runs fn(item) for every item, on every thread that has work: one fork and join.
template <typename F>
void run_items(const std::vector<Item>& items, int64_t work, const F& fn) {
  if (items.empty()) return;
  const int64_t threads =
      work < kGrainWeights ? 1 : std::min<int64_t>(at::get_num_threads(), items.size());
  std::atomic<size_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (size_t i = next.fetch_add(1); i < items.size(); i = next.fetch_add(1)) fn(items[i]);
  });
}

// ---------------------------------------------------------------------------
// Gate/up and the activation.

// a[i] = act(g[i] + gate_bias[i], u[i] + up_bias[i]) for i in [0, n), float32.
template <typename S>
void activate_row(float* a, const float* g, const float* u, const S* gate_bias,
                  const S* up_bias, int64_t n, MoeActivation kind, float alpha, float limit) {
  using vec::Vec16;
  const Vec16 one = Vec16::set1(1.0f), zero = Vec16::zero();
  int64_t i = 0;
  for (; i + vec::kLanes <= n; i += vec::kLanes) {
    Vec16 x = Vec16::load(g + i), y = Vec16::load(u + i);
    if (gate_bias != nullptr) x = x + Vec16::load(gate_bias + i);
    if (up_bias != nullptr) y = y + Vec16::load(up_bias + i);
    Vec16 z;
    if (kind == MoeActivation::kSilu) {
      z = x * (one + (zero - x).exp()).reciprocal() * y;
    } else {
      // min(v, c) = -max(-v, -c): exact, and Vec16 has max only.
      const Vec16 lim = Vec16::set1(limit), neg_lim = zero - lim;
      x = zero - Vec16::max(zero - x, neg_lim);
      y = Vec16::max(zero - Vec16::max(zero - y, neg_lim), neg_lim);
      const Vec16 sig = (one + (zero - Vec16::set1(alpha) * x).exp()).reciprocal();
      z = (y + one) * x * sig;
    }
    z.store(a + i);
  }
  for (; i < n; ++i) {
    float x = g[i] + (gate_bias ? static_cast<float>(gate_bias[i]) : 0.0f);
    float y = u[i] + (up_bias ? static_cast<float>(up_bias[i]) : 0.0f);
    if (kind == MoeActivation::kSilu) {
      a[i] = x / (1.0f + std::exp(-x)) * y;
    } else {
      x = std::min(x, limit);
      y = std::clamp(y, -limit, limit);
      a[i] = (y + 1.0f) * x / (1.0f + std::exp(-alpha * x));
    }
  }
}

// Rows of expert e's activations in columns [n0, n1) are in s.act: quantizes each
// span of the down type's size that this completes (the item whose columns finish a
// span quantizes it; the counter's acquire-release orders the others' writes first).
template <typename S>
void complete_spans(MoeStep<S>& s, int64_t e, int64_t n0, int64_t n1) {
  const int64_t G = s.act_q.G, spans = s.I / G, m0 = s.start[e], R = s.rows(e);
  for (int64_t sp = n0 / G; sp * G < n1; ++sp) {
    const int64_t covered = std::min(n1, (sp + 1) * G) - std::max(n0, sp * G);
    std::atomic_ref<int32_t> done(s.spans_done[e * spans + sp]);
    if (done.fetch_add(static_cast<int32_t>(covered), std::memory_order_acq_rel) + covered < G) {
      continue;
    }
    for (int64_t r = m0; r < m0 + R; ++r) {
      quantize_span_of(s.act.data() + r * s.I + sp * G, s.act_q, r, sp * G);
    }
  }
}

template <typename S>
void gate_up_item(MoeStep<S>& s, const Item& it) {
  const int64_t e = it.group, x_e = s.expert(e), n0 = it.n0, n1 = it.n1, W = n1 - n0;
  const int64_t m0 = s.start[e], R = s.rows(e), H = s.H, I = s.I;
  thread_local std::vector<float> gate_buf, up_buf;
  float* g = scratch(gate_buf, size_t(R) * W);
  float* u = scratch(up_buf, size_t(R) * W);
  const S* x = s.x.empty() ? nullptr : s.x.data() + m0 * H;
  expert_columns<S>(s.gate, s.gate_path[e], x_e, H, {&s.gate_q, m0, x, H}, R, n0, n1, g, W);
  expert_columns<S>(s.up, s.up_path[e], x_e, H, {s.up_in, m0, x, H}, R, n0, n1, u, W);
  const S* gate_bias = s.gate.bias ? static_cast<const S*>(s.gate.bias) + x_e * I + n0 : nullptr;
  const S* up_bias = s.up.bias ? static_cast<const S*>(s.up.bias) + x_e * I + n0 : nullptr;
  const bool int8_down = takes_int8(s.down_path[e]);
  for (int64_t r = 0; r < R; ++r) {
    float* a = int8_down ? s.act.data() + (m0 + r) * I + n0 : g + r * W;
    activate_row(a, g + r * W, u + r * W, gate_bias, up_bias, W, s.activation, s.alpha, s.limit);
    if (!int8_down) store_floats(a, s.act_s.data() + (m0 + r) * I + n0, W);
  }
  if (int8_down) complete_spans(s, e, n0, n1);
}

// ---------------------------------------------------------------------------
// Down.

template <typename S>
void down_item(MoeStep<S>& s, const Item& it) {
  const int64_t e = it.group, n0 = it.n0, n1 = it.n1;
  const int64_t m0 = s.start[e], R = s.rows(e), H = s.H, I = s.I;
  float* y = s.y.data() + m0 * H + n0;
  const MoeRows<S> in{&s.act_q, m0, s.act_s.empty() ? nullptr : s.act_s.data() + m0 * I, I};
  expert_columns<S>(s.down, s.down_path[e], s.expert(e), I, in, R, n0, n1, y, H);
  if (s.down.bias == nullptr) return;
  const S* b = static_cast<const S*>(s.down.bias) + s.expert(e) * H;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t n = n0; n < n1; ++n) y[r * H + n - n0] += static_cast<float>(b[n]);
  }
}

// ---------------------------------------------------------------------------
// Combine: out[t] = sum over t's choices j, in order, of weight * its row of y.

template <typename S>
void combine(const MoeStep<S>& s, S* out) {
  const int64_t H = s.H, k = s.k;
  at::parallel_for(0, s.T, grain_rows(k * H), [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> acc_buf;
    float* acc = scratch(acc_buf, H);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc, acc + H, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = s.row[t * k + j];
        if (r < 0) continue;
        const float w = s.weights[t * k + j];
        const float* y = s.y.data() + r * H;
        const vec::Vec16 wv = vec::Vec16::set1(w);
        int64_t h = 0;
        for (; h + vec::kLanes <= H; h += vec::kLanes) {
          vec::Vec16::fmadd(wv, vec::Vec16::load(y + h), vec::Vec16::load(acc + h)).store(acc + h);
        }
        for (; h < H; ++h) acc[h] += w * y[h];
      }
      store_floats(acc, out + t * H, H);
    }
  });
}

// ---------------------------------------------------------------------------
// The whole step.

template <typename S>
void run_moe(MoeStep<S>& s, const at::Tensor& hidden, const at::Tensor& router_logits,
             bool renormalize, int64_t expert_start, S* out, PhaseTimes& phases) {
  const int64_t T = s.T, k = s.k, H = s.H, I = s.I;
  s.weights.resize(T * k);
  s.ids.resize(T * k);
  route(router_logits, k, renormalize, s.weights.data(), s.ids.data());
  phases.mark(PhaseTimes::kRoute);

  group_pairs(s, expert_start);
  const int64_t n = s.start[s.E];
  if (n == 0 || H == 0) {
    std::fill(out, out + T * H, S(0));
    return;
  }
  gather_inputs(s, hidden.const_data_ptr<S>(), hidden.stride(0));
  // The activations' buffers, by the experts' down paths.
  bool int8_down = false, floats_down = false;
  for (int32_t e : s.order) {
    int8_down |= takes_int8(s.down_path[e]);
    floats_down |= !takes_int8(s.down_path[e]);
  }
  if (int8_down) {
    scratch(s.act, size_t(n) * I);
    size_rows(s.act_q, n, I, span_of(s.down.type));
    s.spans_done.assign(s.E * (I / s.act_q.G), 0);
  }
  if (floats_down) scratch(s.act_s, size_t(n) * I);
  scratch(s.y, size_t(n) * H);
  phases.mark(PhaseTimes::kGroup);

  // Weights per projection of the experts in use: a region for less than
  // kGrainWeights runs on this thread alone, as quant_matmul's.
  const int64_t weights = static_cast<int64_t>(s.order.size()) * I * H;
  thread_local std::vector<Item> items;
  make_items(s, I, [&](int64_t e) {
    return item_columns(s.gate_path[e], s.gate.row_bytes + s.up.row_bytes, I);
  }, items);
  run_items(items, 2 * weights, [&](const Item& it) { gate_up_item(s, it); });
  phases.mark(PhaseTimes::kGateUp);

  make_items(s, H, [&](int64_t e) {
    return item_columns(s.down_path[e], s.down.row_bytes, H);
  }, items);
  run_items(items, weights, [&](const Item& it) { down_item(s, it); });
  phases.mark(PhaseTimes::kDown);

  combine(s, out);
  phases.mark(PhaseTimes::kCombine);
}

template <typename S>
MoeStep<S>& step_buffers() {
  thread_local MoeStep<S> step;
  return step;
}

}  // namespace

void moe_topk(at::Tensor& topk_weights, at::Tensor& topk_ids, const at::Tensor& router_logits,
              bool renormalize) {
  check_moe_topk(topk_weights, topk_ids, router_logits);
  route(router_logits, topk_weights.size(1), renormalize, topk_weights.data_ptr<float>(),
        topk_ids.data_ptr<int32_t>());
}

void fused_moe(at::Tensor& out, const at::Tensor& hidden, const at::Tensor& router_logits,
               int64_t top_k, bool renormalize, const at::Tensor& w_gate, const at::Tensor& w_up,
               const at::Tensor& w_down, int64_t gate_type, int64_t up_type, int64_t down_type,
               const std::optional<at::Tensor>& gate_bias,
               const std::optional<at::Tensor>& up_bias,
               const std::optional<at::Tensor>& down_bias, const std::string& activation,
               double alpha, double limit, int64_t expert_start, int64_t many_rows) {
  const MoeShape shape = check_fused_moe(out, hidden, router_logits, top_k, w_gate, w_up, w_down,
                                         gate_type, up_type, down_type, gate_bias, up_bias,
                                         down_bias, activation, alpha, limit, expert_start,
                                         many_rows);
#ifndef PYLLM_QUANT_STRIPS
  for (const int64_t type : {gate_type, up_type, down_type}) {
    TORCH_CHECK_VALUE(!is_strips(type), "type ", type, " (strips of GGML type ",
                      plain_type(type), ") is read by AVX2 and AVX-512 builds only ",
                      "(ops.strips_native() is False here); pass the GGUF rows");
  }
#endif
  if (shape.tokens == 0) return;
  PhaseTimes phases;
  PYLLM_DISPATCH_FLOATING_TYPES(hidden.scalar_type(), "fused_moe", [&] {
    MoeStep<scalar_t>& s = step_buffers<scalar_t>();
    s.T = shape.tokens;
    s.H = shape.hidden;
    s.I = shape.inter;
    s.E = 2 * shape.experts;  // groups (MoeStep)
    s.prompt_tokens = many_rows;
    s.k = top_k;
    s.activation = shape.activation;
    s.alpha = static_cast<float>(alpha);
    s.limit = static_cast<float>(limit);
    s.gate = moe_weight(w_gate, gate_type, gate_bias);
    s.up = moe_weight(w_up, up_type, up_bias);
    s.down = moe_weight(w_down, down_type, down_bias);
    run_moe(s, hidden, router_logits, renormalize, expert_start, out.data_ptr<scalar_t>(), phases);
    release_large(s);
  });
}

}  // namespace pyllm::cpu
