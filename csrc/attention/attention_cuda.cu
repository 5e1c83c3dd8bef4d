// CUDA attention over the paged and the contiguous KV cache: the shared argument
// checks (attention_checks.h) and CUDA's own, dtype/head-size/block-size dispatch
// and launches. The kernels are in
// decode_kernels.cuh (paged_attention_v1/v2, contiguous_attention_decode) and
// prefill_kernel.cuh (paged_attention_prefill, contiguous_attention_prefill); the
// two layouts differ only in their addressing (kv_addressing.cuh).
//
// Only the dispatched variants are instantiated: 3 dtypes x 6 head sizes x 3
// block sizes for paged decode, 3 x 6 for contiguous decode (tile kTokenTile),
// 3 x 6 per layout for prefill (its block size is a runtime value), each once for
// a cache of the query's dtype and once for an int8 cache.
//
// The int8 cache's kernels (the C = int8_t variants) are UNVERIFIED ON A GPU:
// compiled and linked, not yet run.
//
// The sliding_window and sinks arguments (decode and prefill) are UNVERIFIED ON A
// GPU: compiled and linked, not yet run; the rest has passed the CUDA kernel tests
// on an H200.
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../dispatch_utils.h"
#include "../ops.h"
#include "attention_checks.h"
#include "decode_kernels.cuh"
#include "sizes.h"
#include "prefill_kernel.cuh"

namespace pyllm::cuda {
namespace {

// Calls f(std::integral_constant<int, head_size>) for a supported head size.
template <typename F>
void dispatch_head_size(int64_t head_size, F&& f) {
  TORCH_CHECK(pyllm::dispatch_head_size(head_size, f), "head_size ", head_size,
              " is not supported; supported: ", list_text(kHeadSizes));
}

template <typename F>
void dispatch_block_size(int64_t block_size, F&& f) {
  TORCH_CHECK(pyllm::dispatch_block_size(block_size, f), "block_size ", block_size,
              " is not supported; supported: ", list_text(kBlockSizes));
}

// The cache's element type for the kernels: the query's device type T, or int8_t.
template <typename C>
struct CacheType {
  using type = C;
};

// Runs f(CacheType<C>{}) with C = int8_t for an int8 cache, else T.
template <typename T, typename F>
void with_cache_type(const at::Tensor& key_cache, F&& f) {
  if (key_cache.scalar_type() == at::kChar) {
    f(CacheType<int8_t>{});
  } else {
    f(CacheType<T>{});
  }
}

// An int8 cache's scales (checked: float16, shaped like the cache without
// head_size), null for a float cache.
struct KVScales {
  const __half* key = nullptr;
  const __half* value = nullptr;
};

KVScales kv_scales(const std::optional<at::Tensor>& k_scale,
                   const std::optional<at::Tensor>& v_scale) {
  if (!k_scale || !v_scale) return {};
  return {reinterpret_cast<const __half*>(k_scale->data_ptr<at::Half>()),
          reinterpret_cast<const __half*>(v_scale->data_ptr<at::Half>())};
}

// The sinks' data (float32 [num_heads], checked), or null.
const float* sinks_ptr(const std::optional<at::Tensor>& sinks) {
  return sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
}

// The shape facts every attention op needs, checked once.
struct AttentionShape {
  int num_tokens;  // query rows (sequences for decode)
  int num_heads;
  int head_size;
  int num_kv_heads;
  int block_size;
};

AttentionShape attention_shape(const at::Tensor& query, int64_t num_kv_heads,
                               int64_t block_size) {
  return AttentionShape{static_cast<int>(query.size(0)), static_cast<int>(query.size(1)),
                        static_cast<int>(query.size(2)), static_cast<int>(num_kv_heads),
                        static_cast<int>(block_size)};
}

// The paged cache's addressing: block tables, and where a block's scales are.
PagedKV paged_kv(const at::Tensor& block_tables, const at::Tensor& value_cache,
                 const AttentionShape& shape) {
  PagedKV kv{};
  kv.block_tables = block_tables.data_ptr<int>();
  kv.block_tables_stride = block_tables.stride(0);
  kv.block_stride = value_cache.stride(0);
  kv.scale_head_stride = shape.block_size;
  kv.scale_block_stride = int64_t(shape.num_kv_heads) * shape.block_size;
  return kv;
}

// What the kernels need beyond the shared contract: CUDA tensors and caches that
// start on a 16-byte boundary (they load 16-byte vectors).
void check_cuda_caches(const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache) {
  check_cuda(query, "query");
  check_aligned16(key_cache, "key_cache");
  check_aligned16(value_cache, "value_cache");
}

// The contiguous views' addressing (checked by check_contiguous_kv_cache); their
// outer strides must also be multiples of 16 bytes.
ContiguousKV contiguous_kv(const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const at::Tensor& seq_slots, const ContiguousKVShape& cache) {
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK((key_cache.stride(d) * key_cache.element_size()) % 16 == 0,
                "the (slot, kv head, tile) strides of key_cache/value_cache must be "
                "multiples of 16 bytes on CUDA, got ",
                key_cache.strides());
  }
  ContiguousKV kv{};
  kv.seq_slots = seq_slots.data_ptr<int>();
  kv.num_slots = cache.num_slots;
  kv.capacity = cache.num_tiles * kTokenTile;
  kv.key_slot_stride = key_cache.stride(0);
  kv.key_head_stride = key_cache.stride(1);
  kv.key_tile_stride = key_cache.stride(2);
  kv.value_slot_stride = value_cache.stride(0);
  kv.value_head_stride = value_cache.stride(1);
  kv.value_tile_stride = value_cache.stride(2);
  kv.scale_tile_stride = static_cast<int>(kTokenTile);
  kv.scale_head_stride = cache.num_tiles * kTokenTile;
  kv.scale_slot_stride = cache.num_kv_heads * kv.scale_head_stride;
  return kv;
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, typename KV, typename C>
void launch_decode(const DecodeParams<T, KV, C>& params, dim3 grid, cudaStream_t stream) {
  attention_decode_kernel<T, HEAD_SIZE, BLOCK_SIZE, KV, C>
      <<<grid, kDecodeThreads, 0, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Where decode writes: `out` directly (one partition), or the partition workspace
// followed by the reduce (exp_sums defined).
struct DecodeOutputs {
  at::Tensor* out;
  at::Tensor* exp_sums = nullptr;
  at::Tensor* max_logits = nullptr;
  at::Tensor* tmp_out = nullptr;
  int num_partitions = 1;  // partitions the grid covers
  int max_partitions = 1;  // the workspace's partition dimension
};

// The decode launch for either layout; shapes and workspace are already checked.
// BLOCK_SIZE: the paged block size, or kTokenTile for the contiguous layout.
template <typename KV, typename BlockSizeDispatch>
void run_decode(const DecodeOutputs& o, const at::Tensor& query, const at::Tensor& key_cache,
                const at::Tensor& value_cache, const KV& kv, const at::Tensor& seq_lens,
                const AttentionShape& shape, double scale, const float* alibi_slopes,
                int sliding_window, const float* sinks, const KVScales& scales,
                BlockSizeDispatch&& dispatch_block) {
  if (shape.num_tokens == 0 || shape.num_heads == 0) return;
  // Grid y and z are limited to 65535.
  TORCH_CHECK(shape.num_tokens <= 65535 && o.num_partitions <= 65535,
              "decode attention handles at most 65535 sequences and 65535 partitions per call, "
              "got ", shape.num_tokens, " and ", o.num_partitions);
  const bool partitioned = o.exp_sums != nullptr;

  const c10::cuda::CUDAGuard device_guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(shape.num_heads, shape.num_tokens, o.num_partitions);

  PYLLM_DISPATCH_FLOATING_TYPES(query.scalar_type(), "attention_decode", [&] {
    using T = device_t<scalar_t>;
   with_cache_type<T>(key_cache, [&](auto cache_type) {
    using C = typename decltype(cache_type)::type;
    DecodeParams<T, KV, C> params{};
    params.out = device_ptr<scalar_t>(*o.out);
    if (partitioned) {
      params.exp_sums = o.exp_sums->data_ptr<float>();
      params.max_logits = o.max_logits->data_ptr<float>();
      params.tmp_out = device_ptr<scalar_t>(*o.tmp_out);
    }
    params.query = device_ptr<scalar_t>(query);
    params.key_cache = static_cast<const C*>(key_cache.data_ptr());
    params.value_cache = static_cast<const C*>(value_cache.data_ptr());
    params.k_scale = scales.key;
    params.v_scale = scales.value;
    params.kv = kv;
    params.seq_lens = seq_lens.data_ptr<int>();
    params.alibi_slopes = alibi_slopes;
    params.sinks = sinks;
    params.q_stride = query.stride(0);
    params.num_heads = shape.num_heads;
    params.num_kv_heads = shape.num_kv_heads;
    params.scale = static_cast<float>(scale);
    params.partition_size = partitioned ? static_cast<int>(kPartitionSize) : 0;
    params.max_partitions = o.max_partitions;
    params.sliding_window = sliding_window;

    dispatch_head_size(shape.head_size, [&](auto head) {
      dispatch_block([&](auto block) {
        launch_decode<T, decltype(head)::value, decltype(block)::value, KV, C>(params, grid,
                                                                               stream);
      });
    });
    if (partitioned) {
      attention_reduce_kernel<T>
          <<<dim3(shape.num_heads, shape.num_tokens), kDecodeThreads, 0, stream>>>(
              params.out, params.exp_sums, params.max_logits, params.tmp_out, params.seq_lens,
              sinks, shape.head_size, static_cast<int>(kPartitionSize), o.num_partitions,
              o.max_partitions, sliding_window);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
   });
  });
}

// v1 when exp_sums is undefined, v2 otherwise (then followed by the reduce); the
// caller has checked the arguments (attention_checks.h).
void paged_attention_decode(at::Tensor& out, at::Tensor* exp_sums, at::Tensor* max_logits,
                            at::Tensor* tmp_out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            int64_t num_kv_heads, double scale, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
                            const std::optional<at::Tensor>& alibi_slopes,
                            int64_t sliding_window, const std::optional<at::Tensor>& sinks,
                            const KVScales& scales) {
  check_cuda_caches(query, key_cache, value_cache);
  const AttentionShape shape = attention_shape(query, num_kv_heads, block_size);
  DecodeOutputs outputs{&out, exp_sums, max_logits, tmp_out};
  at::Tensor scratch_sums, scratch_maxes, scratch_out;
  if (exp_sums != nullptr) {
    const int num_partitions =
        static_cast<int>((max_seq_len + kPartitionSize - 1) / kPartitionSize);
    outputs.num_partitions = num_partitions;
    outputs.max_partitions = static_cast<int>(tmp_out->size(2));
    // The kernels index the three workspaces with one partition stride; where the
    // caller's differ (each may hold spare partitions), the call takes scratch ones.
    if (exp_sums->size(2) != tmp_out->size(2) || max_logits->size(2) != tmp_out->size(2)) {
      scratch_sums = at::empty({shape.num_tokens, shape.num_heads, num_partitions},
                               exp_sums->options());
      scratch_maxes = at::empty({shape.num_tokens, shape.num_heads, num_partitions},
                                exp_sums->options());
      scratch_out = at::empty({shape.num_tokens, shape.num_heads, num_partitions,
                               shape.head_size}, tmp_out->options());
      outputs.exp_sums = &scratch_sums;
      outputs.max_logits = &scratch_maxes;
      outputs.tmp_out = &scratch_out;
      outputs.max_partitions = num_partitions;
    }
  }
  run_decode(outputs, query, key_cache, value_cache, paged_kv(block_tables, value_cache, shape),
             seq_lens, shape, scale,
             alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr,
             static_cast<int>(sliding_window), sinks_ptr(sinks), scales,
             [&](auto&& launch) { dispatch_block_size(shape.block_size, launch); });
}

// Whether contiguous decode should split each sequence into partitions: only when
// the (sequence, head) pairs alone leave the GPU's SMs idle and some sequence is
// long enough to split. kBlocksPerSm is a first guess at "enough blocks to fill
// an SM" for 128-thread blocks, not yet tuned on a GPU.
bool decode_needs_partitions(int64_t pairs, int64_t max_seq_len, const at::Device& device) {
  constexpr int64_t kBlocksPerSm = 4;
  if (max_seq_len <= kPartitionSize) return false;
  int sm_count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount,
                                        device.index()));
  return pairs < kBlocksPerSm * sm_count;
}

template <typename T, int HEAD_SIZE, typename KV, typename C>
void launch_prefill(const PrefillParams<T, KV, C>& params, dim3 grid, cudaStream_t stream) {
  constexpr size_t kBytes = PrefillSmem<HEAD_SIZE>::kBytes;
  auto* kernel = &attention_prefill_kernel<T, HEAD_SIZE, KV, C>;
  if constexpr (kBytes > 48 * 1024) {
    // Beyond the default dynamic shared memory limit: opt in (head size 256).
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kBytes)));
  }
  kernel<<<grid, kPrefillThreads, kBytes, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The prefill launch for either layout; shapes are already checked.
template <typename KV>
void run_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                 const at::Tensor& value_cache, const KV& kv, const at::Tensor& seq_lens,
                 const at::Tensor& query_start_loc, const AttentionShape& shape, int num_seqs,
                 double scale, const float* alibi_slopes, int sliding_window,
                 const float* sinks, const KVScales& scales) {
  if (shape.num_tokens == 0 || num_seqs == 0 || shape.num_heads == 0) return;
  const c10::cuda::CUDAGuard device_guard(query.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // An upper bound on the number of query tiles: sum_s ceil(q_len_s / tile)
  // <= num_tokens / tile + num_seqs. Blocks past the last tile exit at once.
  const dim3 grid(ceil_div(shape.num_tokens, kQueryTile) + num_seqs, shape.num_heads);

  PYLLM_DISPATCH_FLOATING_TYPES(query.scalar_type(), "attention_prefill", [&] {
    using T = device_t<scalar_t>;
   with_cache_type<T>(key_cache, [&](auto cache_type) {
    using C = typename decltype(cache_type)::type;
    PrefillParams<T, KV, C> params{};
    params.out = device_ptr<scalar_t>(out);
    params.query = device_ptr<scalar_t>(query);
    params.key_cache = static_cast<const C*>(key_cache.data_ptr());
    params.value_cache = static_cast<const C*>(value_cache.data_ptr());
    params.k_scale = scales.key;
    params.v_scale = scales.value;
    params.kv = kv;
    params.seq_lens = seq_lens.data_ptr<int>();
    params.query_start_loc = query_start_loc.data_ptr<int>();
    params.alibi_slopes = alibi_slopes;
    params.sinks = sinks;
    params.q_stride = query.stride(0);
    params.num_seqs = num_seqs;
    params.num_heads = shape.num_heads;
    params.num_kv_heads = shape.num_kv_heads;
    params.block_size = shape.block_size;
    params.scale = static_cast<float>(scale);
    params.sliding_window = sliding_window;
    dispatch_head_size(shape.head_size, [&](auto head) {
      launch_prefill<T, decltype(head)::value, KV, C>(params, grid, stream);
    });
   });
  });
}

}  // namespace

void paged_attention_v1(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                        const std::optional<at::Tensor>& sinks,
                        const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale) {
  const PagedKVShape cache = check_paged_attention_v1(
      out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
      block_size, max_seq_len, alibi_slopes, sliding_window, sinks);
  check_paged_kv_scales(k_scale, v_scale, key_cache, cache, query.device());
  paged_attention_decode(out, nullptr, nullptr, nullptr, query, key_cache, value_cache,
                         num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len,
                         alibi_slopes, sliding_window, sinks, kv_scales(k_scale, v_scale));
}

void paged_attention_v2(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,
                        at::Tensor& tmp_out, const at::Tensor& query,
                        const at::Tensor& key_cache, const at::Tensor& value_cache,
                        int64_t num_kv_heads, double scale, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                        const std::optional<at::Tensor>& sinks,
                        const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale) {
  const PagedKVShape cache = check_paged_attention_v2(
      out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
      block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, sliding_window, sinks);
  check_paged_kv_scales(k_scale, v_scale, key_cache, cache, query.device());
  paged_attention_decode(out, &exp_sums, &max_logits, &tmp_out, query, key_cache, value_cache,
                         num_kv_heads, scale, block_tables, seq_lens, block_size, max_seq_len,
                         alibi_slopes, sliding_window, sinks, kv_scales(k_scale, v_scale));
}

void paged_attention_prefill(at::Tensor& out, const at::Tensor& query,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             int64_t num_kv_heads, double scale, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                             int64_t block_size, int64_t max_query_len,
                             const std::optional<at::Tensor>& alibi_slopes,
                             int64_t sliding_window, const std::optional<at::Tensor>& sinks,
                             const std::optional<at::Tensor>& k_scale,
                             const std::optional<at::Tensor>& v_scale) {
  // max_query_len is checked but not read: tiles are found from query_start_loc.
  const PagedKVShape cache = check_paged_attention_prefill(
      out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
      query_start_loc, block_size, max_query_len, alibi_slopes, sliding_window, sinks);
  check_paged_kv_scales(k_scale, v_scale, key_cache, cache, query.device());
  check_cuda_caches(query, key_cache, value_cache);
  const AttentionShape shape = attention_shape(query, num_kv_heads, block_size);
  const int num_seqs = static_cast<int>(block_tables.size(0));
  if (shape.num_tokens == 0 || num_seqs == 0 || shape.num_heads == 0) return;
  run_prefill(out, query, key_cache, value_cache, paged_kv(block_tables, value_cache, shape),
              seq_lens, query_start_loc, shape, num_seqs, scale,
              alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr,
              static_cast<int>(sliding_window), sinks_ptr(sinks), kv_scales(k_scale, v_scale));
}

// Decode over the contiguous layout. Unlike paged_attention_v2 it takes no
// workspace: when it splits sequences into partitions (decode_needs_partitions),
// it allocates exp_sums / max_logits / tmp_out itself from torch's caching
// allocator, so the choice stays inside the op.
void contiguous_attention_decode(at::Tensor& out, const at::Tensor& query,
                                 const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 int64_t num_kv_heads, double scale, const at::Tensor& seq_slots,
                                 const at::Tensor& seq_lens, int64_t max_seq_len,
                                 int64_t sliding_window, const std::optional<at::Tensor>& sinks,
                                 const std::optional<at::Tensor>& k_scale,
                                 const std::optional<at::Tensor>& v_scale) {
  const ContiguousKVShape cache =
      check_contiguous_attention_decode(out, query, key_cache, value_cache, num_kv_heads, scale,
                                        seq_slots, seq_lens, max_seq_len, sliding_window, sinks);
  check_contiguous_kv_scales(k_scale, v_scale, key_cache, cache, query.device());
  check_cuda_caches(query, key_cache, value_cache);
  const int64_t num_seqs = query.size(0);
  ContiguousKV kv = contiguous_kv(key_cache, value_cache, seq_slots, cache);
  // max_seq_len bounds seq_lens: a longer sequence would fall outside the
  // partitions launched, so the kernel treats it like one past the slot's
  // capacity (NaN output) rather than silently truncating it.
  kv.capacity = std::min(kv.capacity, max_seq_len);
  const AttentionShape shape = attention_shape(query, num_kv_heads, kTokenTile);
  if (shape.num_tokens == 0 || shape.num_heads == 0) return;

  DecodeOutputs outputs{&out};
  at::Tensor exp_sums;
  at::Tensor max_logits;
  at::Tensor tmp_out;
  if (decode_needs_partitions(num_seqs * shape.num_heads, kv.capacity, query.device())) {
    const int64_t parts = (kv.capacity + kPartitionSize - 1) / kPartitionSize;
    const auto floats = query.options().dtype(at::kFloat);
    exp_sums = at::empty({num_seqs, shape.num_heads, parts}, floats);
    max_logits = at::empty({num_seqs, shape.num_heads, parts}, floats);
    tmp_out = at::empty({num_seqs, shape.num_heads, parts, shape.head_size}, query.options());
    outputs = DecodeOutputs{&out, &exp_sums, &max_logits, &tmp_out, static_cast<int>(parts),
                            static_cast<int>(parts)};
  }
  run_decode(outputs, query, key_cache, value_cache, kv, seq_lens, shape, scale, nullptr,
             static_cast<int>(sliding_window), sinks_ptr(sinks), kv_scales(k_scale, v_scale),
             [](auto&& launch) { launch(std::integral_constant<int, kTokenTile>{}); });
}

void contiguous_attention_prefill(at::Tensor& out, const at::Tensor& query,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  int64_t num_kv_heads, double scale,
                                  const at::Tensor& seq_slots, const at::Tensor& seq_lens,
                                  const at::Tensor& query_start_loc, int64_t max_query_len,
                                  int64_t sliding_window,
                                  const std::optional<at::Tensor>& sinks,
                                  const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale) {
  // max_query_len is checked but not read: tiles are found from query_start_loc.
  const ContiguousKVShape cache = check_contiguous_attention_prefill(
      out, query, key_cache, value_cache, num_kv_heads, scale, seq_slots, seq_lens,
      query_start_loc, max_query_len, sliding_window, sinks);
  check_contiguous_kv_scales(k_scale, v_scale, key_cache, cache, query.device());
  check_cuda_caches(query, key_cache, value_cache);
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(num_seqs <= INT32_MAX, "at most INT32_MAX sequences, got ", num_seqs);
  const ContiguousKV kv = contiguous_kv(key_cache, value_cache, seq_slots, cache);
  const AttentionShape shape = attention_shape(query, num_kv_heads, kTokenTile);
  run_prefill(out, query, key_cache, value_cache, kv, seq_lens, query_start_loc, shape,
              static_cast<int>(num_seqs), scale, nullptr, static_cast<int>(sliding_window),
              sinks_ptr(sinks), kv_scales(k_scale, v_scale));
}

}  // namespace pyllm::cuda
