// The CPU attention ops: paged decode (v1, v2), paged causal prefill, and the same
// kernels over the contiguous layout. The kernels are in attention_cpu_kernels.h
// (decode and the general prefill), attention_cpu_prefill_lanes.h (prefill on
// AVX-512) and attention_cpu_prefill_amx.h (bfloat16 prefill on AMX), their
// scheduling in attention_cpu_tasks.h; the argument contract in attention_checks.h
// (shared with CUDA), the CPU's own index checks in attention_cpu_checks.h.

#include "attention_cpu_checks.h"
#include "attention_cpu_kernels.h"
#include "attention_cpu_prefill_amx.h"
#include "attention_cpu_prefill_lanes.h"
#include "attention_cpu_tasks.h"

namespace pyllm::cpu {

// Runs f(CacheType<T>{}) with T the cache's element type: the query's (scalar_t) or,
// for an int8 cache, int8_t.
template <typename T>
struct CacheType {
  using type = T;
};

template <typename scalar_t, typename F>
static void with_cache_type(const at::Tensor& key_cache, const F& f) {
  if (key_cache.scalar_type() == at::kChar) {
    f(CacheType<int8_t>{});
  } else {
    f(CacheType<scalar_t>{});
  }
}

// ---------------------------------------------------------------------------
// Ops.

// Runs of consecutive decode rows that read one sequence's keys: rows i, i + 1, ...
// at lengths L, L + 1, ... over the same blocks or slot, and the same first key (the
// rows of proposals being verified). A run is one task per kv head, which reads the
// keys once for all its rows; each row masks the keys past its own position, so its
// result is bitwise what it gives alone (masked keys add exact zeros).
struct DecodeRun {
  int64_t first;  // row
  int count;
};

// Whether rows a and b read the same keys over positions [0, len): the same slot, or
// the same blocks.
template <typename cache_t>
bool same_keys(const PagedCache<cache_t>& cache, int64_t a, int64_t b, int len) {
  if (cache.seq_slots != nullptr) return cache.seq_slots[a] == cache.seq_slots[b];
  const int32_t* row_a = cache.block_tables + a * cache.max_blocks_per_seq;
  return std::equal(row_a, row_a + (len + cache.block_size - 1) / cache.block_size,
                    cache.block_tables + b * cache.max_blocks_per_seq);
}

template <typename cache_t, typename FirstKey>
std::vector<DecodeRun> decode_runs(const PagedCache<cache_t>& cache, const int32_t* lens,
                                   int64_t num_seqs, const FirstKey& first_key) {
  constexpr int kMaxRunRows = 16;
  std::vector<DecodeRun> runs;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (!runs.empty()) {
      DecodeRun& run = runs.back();
      const int64_t last = run.first + run.count - 1;
      if (run.count < kMaxRunRows && lens[s] == lens[last] + 1 &&
          first_key(s) == first_key(last) && same_keys(cache, last, s, lens[s])) {
        ++run.count;
        continue;
      }
    }
    runs.push_back({s, 1});
  }
  return runs;
}

// Decode attention over either cache addressing (block tables, or seq slots of the
// contiguous layout): paged_attention_v1 and contiguous_attention_decode. The
// caller has checked the tensors' shapes (shape).
template <typename Addressing>
static void attention_decode(const char* op, const AttentionShape& shape, at::Tensor& out,
                             const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                             const Addressing& addressing, const at::Tensor& seq_lens,
                             int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                             int sliding_window, const std::optional<at::Tensor>& sinks,
                             const KVScales& scales) {
  check_addressing(op, addressing, seq_lens, shape, max_seq_len);
  const int64_t num_seqs = shape.num_tokens;
  const int group = int(shape.num_heads / num_kv_heads), head_size = int(shape.head_size);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float* alibi = alibi_slopes ? alibi_slopes->data_ptr<float>() : nullptr;
  const float* sink = sinks ? sinks->data_ptr<float>() : nullptr;
  const int bs = int(shape.block_size);
  // Each sequence's keys: from the block holding its window's start to its end.
  auto first_key = [&](int64_t s) { return block_start(window_start(lens[s] - 1, sliding_window), bs); };

  int64_t work = 0;  // query rows x key tokens of the whole call
  for (int64_t s = 0; s < num_seqs; ++s) work += int64_t(lens[s] - first_key(s)) * shape.num_heads;

  PYLLM_DISPATCH_FLOATING_TYPES(query.scalar_type(), "paged_attention_v1", [&] {
   with_cache_type<scalar_t>(key_cache, [&](auto cache_type) {
    using cache_t = typename decltype(cache_type)::type;
    const auto cache = make_cache<cache_t>(key_cache, value_cache, addressing, shape, scales);
    // Tasks (run, kv_head), the most rows x keys first.
    std::vector<DecodeRun> runs = decode_runs(cache, lens, num_seqs, first_key);
    auto cost = [&](const DecodeRun& r) {
      return int64_t(r.count) * (lens[r.first + r.count - 1] - first_key(r.first));
    };
    std::stable_sort(runs.begin(), runs.end(),
                     [&](const DecodeRun& a, const DecodeRun& b) { return cost(a) > cost(b); });
    const scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    // Task i: (run, kv_head) = (runs[i / num_kv_heads], i % num_kv_heads); it reads the
    // keys of the run's last (longest) row, whose blocks the others share.
    auto keys_of = [&](int64_t i) {
      const DecodeRun& run = runs[i / num_kv_heads];
      const int64_t last = run.first + run.count - 1;
      return KeyRange{last, int(i % num_kv_heads), first_key(last), lens[last]};
    };
    run_tasks(int64_t(runs.size()) * num_kv_heads, [&](int64_t i, int64_t following, Workspace& ws) {
      const DecodeRun& run = runs[i / num_kv_heads];
      const KeyRange keys = keys_of(i);
      const int kv_head = keys.kv_head;
      decode_rows<cache_t>(ws.rows, q, query.stride(0), run.first, run.count, kv_head, group,
                           head_size, float(scale), alibi, lens, keys.t_end, sliding_window);
      attend(cache, keys.seq, kv_head, keys.t_begin, keys.t_end,
             following >= 0 ? keys_of(following) : KeyRange{}, ws);
      for (int j = 0; j < run.count; ++j) {
        const int64_t s = run.first + j;
        scalar_t* dst = o + (s * shape.num_heads + int64_t(kv_head) * group) * head_size;
        for (int g = 0; g < group; ++g) {
          store_row(ws.rows, j * group + g, dst + g * head_size,
                    sink ? sink + kv_head * group + g : nullptr);
        }
      }
    }, work);
   });
  });
}

void paged_attention_v1(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                        const std::optional<at::Tensor>& sinks,
                        const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale) {
  const char* op = "paged_attention_v1";
  const PagedKVShape cache = check_paged_attention_v1(
      out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
      max_seq_len, alibi_slopes, sliding_window, sinks);
  check_paged_kv_scales(k_scale, v_scale, key_cache, cache, query.device());
  const AttentionShape shape = paged_shape(query, num_kv_heads, cache);
  attention_decode(op, shape, out, query, key_cache, value_cache, num_kv_heads, scale,
                   block_tables, seq_lens, max_seq_len, alibi_slopes, int(sliding_window), sinks,
                   kv_scales(k_scale, v_scale));
}

void paged_attention_v2(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,
                        at::Tensor& tmp_out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                        const std::optional<at::Tensor>& sinks,
                        const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale) {
  const char* op = "paged_attention_v2";
  const PagedKVShape cache = check_paged_attention_v2(
      out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
      block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, sliding_window, sinks);
  check_paged_kv_scales(k_scale, v_scale, key_cache, cache, query.device());
  const KVScales scales = kv_scales(k_scale, v_scale);
  const AttentionShape shape = paged_shape(query, num_kv_heads, cache);
  const int64_t num_seqs = shape.num_tokens, num_heads = shape.num_heads;
  // Each workspace tensor may hold more partitions than needed; index each by its own.
  const int64_t sums_parts = exp_sums.size(2), maxes_parts = max_logits.size(2),
                partial_parts = tmp_out.size(2);
  check_block_tables(op, block_tables, seq_lens, shape, max_seq_len);

  const int group = int(num_heads / num_kv_heads), head_size = int(shape.head_size);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float* alibi = alibi_slopes ? alibi_slopes->data_ptr<float>() : nullptr;
  const float* sink = sinks ? sinks->data_ptr<float>() : nullptr;
  const int window = int(sliding_window);
  // Each sequence's keys start at the block holding its window's start; the
  // partitions before that one are neither computed nor merged.
  auto first_key = [&](int64_t s) {
    return block_start(window_start(lens[s] - 1, window), int(shape.block_size));
  };
  auto first_partition = [&](int64_t s) { return first_key(s) / int(kPartitionSize); };

  // Tasks (seq, kv_head, partition) for the partitions that hold tokens. All
  // but each sequence's last are full, so the order hardly matters.
  struct Part {
    int64_t seq;
    int partition;
  };
  std::vector<Part> parts;
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int p = first_partition(s); p < num_partitions(lens[s]); ++p) parts.push_back({s, p});
  }

  PYLLM_DISPATCH_FLOATING_TYPES(query.scalar_type(), "paged_attention_v2", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    float* sums = exp_sums.data_ptr<float>();
    float* maxes = max_logits.data_ptr<float>();
    scalar_t* partial = tmp_out.data_ptr<scalar_t>();
   with_cache_type<scalar_t>(key_cache, [&](auto cache_type) {
    using cache_t = typename decltype(cache_type)::type;
    const auto cache = make_cache<cache_t>(key_cache, value_cache, block_tables, shape, scales);
    // Task i: partition parts[i / num_kv_heads] of kv head i % num_kv_heads.
    auto keys_of = [&](int64_t i) {
      const Part part = parts[i / num_kv_heads];
      const int t_begin = part.partition * int(kPartitionSize);
      return KeyRange{part.seq, int(i % num_kv_heads), std::max(t_begin, first_key(part.seq)),
                      std::min<int>(lens[part.seq], t_begin + kPartitionSize)};
    };
    run_tasks(
        int64_t(parts.size()) * num_kv_heads, [&](int64_t i, int64_t following, Workspace& ws) {
          const Part part = parts[i / num_kv_heads];
          const KeyRange keys = keys_of(i);
          const int kv_head = keys.kv_head;
          decode_rows<cache_t>(ws.rows, q, query.stride(0), part.seq, 1, kv_head, group,
                               head_size, float(scale), alibi, lens, keys.t_end, window);
          attend(cache, part.seq, kv_head, keys.t_begin, keys.t_end,
                 following >= 0 ? keys_of(following) : KeyRange{}, ws);
          for (int g = 0; g < group; ++g) {
            const int64_t head = part.seq * num_heads + int64_t(kv_head) * group + g;
            maxes[head * maxes_parts + part.partition] = ws.rows.max_logit[g];
            sums[head * sums_parts + part.partition] = ws.rows.exp_sum[g];
            store_row(ws.rows, g, partial + (head * partial_parts + part.partition) * head_size);
          }
        });
   });

    // Merge: out = sum_p w_p * tmp_out[p] / sum_p w_p, w_p = exp_sum_p * exp(max_p - max).
    // A sink joins here, once per head, as one more logit with no value: it takes part
    // in max and adds exp(sink - max) to the sum.
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_seqs * num_heads, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> merged(head_size);
      for (int64_t sh = begin; sh < end; ++sh) {
        const int64_t seq = sh / num_heads;
        const int first = first_partition(seq), parts_here = num_partitions(lens[seq]);
        const float* m = maxes + sh * maxes_parts;
        const float* l = sums + sh * sums_parts;
        const float sink_logit = sink ? sink[sh % num_heads] : kNegInf;
        float global_max = sink_logit;
        for (int p = first; p < parts_here; ++p) global_max = std::max(global_max, m[p]);
        std::fill(merged.begin(), merged.end(), 0.0f);
        // The sink's term (an empty sequence gets zeros: its weight all goes to the sink).
        float total = sink && global_max != kNegInf ? std::exp(sink_logit - global_max) : 0.0f;
        for (int p = first; p < parts_here; ++p) {
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
                              const std::optional<at::Tensor>& alibi_slopes, int sliding_window,
                              const std::optional<at::Tensor>& sinks, const KVScales& scales) {
  const int64_t num_seqs = seq_lens.size(0);
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
  const float* sink = sinks ? sinks->data_ptr<float>() : nullptr;
  const int bs = int(shape.block_size);
  // An int8 cache takes the general path below.
  const bool quantized = key_cache.scalar_type() == at::kChar;
#ifdef __AVX512F__
  // float32, and bfloat16 with AVX512-BF16: query rows in lanes (see prefill_lanes).
  if (query.scalar_type() == at::kFloat && !quantized) {
    const auto cache = make_cache<float>(key_cache, value_cache, addressing, shape);
    prefill_lanes(cache, query.data_ptr<float>(), query.stride(0), out.data_ptr<float>(),
                  shape.num_heads, num_seqs, lens, starts, float(scale), alibi, sliding_window,
                  sink);
    return;
  }
#endif
#ifdef PYLLM_AMX
  // bfloat16 on the tile unit (see prefill_amx), whatever the rows per sequence: a
  // row's result must not depend on how its prompt was split or batched, and the
  // tiles and the lanes round differently.
  if (query.scalar_type() == at::kBFloat16 && !quantized && !alibi && head_size % 32 == 0 &&
      amx::ready()) {
    const auto cache = make_cache<c10::BFloat16>(key_cache, value_cache, addressing, shape);
    prefill_amx(cache, query.data_ptr<c10::BFloat16>(), query.stride(0),
                out.data_ptr<c10::BFloat16>(), shape.num_heads, num_seqs, lens, starts,
                float(scale), sliding_window, sink);
    return;
  }
#endif
#ifdef __AVX512BF16__
  if (query.scalar_type() == at::kBFloat16 && !quantized) {
    const auto cache = make_cache<c10::BFloat16>(key_cache, value_cache, addressing, shape);
    prefill_lanes(cache, query.data_ptr<c10::BFloat16>(), query.stride(0),
                  out.data_ptr<c10::BFloat16>(), shape.num_heads, num_seqs, lens, starts,
                  float(scale), alibi, sliding_window, sink);
    return;
  }
#endif

  // Tasks (seq, kv_head, query tile), the most key positions first. A tile reads
  // keys from the block holding its first row's window start to its last row.
  struct Tile {
    int64_t seq;
    int first;  // first query token of the tile, relative to the sequence's
    int count;
    int first_key;
    int64_t cost;
  };
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int q_len = starts[s + 1] - starts[s];
    for (int i = 0; i < q_len; i += tile) {
      const int count = std::min(tile, q_len - i);
      const int first_pos = lens[s] - q_len + i, last_pos = first_pos + count - 1;
      const int first_key = block_start(window_start(first_pos, sliding_window), bs);
      tiles.push_back({s, i, count, first_key, int64_t(last_pos + 1 - first_key) * count});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.cost > b.cost; });

  PYLLM_DISPATCH_FLOATING_TYPES(query.scalar_type(), "paged_attention_prefill", [&] {
   with_cache_type<scalar_t>(key_cache, [&](auto cache_type) {
    using cache_t = typename decltype(cache_type)::type;
    constexpr int X = PagedCache<cache_t>::kX;
    const auto cache = make_cache<cache_t>(key_cache, value_cache, addressing, shape, scales);
    const scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t q_stride = query.stride(0);
    // Task i: query tile tiles[i / num_kv_heads] of kv head i % num_kv_heads; it
    // reads keys up to its last query token's position.
    auto keys_of = [&](int64_t i) {
      const Tile& t = tiles[i / num_kv_heads];
      const int q_len = starts[t.seq + 1] - starts[t.seq];
      return KeyRange{t.seq, int(i % num_kv_heads), t.first_key,
                      lens[t.seq] - q_len + t.first + t.count};
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
              rows.set_query<scalar_t, cache_t>(
                  r, q + token * q_stride + (int64_t(kv_head) * group + g) * head_size);
              rows.query_pos[r] = pos;
              rows.last_key[r] = pos;
              rows.first_key[r] = window_start(pos, sliding_window);
              if (alibi) rows.alibi[r] = alibi[kv_head * group + g];
            }
          }
          attend(cache, t.seq, kv_head, t.first_key, rows.last_key[rows.count - 1] + 1,
                 following >= 0 ? keys_of(following) : KeyRange{}, ws);
          for (int j = 0; j < t.count; ++j) {
            const int64_t token = starts[t.seq] + t.first + j;
            scalar_t* dst = o + (token * shape.num_heads + int64_t(kv_head) * group) * head_size;
            for (int g = 0; g < group; ++g) {
              store_row(rows, j * group + g, dst + g * head_size,
                        sink ? sink + kv_head * group + g : nullptr);
            }
          }
        });
   });
  });
}

void paged_attention_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t block_size,
                             int64_t max_query_len, const std::optional<at::Tensor>& alibi_slopes,
                             int64_t sliding_window, const std::optional<at::Tensor>& sinks,
                             const std::optional<at::Tensor>& k_scale,
                             const std::optional<at::Tensor>& v_scale) {
  const char* op = "paged_attention_prefill";
  const PagedKVShape cache = check_paged_attention_prefill(
      out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
      query_start_loc, block_size, max_query_len, alibi_slopes, sliding_window, sinks);
  check_paged_kv_scales(k_scale, v_scale, key_cache, cache, query.device());
  const AttentionShape shape = paged_shape(query, num_kv_heads, cache);
  attention_prefill(op, shape, out, query, key_cache, value_cache, num_kv_heads, scale,
                    block_tables, seq_lens, query_start_loc, alibi_slopes, int(sliding_window),
                    sinks, kv_scales(k_scale, v_scale));
}

// ---------------------------------------------------------------------------
// Contiguous KV layout (ops.h): the same kernels, addressed through seq_slots.

void contiguous_attention_decode(at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 int64_t num_kv_heads, double scale, const at::Tensor& seq_slots,
                                 const at::Tensor& seq_lens, int64_t max_seq_len,
                                 int64_t sliding_window, const std::optional<at::Tensor>& sinks,
                                 const std::optional<at::Tensor>& k_scale,
                                 const std::optional<at::Tensor>& v_scale) {
  const char* op = "contiguous_attention_decode";
  const ContiguousKVShape cache =
      check_contiguous_attention_decode(out, query, key_cache, value_cache, num_kv_heads, scale,
                                        seq_slots, seq_lens, max_seq_len, sliding_window, sinks);
  check_contiguous_kv_scales(k_scale, v_scale, key_cache, cache, query.device());
  const AttentionShape shape = contiguous_shape(query, num_kv_heads);
  const SlotAddressing slots = slot_addressing(key_cache, seq_slots, cache);
  attention_decode(op, shape, out, query, key_cache, value_cache, num_kv_heads, scale, slots,
                   seq_lens, max_seq_len, std::nullopt, int(sliding_window), sinks,
                   kv_scales(k_scale, v_scale));
}

void contiguous_attention_prefill(at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  int64_t num_kv_heads, double scale, const at::Tensor& seq_slots,
                                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                  int64_t max_query_len, int64_t sliding_window,
                                  const std::optional<at::Tensor>& sinks,
                                  const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale) {
  const char* op = "contiguous_attention_prefill";
  const ContiguousKVShape cache = check_contiguous_attention_prefill(
      out, query, key_cache, value_cache, num_kv_heads, scale, seq_slots, seq_lens,
      query_start_loc, max_query_len, sliding_window, sinks);
  check_contiguous_kv_scales(k_scale, v_scale, key_cache, cache, query.device());
  const AttentionShape shape = contiguous_shape(query, num_kv_heads);
  const SlotAddressing slots = slot_addressing(key_cache, seq_slots, cache);
  attention_prefill(op, shape, out, query, key_cache, value_cache, num_kv_heads, scale, slots,
                    seq_lens, query_start_loc, std::nullopt, int(sliding_window), sinks,
                    kv_scales(k_scale, v_scale));
}

}  // namespace pyllm::cpu
