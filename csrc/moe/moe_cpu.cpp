// CPU kernels of the mixture-of-experts ops: moe_topk (routing) and fused_moe (a
// whole MoE feed-forward: routing, the experts' gate/up and down projections, the
// activation, and the weighted sum back into each token's row).
//
// fused_moe groups the (token, expert) pairs of the step by expert, so that each
// expert's weights are read once for all the tokens routed to it; each expert's
// products go through quant_linear (GGUF blocks) or ATen's GEMM (floats). The
// weighted sum runs per token in its own top-k order, so a token's result does not
// depend on which other tokens share the step.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/core/Tensor.h>

#include "../dispatch_utils.h"
#include "../ops.h"
#include "moe_checks.h"

namespace pyllm::cpu {
namespace {

// Softmax of one row of logits (float32), then its top_k experts, largest first (the
// lower id first on ties), their weights renormalized to sum to 1 if asked: equal to
// a softmax over the top_k logits alone (gpt-oss's order of the two).
template <typename scalar_t>
void route_row(const scalar_t* logits, int64_t E, int64_t k, bool renormalize, float* weights,
               int32_t* ids, std::vector<float>& prob, std::vector<int32_t>& order) {
  float max = -INFINITY;
  for (int64_t e = 0; e < E; ++e) max = std::max(max, static_cast<float>(logits[e]));
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) {
    prob[e] = std::exp(static_cast<float>(logits[e]) - max);
    sum += prob[e];
  }
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    return prob[a] > prob[b] || (prob[a] == prob[b] && a < b);
  });
  float chosen = 0.0f;
  for (int64_t j = 0; j < k; ++j) chosen += prob[order[j]];
  const float scale = renormalize ? 1.0f / chosen : 1.0f / sum;
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = order[j];
    weights[j] = prob[order[j]] * scale;
  }
}

void route(const at::Tensor& router_logits, int64_t k, bool renormalize, float* weights,
           int32_t* ids) {
  const int64_t T = router_logits.size(0), E = router_logits.size(1);
  PYLLM_DISPATCH_FLOATING_TYPES(router_logits.scalar_type(), "moe_topk", [&] {
    const scalar_t* logits = router_logits.const_data_ptr<scalar_t>();
    at::parallel_for(0, T, std::max<int64_t>(1, 4096 / E), [&](int64_t t0, int64_t t1) {
      std::vector<float> prob(E);
      std::vector<int32_t> order(E);
      for (int64_t t = t0; t < t1; ++t) {
        route_row(logits + t * E, E, k, renormalize, weights + t * k, ids + t * k, prob, order);
      }
    });
  });
}

// out[n, :] = x[n, :] . w[e]^T (+ bias[e]) for one expert's rows.
void project(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t e,
             const std::optional<at::Tensor>& bias) {
  const at::Tensor we = w.select(0, e);
  std::optional<at::Tensor> be;
  if (bias.has_value()) be = bias->select(0, e);
  if (!is_float_weight_type(type)) {
    quant_linear(out, x, we, type, be);
  } else if (be.has_value()) {
    at::addmm_out(out, *be, x, we.t());
  } else {
    at::mm_out(out, x, we.t());
  }
}

// act[n, i] from gate[n, i] and up[n, i], in float32.
template <typename scalar_t>
void activate(const at::Tensor& gate, const at::Tensor& up, at::Tensor& act, MoeActivation kind,
              float alpha, float limit) {
  const int64_t n = gate.numel();
  const scalar_t* g = gate.const_data_ptr<scalar_t>();
  const scalar_t* u = up.const_data_ptr<scalar_t>();
  scalar_t* a = act.data_ptr<scalar_t>();
  at::parallel_for(0, n, 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float x = static_cast<float>(g[i]), y = static_cast<float>(u[i]);
      if (kind == MoeActivation::kSilu) {
        a[i] = static_cast<scalar_t>(x / (1.0f + std::exp(-x)) * y);
      } else {
        x = std::min(x, limit);
        y = std::clamp(y, -limit, limit);
        a[i] = static_cast<scalar_t>((y + 1.0f) * x / (1.0f + std::exp(-alpha * x)));
      }
    }
  });
}

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
               double alpha, double limit, int64_t expert_start) {
  const MoeShape s = check_fused_moe(out, hidden, router_logits, top_k, w_gate, w_up, w_down,
                                     gate_type, up_type, down_type, gate_bias, up_bias,
                                     down_bias, activation, alpha, limit, expert_start);
  const int64_t T = s.tokens, k = top_k, E = s.experts;
  if (T == 0) return;
  PhaseTimes phases;
  std::vector<float> weights(T * k);
  std::vector<int32_t> ids(T * k);
  route(router_logits, k, renormalize, weights.data(), ids.data());
  phases.mark(PhaseTimes::kRoute);

  // The pairs (token t, choice j) = t * k + j of each local expert, in pair order;
  // row[p]: the pair's row in the grouped buffers (-1: another rank's expert).
  std::vector<int64_t> start(E + 1, 0), row(T * k, -1);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t e = ids[p] - expert_start;
    if (e >= 0 && e < E) ++start[e + 1];
  }
  std::partial_sum(start.begin(), start.end(), start.begin());
  const int64_t n = start[E];
  std::vector<int64_t> token(n), next(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t e = ids[p] - expert_start;
    if (e < 0 || e >= E) continue;
    row[p] = next[e]++;
    token[row[p]] = p / k;
  }

  const auto options = hidden.options();
  at::Tensor y = at::empty({n, s.hidden}, options);
  if (n > 0) {
    const at::Tensor index =
        at::from_blob(token.data(), {n}, at::TensorOptions().dtype(at::kLong));
    const at::Tensor x = at::index_select(hidden, 0, index);
    phases.mark(PhaseTimes::kGroup);
    at::Tensor gate = at::empty({n, s.inter}, options), up = at::empty({n, s.inter}, options);
    at::Tensor act = at::empty({n, s.inter}, options);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = start[e], r1 = start[e + 1];
      if (r0 == r1) continue;
      at::Tensor g = gate.narrow(0, r0, r1 - r0), u = up.narrow(0, r0, r1 - r0);
      const at::Tensor xe = x.narrow(0, r0, r1 - r0);
      project(g, xe, w_gate, gate_type, e, gate_bias);
      project(u, xe, w_up, up_type, e, up_bias);
    }
    PYLLM_DISPATCH_FLOATING_TYPES(hidden.scalar_type(), "fused_moe", [&] {
      activate<scalar_t>(gate, up, act, s.activation, static_cast<float>(alpha),
                         static_cast<float>(limit));
    });
    phases.mark(PhaseTimes::kGateUp);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = start[e], r1 = start[e + 1];
      if (r0 == r1) continue;
      at::Tensor ye = y.narrow(0, r0, r1 - r0);
      project(ye, act.narrow(0, r0, r1 - r0), w_down, down_type, e, down_bias);
    }
  }
  phases.mark(PhaseTimes::kDown);

  // out[t] = sum over t's choices j, in order, of weight * its expert's row.
  PYLLM_DISPATCH_FLOATING_TYPES(hidden.scalar_type(), "fused_moe", [&] {
    const scalar_t* ys = y.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t H = s.hidden;
    at::parallel_for(0, T, std::max<int64_t>(1, 8192 / H), [&](int64_t t0, int64_t t1) {
      std::vector<float> acc(H);
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < k; ++j) {
          const int64_t r = row[t * k + j];
          if (r < 0) continue;
          const float w = weights[t * k + j];
          for (int64_t h = 0; h < H; ++h) acc[h] += w * static_cast<float>(ys[r * H + h]);
        }
        for (int64_t h = 0; h < H; ++h) o[t * H + h] = static_cast<scalar_t>(acc[h]);
      }
    });
  });
  phases.mark(PhaseTimes::kCombine);
}

}  // namespace pyllm::cpu
