// Every op of the pyllm extension, declared once per device.
//
// The schemas (argument names, order, which tensors are written) live in
// torch_bindings.cpp; the implementations in csrc/<family>/<family>_cpu.cpp and
// csrc/<family>/<family>_cuda.cu, both of which first call the op's argument checks
// in csrc/<family>/<family>_checks.h. pyllm/ops.py adds the Python types and the
// values of index tensors.
//
// KV cache layout, one pair of tensors per layer (x = 16 / element_size, so one
// "x" group of a key is 16 bytes):
//   key_cache   [num_blocks, num_kv_heads, head_size / x, block_size, x]
//   value_cache [num_blocks, num_kv_heads, head_size, block_size]
// An int8 cache (kv_cache_dtype "int8", x = 16) has the same layouts plus float32
// k_scale / v_scale shaped like the cache without head_size ([num_blocks,
// num_kv_heads, block_size]; contiguous: [max_num_seqs, num_kv_heads, num_tiles,
// kTokenTile], dense): row x of a token and kv head is stored as round(x / s),
// s = absmax(x) / 127. The ops take the scales as optional tensors (None: a float
// cache); the CUDA kernels refuse an int8 cache.
//
// Contiguous KV layout (the virtual KV arena, csrc/cache/kv_arena.h), one pair of
// tensor views per layer, indexed by sequence slot instead of through a block table:
//   key_cache   [max_num_seqs, num_kv_heads, num_tiles, head_size / x, kTokenTile, x]
//   value_cache [max_num_seqs, num_kv_heads, num_tiles, head_size, kTokenTile]
// The inner three dimensions are dense and hold one tile of kTokenTile tokens exactly as
// a paged block holds block_size tokens; the outer three (slot, kv head, tile) may have
// any strides, which is how the arena chooses where each slot's memory lies. Token t of
// a slot sits in tile t / kTokenTile at offset t % kTokenTile.
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

namespace pyllm {

#define PYLLM_DECLARE_OPS                                                      \
  void reshape_and_cache(const at::Tensor& key, const at::Tensor& value,      \
                         at::Tensor& key_cache, at::Tensor& value_cache,      \
                         const at::Tensor& slot_mapping,                      \
                         const std::string& kv_cache_dtype,                   \
                         const std::optional<at::Tensor>& k_scale,            \
                         const std::optional<at::Tensor>& v_scale);           \
                                                                               \
  void copy_blocks(const std::vector<at::Tensor>& key_caches,                 \
                   const std::vector<at::Tensor>& value_caches,               \
                   const at::Tensor& block_mapping);                          \
                                                                               \
  void swap_blocks(const at::Tensor& src, at::Tensor& dst,                    \
                   const at::Tensor& block_mapping);                          \
                                                                               \
  void paged_attention_v1(                                                    \
      at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,  \
      const at::Tensor& value_cache, int64_t num_kv_heads, double scale,      \
      const at::Tensor& block_tables, const at::Tensor& seq_lens,             \
      int64_t block_size, int64_t max_seq_len,                                \
      const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,  \
      const std::optional<at::Tensor>& sinks,                                \
      const std::optional<at::Tensor>& k_scale,                              \
      const std::optional<at::Tensor>& v_scale);                                \
                                                                               \
  void paged_attention_v2(                                                    \
      at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,          \
      at::Tensor& tmp_out, const at::Tensor& query,                           \
      const at::Tensor& key_cache, const at::Tensor& value_cache,             \
      int64_t num_kv_heads, double scale, const at::Tensor& block_tables,     \
      const at::Tensor& seq_lens, int64_t block_size, int64_t max_seq_len,    \
      const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,  \
      const std::optional<at::Tensor>& sinks,                                \
      const std::optional<at::Tensor>& k_scale,                              \
      const std::optional<at::Tensor>& v_scale);                                \
                                                                               \
  void paged_attention_prefill(                                               \
      at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,  \
      const at::Tensor& value_cache, int64_t num_kv_heads, double scale,      \
      const at::Tensor& block_tables, const at::Tensor& seq_lens,             \
      const at::Tensor& query_start_loc, int64_t block_size,                  \
      int64_t max_query_len, const std::optional<at::Tensor>& alibi_slopes,   \
      int64_t sliding_window, const std::optional<at::Tensor>& sinks,                                \
      const std::optional<at::Tensor>& k_scale,                              \
      const std::optional<at::Tensor>& v_scale);        \
                                                                               \
  void rotary_embedding(const at::Tensor& positions, at::Tensor& query,       \
                        at::Tensor& key, int64_t head_size,                   \
                        const at::Tensor& cos_sin_cache, bool is_neox);       \
                                                                               \
  void rms_norm(at::Tensor& out, const at::Tensor& input,                     \
                const at::Tensor& weight, double epsilon);                    \
                                                                               \
  void fused_add_rms_norm(at::Tensor& input, at::Tensor& residual,            \
                          const at::Tensor& weight, double epsilon);          \
                                                                               \
  void silu_and_mul(at::Tensor& out, const at::Tensor& input);                \
  void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& input);           \
                                                                               \
  /* out[M, N] = input[M, K] . weight[N, K]^T (+ bias), M <= 4 rows. */          \
  void small_batch_linear(at::Tensor& out, const at::Tensor& input,           \
                          const at::Tensor& weight,                           \
                          const std::optional<at::Tensor>& bias);             \
                                                                               \
  /* out[M, N] = input[M, K] . W^T (+ bias), W word-packed [N/16, K/E, 16, E]  \
     (E = 4 / element size; see pyllm.ops.pack_weight_words). */              \
  void packed_linear(at::Tensor& out, const at::Tensor& input,                \
                     const at::Tensor& packed_weight,                         \
                     const std::optional<at::Tensor>& bias);                  \
                                                                               \
  /* out[M, N] = input[M, K] . W^T (+ bias), W [N, K] kept as the GGUF blocks  \
     of GGML type qtype: qweight uint8 [N, K / block * block_bytes]. Rows      \
     [0, many_rows) take the arithmetic of a many-row call whatever their      \
     count (a prompt's rows compute alike however the prompt was split). */   \
  void quant_linear(at::Tensor& out, const at::Tensor& input,                 \
                    const at::Tensor& qweight, int64_t qtype,                 \
                    const std::optional<at::Tensor>& bias, int64_t many_rows); \
                                                                               \
  /* out[R, K] = rows of the quantized weight (all N rows if rows is None). */ \
  void dequantize_rows(at::Tensor& out, const at::Tensor& qweight,            \
                       int64_t qtype, const std::optional<at::Tensor>& rows); \
                                                                               \
  /* Contiguous KV layout: seq_slots name each token's or sequence's slot. */  \
  void write_kv_contiguous(const at::Tensor& key, const at::Tensor& value,    \
                           at::Tensor& key_cache, at::Tensor& value_cache,    \
                           const at::Tensor& token_slots,                     \
                           const at::Tensor& positions,                       \
                           const std::optional<at::Tensor>& k_scale,          \
                           const std::optional<at::Tensor>& v_scale);         \
                                                                               \
  void contiguous_attention_decode(                                           \
      at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,  \
      const at::Tensor& value_cache, int64_t num_kv_heads, double scale,      \
      const at::Tensor& seq_slots, const at::Tensor& seq_lens,                \
      int64_t max_seq_len, int64_t sliding_window,                            \
      const std::optional<at::Tensor>& sinks,                                \
      const std::optional<at::Tensor>& k_scale,                              \
      const std::optional<at::Tensor>& v_scale);                                \
                                                                               \
  void contiguous_attention_prefill(                                          \
      at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,  \
      const at::Tensor& value_cache, int64_t num_kv_heads, double scale,      \
      const at::Tensor& seq_slots, const at::Tensor& seq_lens,                \
      const at::Tensor& query_start_loc, int64_t max_query_len,               \
      int64_t sliding_window, const std::optional<at::Tensor>& sinks,                                \
      const std::optional<at::Tensor>& k_scale,                              \
      const std::optional<at::Tensor>& v_scale);        \
                                                                               \
  /* Structured output: logits[rows[i], t] = -inf where bit t % 32 of         \
     bitmask[i, t / 32] is 0 (and past the mask's words). */                  \
  void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask,    \
                           const at::Tensor& rows);

// Mixture of experts (csrc/moe/): routing, and a whole MoE feed-forward in one op.
#define PYLLM_DECLARE_MOE_OPS                                                  \
  /* topk_weights [T, k] float32, topk_ids [T, k] int32: each token's k        \
     experts by softmax of router_logits [T, E], optionally renormalized. */   \
  void moe_topk(at::Tensor& topk_weights, at::Tensor& topk_ids,               \
                const at::Tensor& router_logits, bool renormalize);           \
                                                                               \
  /* out [T, H] = sum over each token's top_k experts e (of router_logits,     \
     those in [expert_start, expert_start + w_gate.size(0))) of weight *       \
     down_e(act(gate_e(x), up_e(x))); weights GGUF blocks or floats. Tokens    \
     [0, many_rows) take each expert's many-row path (as quant_linear's). */  \
  void fused_moe(at::Tensor& out, const at::Tensor& hidden,                   \
                 const at::Tensor& router_logits, int64_t top_k,              \
                 bool renormalize, const at::Tensor& w_gate,                  \
                 const at::Tensor& w_up, const at::Tensor& w_down,            \
                 int64_t gate_type, int64_t up_type, int64_t down_type,       \
                 const std::optional<at::Tensor>& gate_bias,                  \
                 const std::optional<at::Tensor>& up_bias,                    \
                 const std::optional<at::Tensor>& down_bias,                  \
                 const std::string& activation, double alpha, double limit,   \
                 int64_t expert_start, int64_t many_rows);

// The same set of functions, once for each device the library is built for.
namespace cpu {
PYLLM_DECLARE_OPS
PYLLM_DECLARE_MOE_OPS
// Whether packed_linear has a vector kernel for dtype in this build (AVX-512;
// bf16 also AVX512-BF16); elsewhere it runs a plain loop.
bool packed_linear_vectorized_for(at::ScalarType dtype);
// Batch-invariant mode: quantized weights take the int8 products at every row count,
// whose result for a row never depends on the other rows of the call, instead of
// dequantized panels (or AMX tiles, or ATen's GEMM) from some row count on; greedy
// output then no longer depends on batching, chunking or prefix-cache hits.
// Process-wide, set by the engine (EngineConfig.batch_invariant). In quant_cpu.cpp.
bool batch_invariant();
void set_batch_invariant(bool on);
// Q4_0, Q4_1, Q8_0, MXFP4, Q4_K or Q6_K weights rearranged in place into strips of 16
// rows (quantization/quant_strips.h), which quant_linear and dequantize_rows read as
// qtype 1000 + qtype on the CPU; strips_native: whether this build's kernels read them
// as they lie (AVX2 and AVX-512), where the portable build turns them back into GGUF's
// rows on each call. In quant_cpu.cpp.
void pack_strips_(at::Tensor& qweight, int64_t qtype);
bool strips_native();
// The GGML type ids that have strips, and their strips' ids.
std::tuple<std::vector<int64_t>, std::vector<int64_t>> strip_types();
}  // namespace cpu

#ifdef PYLLM_WITH_CUDA
namespace cuda {
PYLLM_DECLARE_OPS
PYLLM_DECLARE_MOE_OPS
}  // namespace cuda
#endif

#undef PYLLM_DECLARE_OPS
#undef PYLLM_DECLARE_MOE_OPS

// Partition length of paged_attention_v2: each partition of this many tokens
// is reduced separately, then the partitions are merged. Python reads it back
// through torch.ops.pyllm.partition_size() to size exp_sums/max_logits/tmp_out.
constexpr int64_t kPartitionSize = 512;

// Most input rows small_batch_linear takes (a decode step of a few sequences).
constexpr int64_t kSmallBatchMaxRows = 4;

// Tokens per tile of the contiguous KV layout (see the top of this file).
constexpr int64_t kTokenTile = 16;

}  // namespace pyllm
