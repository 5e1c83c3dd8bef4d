// Decode attention: one query token per sequence, over either KV cache layout
// (kv_addressing.cuh: paged blocks, or the contiguous arena's tiles of kTokenTile
// tokens; "block" below means either).
//
// One thread block of kDecodeThreads handles one (query head, sequence,
// partition). Its warps take the partition's KV blocks in turn (warp w reads
// blocks w, w + kDecodeWarps, ...), each keeping its own online softmax state
// (running max m, running sum l, unnormalised output acc); the warps' states
// are merged once at the end. Nothing is sized by the sequence length, so
// paged_attention_v1 (one partition = the whole sequence) works at any
// context, and paged_attention_v2 runs the same kernel with partitions of
// kPartitionSize tokens followed by attention_reduce_kernel;
// contiguous_attention_decode picks one of the two per call.
//
// Sinks (one logit per head with no value, gpt-oss) only change the final
// normalization: v1 folds the head's sink into its merge of the warps, v2 into
// attention_reduce_kernel's merge of the partitions (never per partition, whose
// max and sum the reduce needs as they are).
//
// Memory access (the kernel is bound by reading K and V once):
// - Key block of one head: [head_size / x][block_size][x], x = 16 bytes of
//   elements. Lane = (group_lane, token_lane) with 8 token lanes: the 8 lanes
//   of one group lane read 8 consecutive tokens' 16-byte chunks of the same
//   x-group, i.e. one whole 128-byte line per 8 lanes.
// - Value block of one head: [head_size][block_size], contiguous; lane i of a
//   pass reads the i-th 16-byte chunk, so each pass is 512 contiguous bytes.
//
// int8 cache (C = int8_t, x = 16, float16 scales per token): the scales are
// factored out of both products, q . k = s_k (q . k_int8) once per logit, and
// sum_t p_t v_t = sum_t (p_t s_v,t) v_int8,t with p_t s_v,t in block_probs (the
// running sum l keeps the unscaled p_t). With block_size 8 a value row is 8 bytes,
// read as 8-byte chunks.
#pragma once

#include <type_traits>

#include "../cuda_utils.cuh"
#include "kv_addressing.cuh"
#include "kv_chunks.cuh"

namespace pyllm::cuda {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / kWarpSize;
// Lanes reading consecutive tokens of one key x-group (8 x 16 B = 128 B).
constexpr int kTokenLanes = 8;
// Lanes reading different x-groups of the same tokens.
constexpr int kGroupLanes = kWarpSize / kTokenLanes;

template <typename T, typename KV, typename C = T>
struct DecodeParams {
  T* out;               // v1: [num_seqs, num_heads, head_size]
  float* exp_sums;      // v2: [num_seqs, num_heads, max_partitions]; null for v1
  float* max_logits;    // v2: same shape as exp_sums
  T* tmp_out;           // v2: [num_seqs, num_heads, max_partitions, head_size]
  const T* query;       // [num_seqs, num_heads, head_size], token stride q_stride
  const C* key_cache;   // paged [num_blocks, num_kv_heads, head_size / x, block_size, x]
  const C* value_cache; // paged [num_blocks, num_kv_heads, head_size, block_size]
  const __half* k_scale;  // int8 cache: paged [num_blocks, num_kv_heads, block_size]
  const __half* v_scale;
  KV kv;                // where each sequence's blocks are (kv_addressing.cuh)
  const int* seq_lens;      // [num_seqs]
  const float* alibi_slopes;  // [num_heads] or null
  const float* sinks;         // [num_heads] or null
  int64_t q_stride;
  int num_heads;
  int num_kv_heads;
  float scale;
  int partition_size;  // tokens per partition (a multiple of block_size); 0: whole sequence
  int max_partitions;  // exp_sums/max_logits/tmp_out's partition dimension
  int sliding_window;  // 0: none; else the query sees the last sliding_window positions
};

// The first key position a decode query sees: the start of its sliding window.
__device__ __forceinline__ int decode_window_start(int seq_len, int sliding_window) {
  return sliding_window > 0 ? max(0, seq_len - sliding_window) : 0;
}

// Compile-time shape of the per-lane work for one (cache dtype, head size, block size).
template <typename T, int HEAD_SIZE, int BLOCK_SIZE>
struct DecodeShape {
  static constexpr int kX = Vec16<T>::kSize;
  // Tokens per value chunk: x, or 8 for int8 blocks of 8 (8-byte chunks).
  static constexpr int kVX = kX < BLOCK_SIZE ? kX : BLOCK_SIZE;
  static_assert(HEAD_SIZE % kX == 0 && BLOCK_SIZE % kTokenLanes == 0 && BLOCK_SIZE % kVX == 0,
                "head size and block size must tile into 16-byte chunks");
  // Keys: x-groups per head, and how many of them each group lane multiplies.
  static constexpr int kGroups = HEAD_SIZE / kX;
  static constexpr int kGroupsPerLane = (kGroups + kGroupLanes - 1) / kGroupLanes;
  static constexpr int kFullGroupIters = kGroups / kGroupLanes;  // no lane out of range
  static constexpr int kTokensPerLane = BLOCK_SIZE / kTokenLanes;
  // Values: a head dimension's block_size tokens are kChunksPerRow 16-byte chunks.
  static constexpr int kChunksPerRow = BLOCK_SIZE / kVX;
  static constexpr int kRowsPerPass = kWarpSize / kChunksPerRow;
  static constexpr int kPasses = (HEAD_SIZE + kRowsPerPass - 1) / kRowsPerPass;
  static constexpr int kFullPasses = HEAD_SIZE / kRowsPerPass;
  // Issue a block's value loads together with its key loads (before the softmax
  // math) when the registers allow; the big float32 variants load them later.
  static constexpr bool kPreloadValues = kPasses <= 8;
};

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, typename KV, typename C = T>
__global__ void __launch_bounds__(kDecodeThreads)
    attention_decode_kernel(const DecodeParams<T, KV, C> p) {
  using S = DecodeShape<C, HEAD_SIZE, BLOCK_SIZE>;
  constexpr int X = S::kX;
  constexpr int VX = S::kVX;
  constexpr bool kQuantized = std::is_same_v<C, int8_t>;

  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int partition = blockIdx.z;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const bool partitioned = p.exp_sums != nullptr;

  const int seq_len = p.seq_lens[seq];
  const int part_start = partitioned ? partition * p.partition_size : 0;
  if (part_start >= seq_len) {
    // v2: this partition is past the sequence's end and the reduce kernel never
    // reads it. v1 with an empty sequence: attention over nothing is zero.
    if (!partitioned) {
      T* out = p.out + (static_cast<int64_t>(seq) * p.num_heads + head) * HEAD_SIZE;
      for (int d = threadIdx.x; d < HEAD_SIZE; d += kDecodeThreads) out[d] = from_float<T>(0.f);
    }
    return;
  }
  // v2: a partition wholly before the window is skipped here and by the reduce.
  const int window_start = decode_window_start(seq_len, p.sliding_window);
  if (partitioned && part_start + p.partition_size <= window_start) return;
  const int part_end = partitioned ? min(seq_len, part_start + p.partition_size) : seq_len;
  // Blocks wholly before the window are never read (they may be another sequence's).
  const int first_block = max(part_start, window_start) / BLOCK_SIZE;
  const int end_block = (part_end + BLOCK_SIZE - 1) / BLOCK_SIZE;

  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int token_lane = lane % kTokenLanes;
  const int group_lane = lane / kTokenLanes;
  const float alibi_slope = p.alibi_slopes ? p.alibi_slopes[head] : 0.f;
  // The query sits at the last position of the sequence.
  const int query_pos = seq_len - 1;

  // The query x-groups this lane multiplies (g = group_lane + kGroupLanes * i),
  // pre-multiplied by the softmax scale. Scalar loads: query rows need not be
  // 16-byte aligned.
  float q[S::kGroupsPerLane][X];
  {
    const T* q_row = p.query + seq * p.q_stride + static_cast<int64_t>(head) * HEAD_SIZE;
#pragma unroll
    for (int i = 0; i < S::kGroupsPerLane; ++i) {
      const int g = group_lane + kGroupLanes * i;
#pragma unroll
      for (int e = 0; e < X; ++e) {
        q[i][e] = g < S::kGroups ? to_float(q_row[g * X + e]) * p.scale : 0.f;
      }
    }
  }

  typename KV::Seq tiles;
  if (!p.kv.open(seq, kv_head, seq_len, static_cast<int64_t>(HEAD_SIZE) * BLOCK_SIZE,
                 &tiles)) {
    // Contiguous layout only: a slot or length outside the views. NaN instead of
    // an out-of-bounds read (v2: a NaN partition with weight 1 makes the merge NaN).
    const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
    T* out = partitioned ? p.tmp_out + (row * p.max_partitions + partition) * HEAD_SIZE
                         : p.out + row * HEAD_SIZE;
    for (int d = threadIdx.x; d < HEAD_SIZE; d += kDecodeThreads) out[d] = from_float<T>(NAN);
    if (partitioned && threadIdx.x == 0) {
      p.max_logits[row * p.max_partitions + partition] = 0.f;
      p.exp_sums[row * p.max_partitions + partition] = 1.f;
    }
    return;
  }

  const C* k_head = p.key_cache + tiles.key_base;
  const C* v_head = p.value_cache + tiles.value_base;

  // This lane's value chunk inside a block: row d = pass * kRowsPerPass + v_row,
  // tokens [v_chunk * VX, v_chunk * VX + VX).
  const int v_chunk = lane % S::kChunksPerRow;
  const int v_row = lane / S::kChunksPerRow;

  __shared__ float block_probs[kDecodeWarps][BLOCK_SIZE];
  float m = -INFINITY;  // running max of this warp's logits
  float l = 0.f;        // running sum of exp(logit - m)
  float acc[S::kPasses];
#pragma unroll
  for (int k = 0; k < S::kPasses; ++k) acc[k] = 0.f;

  using Ref = decltype(tiles.ref(0));
  int block = first_block + warp;
  Ref ref = block < end_block ? tiles.ref(block) : Ref{};
  for (; block < end_block; block += kDecodeWarps) {
    // The next block's location is fetched early: for paged caches it is a
    // dependent load (the block table).
    const int next = block + kDecodeWarps;
    const Ref next_ref = next < end_block ? tiles.ref(next) : Ref{};
    const C* k_block = k_head + p.kv.key_step(ref);
    const C* v_block = v_head + p.kv.value_step(ref);
    const int64_t scale_block = tiles.scale_base + p.kv.scale_step(ref);  // int8 only
    const int block_start = block * BLOCK_SIZE;

    Chunk<C, VX> v_raw[S::kPreloadValues ? S::kPasses : 1];
    if constexpr (S::kPreloadValues) {
#pragma unroll
      for (int k = 0; k < S::kPasses; ++k) {
        const int d = k * S::kRowsPerPass + v_row;
        if (k < S::kFullPasses || d < HEAD_SIZE) {
          v_raw[k] = load_chunk<C, VX>(v_block + d * BLOCK_SIZE + v_chunk * VX);
        }
      }
    }

    // q . k for this lane's tokens (token_lane + kTokenLanes * j) over its groups.
    float logit[S::kTokensPerLane];
#pragma unroll
    for (int j = 0; j < S::kTokensPerLane; ++j) logit[j] = 0.f;
#pragma unroll
    for (int i = 0; i < S::kGroupsPerLane; ++i) {
      const int g = group_lane + kGroupLanes * i;
      if (i < S::kFullGroupIters || g < S::kGroups) {
#pragma unroll
        for (int j = 0; j < S::kTokensPerLane; ++j) {
          const int t = token_lane + kTokenLanes * j;
          float k[X];
          load_as_float(k_block + (g * BLOCK_SIZE + t) * X, k);
#pragma unroll
          for (int e = 0; e < X; ++e) logit[j] += q[i][e] * k[e];
        }
      }
    }

    // Sum over the group lanes (lane bits 3 and 4), mask tokens outside the
    // partition and the window, and take the block's max over the token lanes
    // (bits 0..2).
    float block_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < S::kTokensPerLane; ++j) {
      logit[j] += __shfl_xor_sync(0xffffffffu, logit[j], 8);
      logit[j] += __shfl_xor_sync(0xffffffffu, logit[j], 16);
      if constexpr (kQuantized) {
        // Before the mask below: the scale of an unwritten slot may be NaN.
        logit[j] *= __half2float(p.k_scale[scale_block + token_lane + kTokenLanes * j]);
      }
      const int pos = block_start + token_lane + kTokenLanes * j;
      logit[j] = pos < part_end && pos >= window_start
                     ? logit[j] + alibi_slope * static_cast<float>(pos - query_pos)
                     : -INFINITY;
      block_max = fmaxf(block_max, logit[j]);
    }
#pragma unroll
    for (int mask = 1; mask < kTokenLanes; mask <<= 1) {
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, mask));
    }
    // Every block read holds a visible token (the first one the window's start),
    // so m_new is finite.
    const float m_new = fmaxf(m, block_max);
    const float correction = __expf(m - m_new);  // 0 on the first block (m = -inf)
    float block_sum = 0.f;
#pragma unroll
    for (int j = 0; j < S::kTokensPerLane; ++j) {
      logit[j] = __expf(logit[j] - m_new);  // now a probability weight; 0 when masked
      block_sum += logit[j];
    }
#pragma unroll
    for (int mask = 1; mask < kTokenLanes; mask <<= 1) {
      block_sum += __shfl_xor_sync(0xffffffffu, block_sum, mask);
    }
    l = l * correction + block_sum;
    m = m_new;
    if (group_lane == 0) {
#pragma unroll
      for (int j = 0; j < S::kTokensPerLane; ++j) {
        const int t = token_lane + kTokenLanes * j;
        float prob = logit[j];
        if constexpr (kQuantized) {
          // p_t s_v,t; selected, not multiplied, to 0 outside the partition and
          // window (an unwritten slot's scale may be NaN).
          const int pos = block_start + t;
          prob = pos < part_end && pos >= window_start
                     ? prob * __half2float(p.v_scale[scale_block + t])
                     : 0.f;
        }
        block_probs[warp][t] = prob;
      }
    }
    __syncwarp();

    // acc[row] = acc[row] * correction + sum_t prob[t] * v[row][t]. Tokens past
    // the partition's end are zeroed rather than multiplied by 0: unwritten cache
    // slots may hold NaN bits.
    const int valid_tokens = part_end - block_start;
#pragma unroll
    for (int k = 0; k < S::kPasses; ++k) {
      const int d = k * S::kRowsPerPass + v_row;
      float partial = 0.f;
      if (k < S::kFullPasses || d < HEAD_SIZE) {
        float v[VX];
        if constexpr (S::kPreloadValues) {
          chunk_to_floats<C, VX>(v_raw[k], v);
        } else {
          load_as_float(v_block + d * BLOCK_SIZE + v_chunk * VX, v);
        }
#pragma unroll
        for (int e = 0; e < VX; ++e) {
          const int t = v_chunk * VX + e;
          partial += (t < valid_tokens ? v[e] : 0.f) * block_probs[warp][t];
        }
      }
      acc[k] = acc[k] * correction + partial;
    }
    __syncwarp();  // block_probs is rewritten by the next block
    ref = next_ref;
  }

  // Merge: first the kChunksPerRow lanes sharing a row, then the warps.
#pragma unroll
  for (int k = 0; k < S::kPasses; ++k) {
#pragma unroll
    for (int mask = 1; mask < S::kChunksPerRow; mask <<= 1) {
      acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], mask);
    }
  }
  __shared__ float warp_max[kDecodeWarps];
  __shared__ float warp_sum_exp[kDecodeWarps];
  __shared__ float warp_acc[kDecodeWarps][HEAD_SIZE];
  if (lane == 0) {
    warp_max[warp] = m;
    warp_sum_exp[warp] = l;
  }
  if (v_chunk == 0) {
#pragma unroll
    for (int k = 0; k < S::kPasses; ++k) {
      const int d = k * S::kRowsPerPass + v_row;
      if (k < S::kFullPasses || d < HEAD_SIZE) warp_acc[warp][d] = acc[k];
    }
  }
  __syncthreads();

  // A warp that got no block has m = -inf and weight 0.
  float total_max = -INFINITY;
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) total_max = fmaxf(total_max, warp_max[w]);
  float weight[kDecodeWarps];
  float total_sum = 0.f;
#pragma unroll
  for (int w = 0; w < kDecodeWarps; ++w) {
    weight[w] = warp_max[w] == -INFINITY ? 0.f : __expf(warp_max[w] - total_max);
    total_sum += warp_sum_exp[w] * weight[w];
  }
  float inv_sum = total_sum > 0.f ? 1.f / total_sum : 0.f;
  if (!partitioned && p.sinks != nullptr) {
    // The sink as one more logit: rescale to max(total_max, sink). total_max is
    // finite here (the block read at least one visible key).
    const float sink = p.sinks[head];
    const float m = fmaxf(total_max, sink);
    const float alpha = __expf(total_max - m);
    inv_sum = alpha / (total_sum * alpha + __expf(sink - m));
  }

  const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
  T* out = partitioned ? p.tmp_out + (row * p.max_partitions + partition) * HEAD_SIZE
                       : p.out + row * HEAD_SIZE;
  for (int d = threadIdx.x; d < HEAD_SIZE; d += kDecodeThreads) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) o += warp_acc[w][d] * weight[w];
    out[d] = from_float<T>(o * inv_sum);
  }
  if (partitioned && threadIdx.x == 0) {
    p.max_logits[row * p.max_partitions + partition] = total_max;
    p.exp_sums[row * p.max_partitions + partition] = total_sum;
  }
}

// The partitioned decode's second step: merges a sequence's partitions, each
// normalised by its own sum, weighting partition i by exp_sums[i] *
// exp(max_logits[i] - max). A head's sink joins here as one more logit with no
// value: it takes part in max and adds exp(sink - max) to the sum. One block per
// (head, sequence); every thread scans the (few) partitions itself, so no shared
// memory is needed.
template <typename T>
__global__ void __launch_bounds__(kDecodeThreads)
    attention_reduce_kernel(T* __restrict__ out, const float* __restrict__ exp_sums,
                                  const float* __restrict__ max_logits,
                                  const T* __restrict__ tmp_out, const int* __restrict__ seq_lens,
                                  const float* __restrict__ sinks, int head_size,
                                  int partition_size, int num_partitions, int max_partitions,
                                  int sliding_window) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int64_t row = static_cast<int64_t>(seq) * gridDim.x + head;
  T* out_row = out + row * head_size;
  // Clamped to the partitions the first kernel computed (seq_lens beyond
  // max_seq_len are a caller error; this keeps them inside the workspace).
  const int parts = min(num_partitions, (seq_lens[seq] + partition_size - 1) / partition_size);
  // Partitions wholly before the sliding window were not computed.
  const int first = decode_window_start(seq_lens[seq], sliding_window) / partition_size;
  const float* sums = exp_sums + row * max_partitions;
  const float* maxes = max_logits + row * max_partitions;
  const T* partial = tmp_out + row * max_partitions * head_size;

  if (parts - first <= 1 && sinks == nullptr) {
    // Zero partitions: empty sequence. One: the partition's output is the answer.
    for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
      out_row[d] = parts - first == 1 ? partial[static_cast<int64_t>(first) * head_size + d]
                                      : from_float<T>(0.f);
    }
    return;
  }
  const float sink = sinks != nullptr ? sinks[head] : -INFINITY;
  float total_max = sink;
  for (int i = first; i < parts; ++i) total_max = fmaxf(total_max, maxes[i]);
  // An empty sequence with a sink: total_max is the sink, the sum 1, the output 0.
  const float sink_term = sinks != nullptr ? __expf(sink - total_max) : 0.f;
  for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
    float total_sum = sink_term;
    float o = 0.f;
    for (int i = first; i < parts; ++i) {
      const float w = sums[i] * __expf(maxes[i] - total_max);
      total_sum += w;
      o += w * to_float(partial[static_cast<int64_t>(i) * head_size + d]);
    }
    out_row[d] = from_float<T>(total_sum > 0.f ? o / total_sum : 0.f);
  }
}

}  // namespace pyllm::cuda
