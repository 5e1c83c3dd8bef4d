// The CPU backend of the virtual KV arena: one anonymous private mapping.
//
// Reserve: mmap(PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE).
// NORESERVE keeps the reservation out of the kernel's commit accounting, so far more
// virtual KV than the machine's memory can be reserved (with vm.overcommit_memory 0 or
// 1; mode 2 refuses such reservations, which surfaces as a clear error here). The range
// is readable and writable from the start, deliberately: a stray read of a page that
// was never mapped (or was given back) sees the kernel's shared zero page -- zeros, no
// memory used -- instead of a SIGSEGV that would kill the whole server. PROT_NONE plus
// mprotect per commit would turn every such caller bug into a crash, and split the
// mapping into one VMA per committed range.
//
// map: madvise(MADV_POPULATE_WRITE) faults the pages in now, ahead of need, so the
// kernels that write the next tokens do not take a page fault per 4 KiB on the step's
// critical path. Kernels older than 5.14 lack it (EINVAL): then one byte per page is
// written instead, which has the same effect.
// unmap: madvise(MADV_DONTNEED) gives the pages back at once; the range stays reserved
// and later reads see zeros again.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include <c10/util/Exception.h>

#include "kv_arena.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack the name
#endif

namespace pyllm::cpu {
namespace {

class AnonymousMemory final : public VirtualMemory {
 public:
  explicit AnonymousMemory(int64_t bytes) {
    page_ = sysconf(_SC_PAGESIZE);
    TORCH_CHECK(bytes > 0, "reserve_virtual_memory: bytes must be positive, got ", bytes);
    bytes_ = (bytes + page_ - 1) / page_ * page_;
    void* p = mmap(nullptr, size_t(bytes_), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    TORCH_CHECK(p != MAP_FAILED, "reserve_virtual_memory: mmap of ", bytes_,
                " bytes failed: ", std::strerror(errno),
                " (vm.overcommit_memory = 2 refuses reservations past the commit limit)");
    base_ = static_cast<char*>(p);
  }

  ~AnonymousMemory() override { munmap(base_, size_t(bytes_)); }

  char* base() const override { return base_; }
  int64_t reserved_bytes() const override { return bytes_; }
  int64_t granularity() const override { return page_; }

  void map(int64_t offset, int64_t bytes) override {
    check_range("map", offset, bytes);
    if (bytes == 0) return;
    if (populate_write_supported_.load(std::memory_order_relaxed)) {
      if (madvise(base_ + offset, size_t(bytes), MADV_POPULATE_WRITE) == 0) return;
      // EINVAL: the kernel predates MADV_POPULATE_WRITE; touch pages from now on.
      // Anything else (ENOMEM: out of memory) is a real failure.
      TORCH_CHECK(errno == EINVAL, "KV arena: committing ", bytes, " bytes failed: ",
                  std::strerror(errno));
      populate_write_supported_.store(false, std::memory_order_relaxed);
    }
    // Writing one byte per page faults it in. The pages are either fresh (zero) or
    // already mapped; writing back the byte read keeps what a mapped page holds.
    volatile char* p = base_ + offset;
    for (int64_t b = 0; b < bytes; b += page_) p[b] = p[b];
  }

  void unmap(int64_t offset, int64_t bytes) override {
    check_range("unmap", offset, bytes);
    if (bytes == 0) return;
    TORCH_CHECK(madvise(base_ + offset, size_t(bytes), MADV_DONTNEED) == 0,
                "KV arena: releasing ", bytes, " bytes failed: ", std::strerror(errno));
  }

 private:
  void check_range(const char* what, int64_t offset, int64_t bytes) const {
    TORCH_CHECK(offset >= 0 && bytes >= 0 && offset % page_ == 0 && bytes % page_ == 0 &&
                    offset + bytes <= bytes_,
                "VirtualMemory::", what, ": [", offset, ", ", offset + bytes,
                ") is not a page-aligned range inside the ", bytes_, "-byte reservation");
  }

  char* base_ = nullptr;
  int64_t bytes_ = 0;
  int64_t page_ = 4096;
  std::atomic<bool> populate_write_supported_{true};
};

}  // namespace

std::unique_ptr<VirtualMemory> reserve_virtual_memory(int64_t bytes) {
  return std::make_unique<AnonymousMemory>(bytes);
}

}  // namespace pyllm::cpu
