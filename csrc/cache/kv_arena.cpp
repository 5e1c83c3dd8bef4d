// The virtual KV arena above the VirtualMemory backends: the slot layout (see
// KVArena in kv_arena.h), the per-layer tensor views the contiguous kernels read, and
// what each slot has committed. Device-independent; the only device-specific call is
// the backend's reserve_virtual_memory.
#include "kv_arena.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include "../ops.h"

namespace pyllm {
namespace {

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

std::shared_ptr<VirtualMemory> reserve(int64_t bytes, const at::Device& device) {
  if (device.is_cpu()) return cpu::reserve_virtual_memory(bytes);
#ifdef PYLLM_WITH_CUDA
  if (device.is_cuda()) return cuda::reserve_virtual_memory(bytes, device.index());
#endif
  TORCH_CHECK(false, "KVArena: device ", device, " is not supported by this build of pyllm");
}

}  // namespace

KVArena::KVArena(int64_t num_layers, int64_t max_num_seqs, int64_t max_model_len,
                 int64_t num_kv_heads, int64_t head_size, at::ScalarType dtype, at::Device device)
    : num_layers_(num_layers),
      max_num_seqs_(max_num_seqs),
      max_model_len_(max_model_len),
      num_kv_heads_(num_kv_heads),
      head_size_(head_size),
      dtype_(dtype),
      device_(device) {
  for (const auto& [value, name] : {std::pair{num_layers, "num_layers"},
                                    {max_num_seqs, "max_num_seqs"},
                                    {max_model_len, "max_model_len"},
                                    {num_kv_heads, "num_kv_heads"},
                                    {head_size, "head_size"}}) {
    TORCH_CHECK(value > 0, "KVArena: ", name, " must be positive, got ", value);
  }
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 ||
                  dtype == at::kChar,
              "KVArena: dtype must be float32, float16, bfloat16 or int8, got ", dtype);
  const int64_t element = int64_t(c10::elementSize(dtype));
  TORCH_CHECK(head_size % (16 / element) == 0, "KVArena: head_size ", head_size,
              " must be a multiple of x = ", 16 / element);
  if (device_.is_cuda() && !device_.has_index()) device_ = at::Device(at::kCUDA, 0);
  // Each reservation: max_num_seqs slot ranges of whole granules (kv_arena.h).
  const int64_t max_tiles = (max_model_len + kTokenTile - 1) / kTokenTile;
  tile_bytes_ = num_layers * num_kv_heads * head_size * kTokenTile * element;
  const int64_t unrounded = max_tiles * tile_bytes_;
  keys_ = reserve(max_num_seqs * unrounded, device_);
  slot_bytes_ = round_up(unrounded, keys_->granularity());
  // The backend tells its granularity only once it exists: reserve again in the
  // rare case that rounding each slot up to whole granules needs more room.
  if (keys_->reserved_bytes() < max_num_seqs * slot_bytes_) {
    keys_.reset();
    keys_ = reserve(max_num_seqs * slot_bytes_, device_);
  }
  values_ = reserve(max_num_seqs * slot_bytes_, device_);
  mapped_bytes_.assign(max_num_seqs, 0);
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    key_views_.push_back(view(keys_, layer, true));
    value_views_.push_back(view(values_, layer, false));
  }
}

at::Tensor KVArena::view(const std::shared_ptr<VirtualMemory>& memory, int64_t layer,
                         bool keys) const {
  const int64_t element = int64_t(c10::elementSize(dtype_));
  const int64_t x = 16 / element;
  const int64_t block = head_size_ * kTokenTile;  // elements of one (tile, layer, head)
  const int64_t max_tiles = (max_model_len_ + kTokenTile - 1) / kTokenTile;
  const int64_t slot_stride = slot_bytes_ / element, tile_stride = tile_bytes_ / element;
  char* base = memory->base() + layer * num_kv_heads_ * block * element;
  // The deleter owns a reference: the reservation outlives every view of it.
  auto keep_alive = [memory](void*) {};
  const auto options = at::TensorOptions().dtype(dtype_).device(device_);
  // The device is given, not read off the pointer: nothing is mapped under a fresh
  // reservation, and CUDA reports such an address as unregistered host memory.
  auto make = [&](at::IntArrayRef sizes, at::IntArrayRef strides) {
    return at::for_blob(base, sizes)
        .strides(strides)
        .deleter(keep_alive)
        .options(options)
        .target_device(device_)
        .make_tensor();
  };
  if (keys) {
    return make({max_num_seqs_, num_kv_heads_, max_tiles, head_size_ / x, kTokenTile, x},
                {slot_stride, block, tile_stride, kTokenTile * x, x, 1});
  }
  return make({max_num_seqs_, num_kv_heads_, max_tiles, head_size_, kTokenTile},
              {slot_stride, block, tile_stride, kTokenTile, 1});
}

void KVArena::check_slot(const char* what, int64_t slot) const {
  TORCH_CHECK(slot >= 0 && slot < max_num_seqs_, "KVArena.", what, ": slot ", slot,
              " is outside [0, ", max_num_seqs_, ")");
}

at::Tensor KVArena::key_cache(int64_t layer) const {
  TORCH_CHECK(layer >= 0 && layer < num_layers_, "KVArena.key_cache: layer ", layer,
              " is outside [0, ", num_layers_, ")");
  return key_views_[layer];
}

at::Tensor KVArena::value_cache(int64_t layer) const {
  TORCH_CHECK(layer >= 0 && layer < num_layers_, "KVArena.value_cache: layer ", layer,
              " is outside [0, ", num_layers_, ")");
  return value_views_[layer];
}

int64_t KVArena::commit(int64_t slot, int64_t num_tokens) {
  check_slot("commit", slot);
  TORCH_CHECK(num_tokens >= 0 && num_tokens <= max_model_len_, "KVArena.commit: num_tokens ",
              num_tokens, " is outside [0, ", max_model_len_, "]");
  const int64_t tiles = (num_tokens + kTokenTile - 1) / kTokenTile;
  const int64_t needed =
      std::min(slot_bytes_, round_up(tiles * tile_bytes_, keys_->granularity()));
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t& mapped = mapped_bytes_[slot];
  if (needed > mapped) {
    const int64_t offset = slot * slot_bytes_ + mapped, bytes = needed - mapped;
    keys_->map(offset, bytes);
    try {
      values_->map(offset, bytes);
    } catch (...) {
      keys_->unmap(offset, bytes);  // all or nothing: the slot's count stays true
      throw;
    }
    total_mapped_bytes_ += bytes;
    mapped = needed;
  }
  return std::min(max_model_len_, mapped / tile_bytes_ * kTokenTile);
}

void KVArena::release(int64_t slot, int64_t keep_tokens) {
  check_slot("release", slot);
  TORCH_CHECK(keep_tokens >= 0 && keep_tokens <= max_model_len_, "KVArena.release: keep_tokens ",
              keep_tokens, " is outside [0, ", max_model_len_, "]");
  const int64_t tiles = (keep_tokens + kTokenTile - 1) / kTokenTile;
  const int64_t keep =
      std::min(slot_bytes_, round_up(tiles * tile_bytes_, keys_->granularity()));
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t& mapped = mapped_bytes_[slot];
  // On the CPU the whole tail of the slot range is dropped: a write past the
  // committed tokens (a caller bug the kernels cannot see) faulted pages in there,
  // and this gives them back too. CUDA memory past the mapped prefix is never mapped.
  const int64_t end = device_.is_cpu() ? slot_bytes_ : mapped;
  if (keep >= end) return;
  keys_->unmap(slot * slot_bytes_ + keep, end - keep);
  values_->unmap(slot * slot_bytes_ + keep, end - keep);
  if (mapped > keep) {
    total_mapped_bytes_ -= mapped - keep;
    mapped = keep;
  }
}

int64_t KVArena::committed_tokens(int64_t slot) const {
  check_slot("committed_tokens", slot);
  std::lock_guard<std::mutex> lock(mutex_);
  return std::min(max_model_len_, mapped_bytes_[slot] / tile_bytes_ * kTokenTile);
}

int64_t KVArena::committed_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return 2 * total_mapped_bytes_;
}

int64_t KVArena::reserved_bytes() const {
  return keys_->reserved_bytes() + values_->reserved_bytes();
}

int64_t KVArena::granularity() const { return keys_->granularity(); }

}  // namespace pyllm
