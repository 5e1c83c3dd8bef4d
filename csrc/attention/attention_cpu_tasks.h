// Scheduling of the CPU attention tasks: running them on at::parallel_for's threads,
// and where each task's query rows and keys start.
//
// An internal header of attention_cpu.cpp, its only includer: what it defines stays in
// that translation unit (anonymous namespace), as when it was one file.
#pragma once

#include "attention_cpu_kernels.h"

namespace pyllm::cpu {
namespace {

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


// The first key position the query at query_pos sees (0 without a window).
inline int window_start(int query_pos, int sliding_window) {
  return sliding_window > 0 ? std::max(0, query_pos - sliding_window + 1) : 0;
}

// A prefill task of the row kernels (lanes, AMX tiles): up to their rows per task
// consecutive query rows of one sequence, row r being (query token r / group, head
// r % group), and its cost: rows x the keys they read.
struct RowTask {
  int64_t seq;
  int first_row;  // of the sequence's q_len * group rows
  int count;
  int64_t cost;
};

// Every sequence's rows as tasks of up to rows_per_task, the costliest first (claimed
// in that order, they spread evenly over the threads); work: their summed cost.
inline std::vector<RowTask> row_tasks(int64_t num_seqs, const int32_t* lens,
                                      const int32_t* starts, int group, int rows_per_task,
                                      int sliding_window, int64_t& work) {
  std::vector<RowTask> tasks;
  work = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int q_len = starts[s + 1] - starts[s];
    const int rows = q_len * group;
    for (int r = 0; r < rows; r += rows_per_task) {
      const int count = std::min(rows_per_task, rows - r);
      const int first_pos = lens[s] - q_len + r / group;
      const int last_pos = lens[s] - q_len + (r + count - 1) / group;
      const int first_key = window_start(first_pos, sliding_window);
      tasks.push_back({s, r, count, int64_t(last_pos + 1 - first_key) * count});
      work += tasks.back().cost;
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const RowTask& a, const RowTask& b) { return a.cost > b.cost; });
  return tasks;
}

// The cache block that holds key position `pos`, as its first token position.
inline int block_start(int pos, int block_size) { return pos / block_size * block_size; }

// Sets up the decode rows of `count` consecutive query tokens from `first` for
// kv_head: row (token j, head g) = j * group + g, at position lens[first + j] - 1,
// limited to keys before t_end and within the window. cache_t: the cache's element
// type (the query's, or int8).
template <typename cache_t, typename scalar_t>
void decode_rows(Rows& rows, const scalar_t* query, int64_t query_token_stride, int64_t first,
                 int count, int kv_head, int group, int head_size, float scale,
                 const float* alibi, const int32_t* lens, int t_end, int sliding_window) {
  constexpr int X = PagedCache<cache_t>::kX;
  rows.reset(count * group, head_size, X, scale, alibi != nullptr);
  for (int j = 0; j < count; ++j) {
    const int seq_len = lens[first + j];
    const scalar_t* q =
        query + (first + j) * query_token_stride + int64_t(kv_head) * group * head_size;
    for (int g = 0; g < group; ++g) {
      const int r = j * group + g;
      rows.set_query<scalar_t, cache_t>(r, q + g * head_size);
      rows.query_pos[r] = seq_len - 1;
      rows.last_key[r] = std::min(seq_len, t_end) - 1;
      rows.first_key[r] = window_start(seq_len - 1, sliding_window);
      if (alibi) rows.alibi[r] = alibi[kv_head * group + g];
    }
  }
}

// The factor that normalizes a row's acc when a sink joins its softmax: one more
// logit with no value, so out = acc * alpha / (exp_sum * alpha + exp(sink - m)) with
// m = max(max_logit, sink) and alpha = exp(max_logit - m) (0 when the row saw no
// key).
inline float sink_scale(float max_logit, float exp_sum, float sink) {
  const float m = std::max(max_logit, sink);
  if (m == kNegInf) return 0.0f;  // a -inf sink and no key: nothing to weigh
  const float alpha = std::exp(max_logit - m);
  return alpha / (exp_sum * alpha + std::exp(sink - m));
}

// Writes row r's normalized output (zeros when it saw no key); sink: the row's
// head's sink, or null.
template <typename scalar_t>
void store_row(const Rows& rows, int r, scalar_t* out, const float* sink = nullptr) {
  const float sum = rows.exp_sum[r];
  float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  if (sink != nullptr) inv = sink_scale(rows.max_logit[r], sum, *sink);
  const float* acc = &rows.acc[size_t(r) * rows.head_size];
  for (int d = 0; d < rows.head_size; ++d) out[d] = vec::from_float<scalar_t>(acc[d] * inv);
}

int num_partitions(int seq_len) { return int((seq_len + kPartitionSize - 1) / kPartitionSize); }

}  // namespace
}  // namespace pyllm::cpu
