// The virtual KV arena (dAttention / vAttention): every sequence slot's KV cache lies
// in one reserved virtual address range, and physical memory is mapped under a slot's
// tokens only as the sequence grows, and given back when it finishes.
//
// Device-specific code is only the VirtualMemory backend (reserve / map / unmap one
// range); the arena above it (kv_arena.cpp) lays out slots, layers, heads and tiles,
// tracks what each slot has committed, and hands out the per-layer tensor views
// the contiguous kernels read (layout: see csrc/ops.h).
#pragma once

#include <cstdint>
#include <memory>

namespace pyllm {

// One reserved virtual range. map/unmap take granularity-aligned byte ranges
// relative to base(). Newly mapped memory holds unspecified values (the kernels
// never read a slot past its seq_len).
class VirtualMemory {
 public:
  virtual ~VirtualMemory() = default;
  virtual char* base() const = 0;
  virtual int64_t reserved_bytes() const = 0;
  // Page size of map/unmap: 4 KiB on the CPU, cuMemGetAllocationGranularity on CUDA.
  virtual int64_t granularity() const = 0;
  virtual void map(int64_t offset, int64_t bytes) = 0;
  virtual void unmap(int64_t offset, int64_t bytes) = 0;
};

namespace cpu {
// mmap(PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE) to reserve
// (readable so that a stray read of an unmapped page sees zeros instead of crashing the
// process); map = madvise(MADV_POPULATE_WRITE) (pages faulted in ahead of need; one
// byte written per page where the kernel lacks it); unmap = madvise(MADV_DONTNEED).
// Granularity: the 4 KiB page. See kv_arena_cpu.cpp.
std::unique_ptr<VirtualMemory> reserve_virtual_memory(int64_t bytes);
}  // namespace cpu

#ifdef PYLLM_WITH_CUDA
namespace cuda {
// cuMemAddressReserve to reserve; map = cuMemCreate + cuMemMap + cuMemSetAccess per
// granule; unmap = cuMemUnmap + cuMemRelease.
std::unique_ptr<VirtualMemory> reserve_virtual_memory(int64_t bytes, int device_index);
}  // namespace cuda
#endif

}  // namespace pyllm

// The arena itself, a torch custom class (torch.classes.pyllm.KVArena, registered in
// torch_bindings.cpp). Host code only: the CUDA backend above needs none of it.
#ifndef __CUDACC__
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

namespace pyllm {

// Where a slot's memory lies: slot-major, and inside a slot tiles of kTokenTile tokens
// outermost, then layers, then kv heads, then the tile's dense [head_size, kTokenTile]
// block (keys as [head_size / x, kTokenTile, x]). Keys and values are two
// reservations laid out alike. In elements:
//   slot s, tile t, layer l, kv head h  ->  s * slot_stride + t * tile_stride
//                                           + (l * num_kv_heads + h) * block
//   block = head_size * kTokenTile, tile_stride = num_layers * num_kv_heads * block,
//   slot_stride = max_tiles * tile_stride rounded up to whole granules.
// Why: a sequence grows by whole tiles at its end, and with tiles outermost the memory
// under tokens [0, n) of a slot, in every layer, is one prefix of the slot's range. So
// a commit is one map call per reservation, waste is under one granule per slot and
// reservation (a 2 MiB CUDA granule holds the K, or V, of all layers for 8 tokens of
// Llama-2-7B, 32 of Llama-3-8B, 186 of TinyLlama in 16-bit), and no
// granule is ever shared by two slots (slot ranges start on granule boundaries), so
// slots are committed and released independently without refcounts. A layer-major
// layout ([layer][slot][tokens]) would need one granule per layer (and per head, with
// heads outermost) per slot. What it costs: one head's consecutive tiles are
// tile_stride apart instead of adjacent, which the kernels read exactly like paged
// blocks (prefetched one block at a time, see attention_cpu_kernels.h).
class KVArena : public torch::CustomClassHolder {
 public:
  KVArena(int64_t num_layers, int64_t max_num_seqs, int64_t max_model_len, int64_t num_kv_heads,
          int64_t head_size, at::ScalarType dtype, at::Device device);

  // Views of one layer in the contiguous layout of ops.h; each keeps the
  // reservation alive for as long as it lives.
  at::Tensor key_cache(int64_t layer) const;
  at::Tensor value_cache(int64_t layer) const;

  // Maps whatever backs tokens [0, num_tokens) of the slot in every layer (whole
  // granules; never shrinks). Returns committed_tokens(slot).
  int64_t commit(int64_t slot, int64_t num_tokens);
  // Gives back the slot's memory past its first keep_tokens tokens (rounded up to
  // whole granules; 0: all of it). Released tokens read as zeros on the CPU.
  void release(int64_t slot, int64_t keep_tokens);
  // Tokens of the slot whose K and V are backed by memory, in every layer (may
  // exceed what was asked for: granule rounding), at most max_model_len.
  int64_t committed_tokens(int64_t slot) const;
  int64_t committed_bytes() const;  // keys and values, all slots
  int64_t reserved_bytes() const;
  int64_t granularity() const;

 private:
  void check_slot(const char* what, int64_t slot) const;
  at::Tensor view(const std::shared_ptr<VirtualMemory>& memory, int64_t layer,
                  bool keys) const;

  int64_t num_layers_, max_num_seqs_, max_model_len_, num_kv_heads_, head_size_;
  at::ScalarType dtype_;
  at::Device device_;
  int64_t tile_bytes_ = 0;  // one tile of every layer and head, in one reservation
  int64_t slot_bytes_ = 0;  // slot_stride in bytes, whole granules
  std::shared_ptr<VirtualMemory> keys_, values_;
  std::vector<at::Tensor> key_views_, value_views_;
  mutable std::mutex mutex_;          // commit/release from the engine, reads from /metrics
  std::vector<int64_t> mapped_bytes_;  // per slot: the mapped prefix of its range
  int64_t total_mapped_bytes_ = 0;    // sum of mapped_bytes_ (one reservation)
};

}  // namespace pyllm
#endif  // __CUDACC__
