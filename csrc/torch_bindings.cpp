// The one place where pyllm's ops get their schemas and their per-device kernels.
//
// Schemas follow vLLM's where vLLM has the op, so code written against
// torch.ops._C.* ports over by changing the namespace.
#include <torch/custom_class.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <functional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention/sizes.h"
#include "cache/kv_arena.h"
#include "ops.h"
#include "quantization/gguf_formats.h"

TORCH_LIBRARY(pyllm, m) {
  // Cache ops.
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache,"
      " Tensor(b!) value_cache, Tensor slot_mapping, str kv_cache_dtype,"
      " Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def(
      "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches,"
      " Tensor block_mapping) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");

  // Attention over the paged KV cache.
  m.def(
      "paged_attention_v1(Tensor(a!) out, Tensor query, Tensor key_cache,"
      " Tensor value_cache, int num_kv_heads, float scale, Tensor block_tables,"
      " Tensor seq_lens, int block_size, int max_seq_len,"
      " Tensor? alibi_slopes, int sliding_window=0, Tensor? sinks=None,"
      " Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def(
      "paged_attention_v2(Tensor(a!) out, Tensor(b!) exp_sums,"
      " Tensor(c!) max_logits, Tensor(d!) tmp_out, Tensor query,"
      " Tensor key_cache, Tensor value_cache, int num_kv_heads, float scale,"
      " Tensor block_tables, Tensor seq_lens, int block_size, int max_seq_len,"
      " Tensor? alibi_slopes, int sliding_window=0, Tensor? sinks=None,"
      " Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def(
      "paged_attention_prefill(Tensor(a!) out, Tensor query, Tensor key_cache,"
      " Tensor value_cache, int num_kv_heads, float scale, Tensor block_tables,"
      " Tensor seq_lens, Tensor query_start_loc, int block_size,"
      " int max_query_len, Tensor? alibi_slopes, int sliding_window=0,"
      " Tensor? sinks=None,"
      " Tensor? k_scale=None, Tensor? v_scale=None) -> ()");

  // The contiguous KV layout (ops.h): K/V written at (slot, position), and
  // attention addressed by per-sequence slots instead of block tables.
  m.def(
      "write_kv_contiguous(Tensor key, Tensor value, Tensor(a!) key_cache,"
      " Tensor(b!) value_cache, Tensor token_slots, Tensor positions,"
      " Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def(
      "contiguous_attention_decode(Tensor(a!) out, Tensor query, Tensor key_cache,"
      " Tensor value_cache, int num_kv_heads, float scale, Tensor seq_slots,"
      " Tensor seq_lens, int max_seq_len, int sliding_window=0, Tensor? sinks=None,"
      " Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def(
      "contiguous_attention_prefill(Tensor(a!) out, Tensor query, Tensor key_cache,"
      " Tensor value_cache, int num_kv_heads, float scale, Tensor seq_slots,"
      " Tensor seq_lens, Tensor query_start_loc, int max_query_len,"
      " int sliding_window=0, Tensor? sinks=None,"
      " Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def("token_tile() -> int", []() -> int64_t { return pyllm::kTokenTile; });

  // The virtual KV arena that holds the contiguous layout (cache/kv_arena.h).
  m.class_<pyllm::KVArena>("KVArena")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, at::ScalarType,
                       at::Device>())
      .def("key_cache", &pyllm::KVArena::key_cache)
      .def("value_cache", &pyllm::KVArena::value_cache)
      .def("commit", &pyllm::KVArena::commit)
      .def("release", &pyllm::KVArena::release)
      .def("committed_tokens", &pyllm::KVArena::committed_tokens)
      .def("committed_bytes", &pyllm::KVArena::committed_bytes)
      .def("reserved_bytes", &pyllm::KVArena::reserved_bytes)
      .def("granularity", &pyllm::KVArena::granularity);

  // Positional encoding.
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key,"
      " int head_size, Tensor cos_sin_cache, bool is_neox) -> ()");

  // Small fused layers.
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()");
  m.def(
      "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight,"
      " float epsilon) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor input) -> ()");
  m.def("small_batch_linear(Tensor(a!) out, Tensor input, Tensor weight, Tensor? bias) -> ()");
  m.def(
      "packed_linear(Tensor(a!) out, Tensor input, Tensor packed_weight, Tensor? bias) -> ()");

  // Linear layers over GGUF-quantized weights (quantization/).
  m.def(
      "quant_linear(Tensor(a!) out, Tensor input, Tensor qweight, int qtype,"
      " Tensor? bias=None, int many_rows=0) -> ()");
  m.def("dequantize_rows(Tensor(a!) out, Tensor qweight, int qtype, Tensor? rows) -> ()");
  // Quantized weights in strips of 16 rows, a CPU layout (quantization/quant_strips.h).
  m.def("pack_strips_(Tensor(a!) qweight, int qtype) -> ()", &pyllm::cpu::pack_strips_);
  m.def("strips_native() -> bool", &pyllm::cpu::strips_native);
  m.def("strip_types() -> (int[], int[])", &pyllm::cpu::strip_types);

  // Mixture of experts (moe/): routing, and a whole MoE feed-forward.
  m.def(
      "moe_topk(Tensor(a!) topk_weights, Tensor(b!) topk_ids, Tensor router_logits,"
      " bool renormalize) -> ()");
  m.def(
      "fused_moe(Tensor(a!) out, Tensor hidden, Tensor router_logits, int top_k,"
      " bool renormalize, Tensor w_gate, Tensor w_up, Tensor w_down, int gate_type,"
      " int up_type, int down_type, Tensor? gate_bias, Tensor? up_bias,"
      " Tensor? down_bias, str activation=\"silu\", float alpha=1.702, float limit=7.0,"
      " int expert_start=0, int many_rows=0) -> ()");

  // Sampling: the grammar masks of structured output (sampling/).
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");

  // Build facts Python reads back.
  m.def("partition_size() -> int", []() -> int64_t { return pyllm::kPartitionSize; });
  m.def("supported_head_sizes() -> int[]", []() { return pyllm::as_vector(pyllm::kHeadSizes); });
  m.def("supported_block_sizes() -> int[]",
        []() { return pyllm::as_vector(pyllm::kBlockSizes); });
  // The GGUF types quant_linear reads: names, type ids, weights and bytes per block.
  m.def("quant_types() -> (str[], int[], int[], int[])", []() {
    std::vector<std::string> names;
    std::vector<int64_t> ids, blocks, bytes;
    for (const auto& t : pyllm::quant::kQuantTypes) {
      names.emplace_back(t.name);
      ids.push_back(t.id);
      blocks.push_back(t.block);
      bytes.push_back(t.bytes);
    }
    return std::make_tuple(names, ids, blocks, bytes);
  });
  // Batch-invariant quantized products (quantization/quant_matmul.h).
  m.def("set_batch_invariant(bool on) -> ()",
        [](bool on) { pyllm::cpu::set_batch_invariant(on); });
  m.def("batch_invariant() -> bool", []() -> bool { return pyllm::cpu::batch_invariant(); });
  m.def("small_batch_max_rows() -> int", []() -> int64_t { return pyllm::kSmallBatchMaxRows; });
  m.def("packed_linear_vectorized(ScalarType dtype) -> bool", [](at::ScalarType dtype) -> bool {
    return pyllm::cpu::packed_linear_vectorized_for(dtype);
  });
  m.def("built_with_cuda() -> bool", []() -> bool {
#ifdef PYLLM_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
}

#define PYLLM_REGISTER_IMPLS(ns)                                      \
  m.impl("reshape_and_cache", &pyllm::ns::reshape_and_cache);         \
  m.impl("copy_blocks", &pyllm::ns::copy_blocks);                     \
  m.impl("swap_blocks", &pyllm::ns::swap_blocks);                     \
  m.impl("paged_attention_v1", &pyllm::ns::paged_attention_v1);       \
  m.impl("paged_attention_v2", &pyllm::ns::paged_attention_v2);       \
  m.impl("paged_attention_prefill", &pyllm::ns::paged_attention_prefill); \
  m.impl("rotary_embedding", &pyllm::ns::rotary_embedding);           \
  m.impl("rms_norm", &pyllm::ns::rms_norm);                           \
  m.impl("fused_add_rms_norm", &pyllm::ns::fused_add_rms_norm);       \
  m.impl("silu_and_mul", &pyllm::ns::silu_and_mul);                   \
  m.impl("gelu_tanh_and_mul", &pyllm::ns::gelu_tanh_and_mul);         \
  m.impl("small_batch_linear", &pyllm::ns::small_batch_linear);       \
  m.impl("packed_linear", &pyllm::ns::packed_linear);                 \
  m.impl("quant_linear", &pyllm::ns::quant_linear);                   \
  m.impl("dequantize_rows", &pyllm::ns::dequantize_rows);             \
  m.impl("write_kv_contiguous", &pyllm::ns::write_kv_contiguous);     \
  m.impl("contiguous_attention_decode", &pyllm::ns::contiguous_attention_decode); \
  m.impl("contiguous_attention_prefill", &pyllm::ns::contiguous_attention_prefill); \
  m.impl("apply_token_bitmask", &pyllm::ns::apply_token_bitmask);     \
  m.impl("moe_topk", &pyllm::ns::moe_topk);                           \
  m.impl("fused_moe", &pyllm::ns::fused_moe);

TORCH_LIBRARY_IMPL(pyllm, CPU, m) { PYLLM_REGISTER_IMPLS(cpu) }

#ifdef PYLLM_WITH_CUDA
TORCH_LIBRARY_IMPL(pyllm, CUDA, m) { PYLLM_REGISTER_IMPLS(cuda) }
#endif

// `import pyllm._C` loads this library, which runs the registrations above. Its
// module holds the ops the model calls in every layer again, as plain functions of
// the same names and arguments: on CPU tensors they call the CPU kernel directly, on
// others they go through the dispatcher as torch.ops.pyllm.<name> does. A call
// through torch.ops costs about 1.2 us more (1.66 against 0.44 for a 64-wide
// rms_norm), and a small model's batch-1 decode step makes some 300 calls.
namespace {

template <typename T>
bool on_cpu(const T& arg) {
  using U = std::decay_t<T>;
  if constexpr (std::is_same_v<U, at::Tensor>) {
    return arg.is_cpu();
  } else if constexpr (std::is_same_v<U, std::optional<at::Tensor>>) {
    return !arg.has_value() || arg->is_cpu();
  } else {
    return true;
  }
}

// Kernel calls recorded with their arguments (the same tensors every time) and
// replayed in order from C++, with no Python between them: pyllm/model/step_graph.py.
class KernelGraph {
 public:
  void add(std::function<void()> call) { calls_.push_back(std::move(call)); }
  void replay() const {
    for (const auto& call : calls_) call();
  }
  size_t size() const { return calls_.size(); }

 private:
  std::vector<std::function<void()>> calls_;
};

template <typename Sig>
struct Direct;

template <typename... A>
struct Direct<void(A...)> {
  template <void (*Cpu)(A...)>
  static auto bind(const char* name) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<void(A...)>();
    return [op, name](A... args) {
      if ((on_cpu(args) && ...)) {
        // What the dispatcher records for the profiler (a no-op when none runs).
        RECORD_FUNCTION(name, std::vector<c10::IValue>());
        return Cpu(args...);
      }
      op.call(args...);
    };
  }

  // The call, stored with copies of its arguments (a tensor's copy shares its storage),
  // for KernelGraph::replay.
  template <void (*Cpu)(A...)>
  static auto record(const char* name) {
    return [name](KernelGraph& graph, A... args) {
      TORCH_CHECK((on_cpu(args) && ...), "KernelGraph records calls on CPU tensors only (",
                  name, ")");
      graph.add([stored = std::make_tuple(std::decay_t<A>(args)...)]() mutable {
        std::apply([](auto&... a) { Cpu(a...); }, stored);
      });
    };
  }
};

}  // namespace

#define PYLLM_DIRECT(name)                                                                  \
  m.def(#name, Direct<decltype(pyllm::cpu::name)>::bind<&pyllm::cpu::name>("pyllm::" #name), \
        pybind11::call_guard<pybind11::gil_scoped_release>());                               \
  graph.def(#name, Direct<decltype(pyllm::cpu::name)>::record<&pyllm::cpu::name>(#name));     \
  direct_ops.push_back(#name)

PYBIND11_MODULE(_C, m) {
  pybind11::class_<KernelGraph> graph(m, "KernelGraph");
  graph.def(pybind11::init<>())
      .def("replay", &KernelGraph::replay, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("__len__", &KernelGraph::size);
  std::vector<std::string> direct_ops;
  PYLLM_DIRECT(reshape_and_cache);
  PYLLM_DIRECT(paged_attention_v1);
  PYLLM_DIRECT(paged_attention_v2);
  PYLLM_DIRECT(paged_attention_prefill);
  PYLLM_DIRECT(rotary_embedding);
  PYLLM_DIRECT(rms_norm);
  PYLLM_DIRECT(fused_add_rms_norm);
  PYLLM_DIRECT(silu_and_mul);
  PYLLM_DIRECT(gelu_tanh_and_mul);
  PYLLM_DIRECT(small_batch_linear);
  PYLLM_DIRECT(packed_linear);
  PYLLM_DIRECT(quant_linear);
  PYLLM_DIRECT(dequantize_rows);
  PYLLM_DIRECT(write_kv_contiguous);
  PYLLM_DIRECT(contiguous_attention_decode);
  PYLLM_DIRECT(contiguous_attention_prefill);
  PYLLM_DIRECT(fused_moe);
  m.attr("DIRECT_OPS") = pybind11::tuple(pybind11::cast(direct_ops));
}
