// The tile unit (AMX) of Xeons from Sapphire Rapids on, as the CPU kernels use it:
// eight tile registers of up to 16 rows x 64 bytes, bf16 products summed into
// float32 tiles. Compiled only where the build's -march names AMX (PYLLM_AMX).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PYLLM_AMX 1

#include <cstdint>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace pyllm::cpu::amx {

// Linux hands out the tile registers' state only on request, once per process.
inline bool ready() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// Every tile 16 rows of 64 bytes: a float32 tile of 16 x 16 sums, a bf16 A tile of
// 16 rows x 32 values, or a B tile of 16 pairs of rows x 16 columns. Per thread;
// _tile_release() when done.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

inline void load_config() {
  // A constant in memory: GCC does not order stores to a local config before
  // ldtilecfg's read (colsb was seen zero, a #GP), so the config is never built on
  // the stack.
  static const TileConfig config;
  _tile_loadconfig(&config);
}

}  // namespace pyllm::cpu::amx

#endif
