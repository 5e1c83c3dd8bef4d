// Causal attention of several query tokens per sequence (prompts, prompt chunks,
// prefix-cache hits) over either KV cache layout: paged blocks or the contiguous
// arena's tiles of kTokenTile tokens (kv_addressing.cuh; "block" below means either).
//
// One thread block of kPrefillThreads handles a tile of up to kQueryTile query
// tokens of one sequence and one query head. It walks the sequence's cached
// tokens kKeyTile at a time, staging each key/value tile in shared memory as
// float (gathered through the block table, or from the slot's tiles), so every
// tile is read from the cache once per query tile rather than once per query
// token. Online softmax per query row; everything is accumulated in float32.
//
// Thread layout: row = threadIdx.x / 8 (the query row), col = threadIdx.x % 8.
// A thread scores keys col and col + 8 of the tile for its row, and owns the
// output dimensions col * 4 + 32 * k .. + 3. The 8 threads of a row are
// consecutive lanes of one warp, so row-wise max/sum are warp shuffles.
//
// Sinks (one logit per head with no value, gpt-oss) change only the final
// normalization: each row's running max and sum are rescaled to max(max, sink).
//
// int8 cache (C = int8_t, float16 scales per token): keys and values are
// dequantized (times their token's scale) as the tiles are staged, so the math
// after staging is the float caches'. Value chunks are 8 tokens for int8 (8 bytes:
// a chunk stays inside a block of 8).
#pragma once

#include <type_traits>

#include "../cuda_utils.cuh"
#include "kv_addressing.cuh"
#include "kv_chunks.cuh"

namespace pyllm::cuda {

constexpr int kPrefillThreads = 128;
constexpr int kQueryTile = 16;
constexpr int kKeyTile = 16;
constexpr int kRowLanes = kPrefillThreads / kQueryTile;  // 8 threads per query row
static_assert(kKeyTile == 2 * kRowLanes, "each thread scores two keys of a tile");

template <typename T, typename KV, typename C = T>
struct PrefillParams {
  T* out;                     // [num_tokens, num_heads, head_size], contiguous
  const T* query;             // [num_tokens, num_heads, head_size], token stride q_stride
  const C* key_cache;         // paged [num_blocks, num_kv_heads, head_size / x, block_size, x]
  const C* value_cache;       // paged [num_blocks, num_kv_heads, head_size, block_size]
  const __half* k_scale;      // int8 cache: paged [num_blocks, num_kv_heads, block_size]
  const __half* v_scale;
  KV kv;                      // where each sequence's blocks are (kv_addressing.cuh)
  const int* seq_lens;        // [num_seqs]
  const int* query_start_loc; // [num_seqs + 1]
  const float* alibi_slopes;  // [num_heads] or null
  const float* sinks;         // [num_heads] or null
  int64_t q_stride;
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int block_size;  // tokens per block (kTokenTile for the contiguous layout)
  float scale;
  int sliding_window;  // 0: none; else a query sees the last sliding_window positions
};

// Shared memory of one block, in floats. Key rows are padded by 4 floats so
// that the 8 threads of a row, reading 8 different keys as float4, hit 8
// disjoint groups of banks.
template <int HEAD_SIZE>
struct PrefillSmem {
  static constexpr int kKeyStride = HEAD_SIZE + 4;
  static constexpr int kQuery = 0;                                    // [kQueryTile][HEAD_SIZE]
  static constexpr int kKey = kQuery + kQueryTile * HEAD_SIZE;        // [kKeyTile][kKeyStride]
  static constexpr int kValue = kKey + kKeyTile * kKeyStride;         // [kKeyTile][HEAD_SIZE]
  static constexpr int kProbs = kValue + kKeyTile * HEAD_SIZE;        // [kQueryTile][kKeyTile]
  static constexpr int kFloats = kProbs + kQueryTile * kKeyTile;
  static constexpr size_t kBytes = kFloats * sizeof(float);
};

// Which (sequence, query tile) blockIdx.x stands for. Sequence s owns
// ceil(q_len_s / kQueryTile) consecutive tiles; warp 0 prefix-sums those
// counts 32 sequences at a time. Returns {-1, 0} for a block past the last tile
// (the grid is sized by an upper bound, num_tokens / kQueryTile + num_seqs).
__device__ __forceinline__ int2 find_query_tile(const int* query_start_loc, int num_seqs) {
  __shared__ int2 found;
  if (threadIdx.x < kWarpSize) {
    const int lane = threadIdx.x;
    const int tile = blockIdx.x;
    int2 result = make_int2(-1, 0);
    int base = 0;  // tiles of the sequences before this group of 32
    for (int s0 = 0; s0 < num_seqs; s0 += kWarpSize) {
      const int s = s0 + lane;
      const int tiles =
          s < num_seqs ? (query_start_loc[s + 1] - query_start_loc[s] + kQueryTile - 1) / kQueryTile
                       : 0;
      int inclusive = tiles;
#pragma unroll
      for (int offset = 1; offset < kWarpSize; offset <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += n;
      }
      const int exclusive = inclusive - tiles;
      const bool mine = tiles > 0 && base + exclusive <= tile && tile < base + inclusive;
      const unsigned hit = __ballot_sync(0xffffffffu, mine);
      if (hit) {
        const int src = __ffs(hit) - 1;
        const int src_exclusive = __shfl_sync(0xffffffffu, exclusive, src);
        result = make_int2(s0 + src, tile - base - src_exclusive);
        break;
      }
      base += __shfl_sync(0xffffffffu, inclusive, kWarpSize - 1);
    }
    if (lane == 0) found = result;
  }
  __syncthreads();
  return found;
}

template <typename T, int HEAD_SIZE, typename KV, typename C = T>
__global__ void __launch_bounds__(kPrefillThreads)
    attention_prefill_kernel(const PrefillParams<T, KV, C> p) {
  using Smem = PrefillSmem<HEAD_SIZE>;
  constexpr bool kQuantized = std::is_same_v<C, int8_t>;
  constexpr int X = Vec16<C>::kSize;
  constexpr int VX = kQuantized ? 8 : X;  // tokens per value chunk
  constexpr int kGroups = HEAD_SIZE / X;
  // Output dimensions per thread: float4 column blocks col * 4 + 32 * k.
  constexpr int kDimBlocks = (HEAD_SIZE + 4 * kRowLanes - 1) / (4 * kRowLanes);

  extern __shared__ float4 smem_raw[];  // float4: 16-byte aligned
  float* smem = reinterpret_cast<float*>(smem_raw);
  float* q_tile = smem + Smem::kQuery;
  float* k_tile = smem + Smem::kKey;
  float* v_tile = smem + Smem::kValue;
  float* probs = smem + Smem::kProbs;

  const int2 tile = find_query_tile(p.query_start_loc, p.num_seqs);
  const int seq = tile.x;
  if (seq < 0) return;  // uniform across the block
  const int head = blockIdx.y;
  const int kv_head = head / (p.num_heads / p.num_kv_heads);

  const int q_begin = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - q_begin;
  const int seq_len = p.seq_lens[seq];
  // Tokens cached before this step's queries; query i sits at position context + i.
  const int context = seq_len - q_len;
  const int row0 = tile.y * kQueryTile;
  const int rows = min(kQueryTile, q_len - row0);
  // The tile's last query attends to keys before kv_end, its first one to keys
  // from kv_begin on (its sliding window's start). Keys before kv_begin are never
  // read: their blocks may be another sequence's.
  const int kv_end = context + row0 + rows;
  const int window = p.sliding_window;
  const int kv_begin = window > 0 ? max(0, context + row0 - window + 1) : 0;

  const int tid = threadIdx.x;
  const int row = tid / kRowLanes;
  const int col = tid % kRowLanes;
  const int query_pos = context + row0 + row;
  const bool row_valid = row < rows;
  const float alibi_slope = p.alibi_slopes ? p.alibi_slopes[head] : 0.f;

  // Query tile, pre-scaled; rows past the sequence's queries are zero.
  for (int i = tid; i < kQueryTile * HEAD_SIZE; i += kPrefillThreads) {
    const int r = i / HEAD_SIZE;
    const int d = i % HEAD_SIZE;
    float v = 0.f;
    if (r < rows) {
      v = to_float(p.query[(q_begin + row0 + r) * p.q_stride +
                           static_cast<int64_t>(head) * HEAD_SIZE + d]) *
          p.scale;
    }
    q_tile[i] = v;
  }

  typename KV::Seq tiles;
  if (!p.kv.open(seq, kv_head, seq_len, static_cast<int64_t>(HEAD_SIZE) * p.block_size,
                 &tiles)) {
    // Contiguous layout only: a slot or length outside the views. The tile's
    // outputs become NaN instead of reading out of bounds.
    for (int i = threadIdx.x; i < rows * HEAD_SIZE; i += kPrefillThreads) {
      const int64_t out_token = q_begin + row0 + i / HEAD_SIZE;
      p.out[(out_token * p.num_heads + head) * HEAD_SIZE + i % HEAD_SIZE] = from_float<T>(NAN);
    }
    return;  // uniform across the block
  }

  const C* k_head = p.key_cache + tiles.key_base;
  const C* v_head = p.value_cache + tiles.value_base;

  float m = -INFINITY;
  float l = 0.f;
  float acc[kDimBlocks][4];
#pragma unroll
  for (int k = 0; k < kDimBlocks; ++k) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[k][e] = 0.f;
  }

  for (int kt0 = kv_begin / kKeyTile * kKeyTile; kt0 < kv_end; kt0 += kKeyTile) {
    __syncthreads();  // the previous tile's readers are done (and q_tile is written)

    // Gather the key tile: chunk (g, t) is x-group g of token kt0 + t; consecutive
    // threads take consecutive tokens of one group, contiguous within a block.
    for (int c = tid; c < kGroups * kKeyTile; c += kPrefillThreads) {
      const int t = c % kKeyTile;
      const int g = c / kKeyTile;
      const int pos = kt0 + t;
      float k[X];
      if (pos < kv_end && pos >= kv_begin) {
        const auto ref = tiles.ref(pos / p.block_size);
        const int offset = pos % p.block_size;
        load_as_float(k_head + p.kv.key_step(ref) + (g * p.block_size + offset) * X, k);
        if constexpr (kQuantized) {
          const float s = __half2float(p.k_scale[tiles.scale_base + p.kv.scale_step(ref) + offset]);
#pragma unroll
          for (int e = 0; e < X; ++e) k[e] *= s;
        }
      } else {
#pragma unroll
        for (int e = 0; e < X; ++e) k[e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < X; ++e) k_tile[t * Smem::kKeyStride + g * X + e] = k[e];
    }
    // Gather the value tile, transposed to [token][dim]: chunk (d, tc) holds VX
    // consecutive tokens of dimension d, all in one cache block (VX divides
    // block_size, and kt0 is a multiple of kKeyTile). Tokens outside [kv_begin,
    // kv_end) become 0 by selection: unwritten slots (and an int8 cache's scales
    // of them) may hold NaN bits.
    constexpr int kChunksPerDim = kKeyTile / VX;
    for (int c = tid; c < HEAD_SIZE * kChunksPerDim; c += kPrefillThreads) {
      const int tc = c % kChunksPerDim;
      const int d = c / kChunksPerDim;
      const int pos = kt0 + tc * VX;
      float v[VX];
      if (pos < kv_end && pos + VX > kv_begin) {
        const auto ref = tiles.ref(pos / p.block_size);
        const int offset = pos % p.block_size;
        load_as_float(v_head + p.kv.value_step(ref) + d * p.block_size + offset, v);
        if constexpr (kQuantized) {
          const __half* s = p.v_scale + tiles.scale_base + p.kv.scale_step(ref) + offset;
#pragma unroll
          for (int e = 0; e < VX; ++e) v[e] *= __half2float(s[e]);
        }
#pragma unroll
        for (int e = 0; e < VX; ++e) {
          v[e] = pos + e < kv_end && pos + e >= kv_begin ? v[e] : 0.f;
        }
      } else {
#pragma unroll
        for (int e = 0; e < VX; ++e) v[e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < VX; ++e) v_tile[(tc * VX + e) * HEAD_SIZE + d] = v[e];
    }
    __syncthreads();

    // Scores of keys col and col + 8 for this thread's row.
    float s0 = 0.f;
    float s1 = 0.f;
    {
      const float4* q4 = reinterpret_cast<const float4*>(q_tile + row * HEAD_SIZE);
      const float4* k4a = reinterpret_cast<const float4*>(k_tile + col * Smem::kKeyStride);
      const float4* k4b =
          reinterpret_cast<const float4*>(k_tile + (col + kRowLanes) * Smem::kKeyStride);
#pragma unroll 8
      for (int i = 0; i < HEAD_SIZE / 4; ++i) {
        const float4 qv = q4[i];
        const float4 ka = k4a[i];
        const float4 kb = k4b[i];
        s0 += qv.x * ka.x + qv.y * ka.y + qv.z * ka.z + qv.w * ka.w;
        s1 += qv.x * kb.x + qv.y * kb.y + qv.z * kb.z + qv.w * kb.w;
      }
    }
    // Causal mask: key positions up to the query's own (which also bounds them
    // by kv_end), and within its window; alibi adds slope * (key_pos - query_pos) <= 0.
    const int pos0 = kt0 + col;
    const int pos1 = kt0 + col + kRowLanes;
    const int row_first = window > 0 ? query_pos - window + 1 : 0;
    s0 = row_valid && pos0 <= query_pos && pos0 >= row_first
             ? s0 + alibi_slope * static_cast<float>(pos0 - query_pos)
             : -INFINITY;
    s1 = row_valid && pos1 <= query_pos && pos1 >= row_first
             ? s1 + alibi_slope * static_cast<float>(pos1 - query_pos)
             : -INFINITY;

    float tile_max = fmaxf(s0, s1);
#pragma unroll
    for (int mask = 1; mask < kRowLanes; mask <<= 1) {
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, mask));
    }
    const float m_new = fmaxf(m, tile_max);
    // A row with no visible key yet (or a padding row) keeps m = -inf; shifting
    // by 0 then keeps every exp at 0 instead of NaN.
    const float shift = m_new == -INFINITY ? 0.f : m_new;
    const float p0 = __expf(s0 - shift);
    const float p1 = __expf(s1 - shift);
    const float correction = __expf(m - shift);
    float tile_sum = p0 + p1;
#pragma unroll
    for (int mask = 1; mask < kRowLanes; mask <<= 1) {
      tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, mask);
    }
    l = l * correction + tile_sum;
    m = m_new;
    probs[row * kKeyTile + col] = p0;
    probs[row * kKeyTile + col + kRowLanes] = p1;
    __syncwarp();  // a row's 8 threads are in one warp

    // acc = acc * correction + probs[row] . v_tile
#pragma unroll
    for (int k = 0; k < kDimBlocks; ++k) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[k][e] *= correction;
    }
    const float4* p4 = reinterpret_cast<const float4*>(probs + row * kKeyTile);
#pragma unroll
    for (int t4 = 0; t4 < kKeyTile / 4; ++t4) {
      const float4 pq = p4[t4];
      const float pt[4] = {pq.x, pq.y, pq.z, pq.w};
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float* v_row = v_tile + (t4 * 4 + u) * HEAD_SIZE;
#pragma unroll
        for (int k = 0; k < kDimBlocks; ++k) {
          const int d = col * 4 + 4 * kRowLanes * k;
          if (HEAD_SIZE % (4 * kRowLanes) == 0 || d < HEAD_SIZE) {
            const float4 vv = *reinterpret_cast<const float4*>(v_row + d);
            acc[k][0] += pt[u] * vv.x;
            acc[k][1] += pt[u] * vv.y;
            acc[k][2] += pt[u] * vv.z;
            acc[k][3] += pt[u] * vv.w;
          }
        }
      }
    }
  }

  if (!row_valid) return;
  float inv_sum = l > 0.f ? 1.f / l : 0.f;
  if (p.sinks != nullptr) {
    // The sink as one more logit: rescale to max(m, sink) (m is finite: a valid
    // row sees at least its own key).
    const float sink = p.sinks[head];
    const float m_all = fmaxf(m, sink);
    const float alpha = __expf(m - m_all);
    inv_sum = alpha / (l * alpha + __expf(sink - m_all));
  }
  const int64_t out_token = q_begin + row0 + row;
  T* out_row = p.out + (out_token * p.num_heads + head) * HEAD_SIZE;
#pragma unroll
  for (int k = 0; k < kDimBlocks; ++k) {
    const int d = col * 4 + 4 * kRowLanes * k;
    if (HEAD_SIZE % (4 * kRowLanes) == 0 || d < HEAD_SIZE) {
#pragma unroll
      for (int e = 0; e < 4; ++e) out_row[d + e] = from_float<T>(acc[k][e] * inv_sum);
    }
  }
}

}  // namespace pyllm::cuda
