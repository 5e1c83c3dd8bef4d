// CUDA backend of the virtual KV arena (kv_arena.h): one virtual address range
// reserved with the driver's virtual memory API, physical memory created and mapped
// under it one granule at a time.
//
// The driver entry points are fetched at run time through the CUDA runtime
// (cudaGetDriverEntryPointByVersion), so the library has no link-time dependency
// on libcuda.so (absent on build machines without a GPU) and does not rely on the
// layout of torch's internal c10::cuda::DriverAPI struct, which changes between
// torch releases.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include "kv_arena.h"

namespace pyllm::cuda {
namespace {

// The driver functions the arena uses. The requested ABI version (12.0) is the
// oldest whose prototypes match cuda.h's for all of them; a newer driver still
// serves it.
struct DriverCalls {
  decltype(&cuGetErrorName) get_error_name = nullptr;
  decltype(&cuMemGetAllocationGranularity) get_granularity = nullptr;
  decltype(&cuMemAddressReserve) address_reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
};

constexpr unsigned int kDriverAbiVersion = 12000;

template <typename F>
void load_entry_point(const char* symbol, F* fn) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &ptr, kDriverAbiVersion,
                                                          cudaEnableDefault, &status);
  TORCH_CHECK(err == cudaSuccess && status == cudaDriverEntryPointSuccess && ptr != nullptr,
              "the CUDA driver does not provide ", symbol, " (version ", kDriverAbiVersion,
              "): ", cudaGetErrorString(err), ", query status ", static_cast<int>(status));
  *fn = reinterpret_cast<F>(ptr);
}

const DriverCalls& driver() {
  static DriverCalls calls;
  static std::once_flag loaded;
  std::call_once(loaded, [] {
    load_entry_point("cuGetErrorName", &calls.get_error_name);
    load_entry_point("cuMemGetAllocationGranularity", &calls.get_granularity);
    load_entry_point("cuMemAddressReserve", &calls.address_reserve);
    load_entry_point("cuMemAddressFree", &calls.address_free);
    load_entry_point("cuMemCreate", &calls.create);
    load_entry_point("cuMemRelease", &calls.release);
    load_entry_point("cuMemMap", &calls.map);
    load_entry_point("cuMemUnmap", &calls.unmap);
    load_entry_point("cuMemSetAccess", &calls.set_access);
  });
  return calls;
}

const char* error_name(CUresult result) {
  const char* name = nullptr;
  if (driver().get_error_name(result, &name) != CUDA_SUCCESS || name == nullptr) {
    return "unknown CUresult";
  }
  return name;
}

// TORCH_CHECK for a driver call: the message names the call and the CUresult.
#define PYLLM_CU_CHECK(expr, what)                                                    \
  do {                                                                                \
    const CUresult pyllm_cu_result = (expr);                                          \
    TORCH_CHECK(pyllm_cu_result == CUDA_SUCCESS, "virtual KV arena: ", what,           \
                " failed: ", error_name(pyllm_cu_result), " (",                       \
                static_cast<int>(pyllm_cu_result), ")");                              \
  } while (0)

// Physical memory pinned on one device, the only kind cuMemCreate makes for device
// memory.
CUmemAllocationProp device_allocation(int device_index) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device_index;
  return prop;
}

class CudaVirtualMemory final : public VirtualMemory {
 public:
  CudaVirtualMemory(int64_t bytes, int device_index)
      : device_index_(device_index), prop_(device_allocation(device_index)) {
    TORCH_CHECK(bytes > 0, "reserve_virtual_memory: bytes must be positive, got ", bytes);
    TORCH_CHECK(device_index >= 0, "reserve_virtual_memory: device_index must be >= 0, got ",
                device_index);
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
    // Creates the device's primary context (the runtime does so lazily), which
    // the driver calls below need to be current.
    C10_CUDA_CHECK(cudaFree(nullptr));

    size_t granularity = 0;
    PYLLM_CU_CHECK(driver().get_granularity(&granularity, &prop_,
                                            CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                   "cuMemGetAllocationGranularity");
    TORCH_CHECK(granularity > 0, "cuMemGetAllocationGranularity returned 0");
    granularity_ = static_cast<int64_t>(granularity);
    reserved_ = (bytes + granularity_ - 1) / granularity_ * granularity_;

    CUdeviceptr base = 0;
    PYLLM_CU_CHECK(driver().address_reserve(&base, static_cast<size_t>(reserved_),
                                            static_cast<size_t>(granularity_), 0, 0),
                   "cuMemAddressReserve of " + std::to_string(reserved_) + " bytes");
    base_ = base;
    // One handle per granule; 0 = nothing mapped there. 64 GiB of 2 MiB granules
    // is 32768 entries.
    handles_.assign(static_cast<size_t>(reserved_ / granularity_), 0);

    access_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access_.location.id = device_index;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }

  ~CudaVirtualMemory() override {
    // Never throws: at interpreter exit the driver may already be shut down
    // (CUDA_ERROR_DEINITIALIZED), and then there is nothing left to give back.
    try {
      const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
      // Kernels still in flight may read the range.
      (void)cudaDeviceSynchronize();
      for (size_t g = 0; g < handles_.size(); ++g) {
        if (handles_[g] == 0) continue;
        (void)driver().unmap(granule_address(static_cast<int64_t>(g)),
                             static_cast<size_t>(granularity_));
        (void)driver().release(handles_[g]);
        handles_[g] = 0;
      }
      (void)driver().address_free(base_, static_cast<size_t>(reserved_));
    } catch (...) {
    }
  }

  char* base() const override { return reinterpret_cast<char*>(base_); }
  int64_t reserved_bytes() const override { return reserved_; }
  int64_t granularity() const override { return granularity_; }

  // Maps physical memory under [offset, offset + bytes). Granules already mapped
  // are kept as they are, so overlapping requests are harmless. A failure (out of
  // device memory, typically) leaves the granules mapped before it mapped.
  void map(int64_t offset, int64_t bytes) override {
    check_range("map", offset, bytes);
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    const size_t size = static_cast<size_t>(granularity_);
    for (int64_t g = offset / granularity_; g < (offset + bytes) / granularity_; ++g) {
      if (handles_[g] != 0) continue;
      CUmemGenericAllocationHandle handle = 0;
      PYLLM_CU_CHECK(driver().create(&handle, size, &prop_, 0),
                     "cuMemCreate of " + std::to_string(granularity_) + " bytes on device " +
                         std::to_string(device_index_));
      const CUdeviceptr address = granule_address(g);
      CUresult result = driver().map(address, size, 0, handle, 0);
      if (result == CUDA_SUCCESS) {
        result = driver().set_access(address, size, &access_, 1);
        if (result != CUDA_SUCCESS) (void)driver().unmap(address, size);
      }
      if (result != CUDA_SUCCESS) {
        (void)driver().release(handle);
        PYLLM_CU_CHECK(result,
                       "cuMemMap/cuMemSetAccess at offset " + std::to_string(g * granularity_));
      }
      handles_[g] = handle;
    }
  }

  // Gives the physical memory under [offset, offset + bytes) back to the device.
  // Granules not mapped are skipped.
  void unmap(int64_t offset, int64_t bytes) override {
    check_range("unmap", offset, bytes);
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    const int64_t first = offset / granularity_;
    const int64_t end = (offset + bytes) / granularity_;
    bool any_mapped = false;
    for (int64_t g = first; g < end && !any_mapped; ++g) any_mapped = handles_[g] != 0;
    if (!any_mapped) return;
    // Kernels queued on any stream may still read these pages; unmapping under
    // them would fault. Unmapping happens when sequences finish, not per token,
    // so a device-wide wait is affordable and simpler than tracking streams.
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    const size_t size = static_cast<size_t>(granularity_);
    for (int64_t g = first; g < end; ++g) {
      if (handles_[g] == 0) continue;
      PYLLM_CU_CHECK(driver().unmap(granule_address(g), size),
                     "cuMemUnmap at offset " + std::to_string(g * granularity_));
      const CUmemGenericAllocationHandle handle = handles_[g];
      handles_[g] = 0;
      PYLLM_CU_CHECK(driver().release(handle),
                     "cuMemRelease at offset " + std::to_string(g * granularity_));
    }
  }

 private:
  CUdeviceptr granule_address(int64_t granule) const {
    return base_ + static_cast<CUdeviceptr>(granule * granularity_);
  }

  void check_range(const char* what, int64_t offset, int64_t bytes) const {
    TORCH_CHECK(offset >= 0 && bytes >= 0 && offset <= reserved_ && bytes <= reserved_ - offset,
                "virtual KV arena: ", what, " of [", offset, ", ", offset, " + ", bytes,
                ") is outside the reserved ", reserved_, " bytes");
    TORCH_CHECK(offset % granularity_ == 0 && bytes % granularity_ == 0, "virtual KV arena: ",
                what, " of ", bytes, " bytes at offset ", offset,
                " is not aligned to the granularity ", granularity_);
  }

  int device_index_;
  CUmemAllocationProp prop_;
  CUmemAccessDesc access_{};
  int64_t granularity_ = 0;
  int64_t reserved_ = 0;
  CUdeviceptr base_ = 0;
  std::vector<CUmemGenericAllocationHandle> handles_;
};

}  // namespace

std::unique_ptr<VirtualMemory> reserve_virtual_memory(int64_t bytes, int device_index) {
  return std::make_unique<CudaVirtualMemory>(bytes, device_index);
}

}  // namespace pyllm::cuda
