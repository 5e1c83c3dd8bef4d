// The head sizes and KV block sizes the attention kernels are built for: the one
// list of each (pyllm.ops reads them through torch.ops.pyllm.supported_head_sizes()
// and supported_block_sizes()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace pyllm {

inline constexpr int64_t kHeadSizes[] = {64, 80, 96, 112, 128, 256};
inline constexpr int64_t kBlockSizes[] = {8, 16, 32};

template <std::size_t N>
constexpr bool is_listed(const int64_t (&list)[N], int64_t value) {
  for (std::size_t i = 0; i < N; ++i) {
    if (list[i] == value) return true;
  }
  return false;
}

template <std::size_t N>
std::vector<int64_t> as_vector(const int64_t (&list)[N]) {
  return std::vector<int64_t>(list, list + N);
}

// "64, 80, ..." for error messages.
template <std::size_t N>
std::string list_text(const int64_t (&list)[N]) {
  std::string text;
  for (std::size_t i = 0; i < N; ++i) text += (i ? ", " : "") + std::to_string(list[i]);
  return text;
}

namespace detail {
template <typename F, std::size_t... I>
bool call_head_size(int64_t value, F& f, std::index_sequence<I...>) {
  return ((value == kHeadSizes[I]
               ? (f(std::integral_constant<int, static_cast<int>(kHeadSizes[I])>{}), true)
               : false) ||
          ...);
}
template <typename F, std::size_t... I>
bool call_block_size(int64_t value, F& f, std::index_sequence<I...>) {
  return ((value == kBlockSizes[I]
               ? (f(std::integral_constant<int, static_cast<int>(kBlockSizes[I])>{}), true)
               : false) ||
          ...);
}
}  // namespace detail

// f(std::integral_constant<int, size>) for the listed size equal to value; false
// (nothing called) when value is not listed.
template <typename F>
bool dispatch_head_size(int64_t value, F&& f) {
  return detail::call_head_size(value, f, std::make_index_sequence<std::size(kHeadSizes)>{});
}
template <typename F>
bool dispatch_block_size(int64_t value, F&& f) {
  return detail::call_block_size(value, f, std::make_index_sequence<std::size(kBlockSizes)>{});
}

}  // namespace pyllm
