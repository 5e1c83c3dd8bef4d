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
// mmap(PROT_NONE, MAP_NORESERVE) to reserve; map = mprotect + populate; unmap =
// madvise(MADV_DONTNEED) + mprotect(PROT_NONE).
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
