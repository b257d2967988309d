// The AMX tile unit (Intel Sapphire Rapids and later), shared by the kernels that use it: whether this process may
// use it, one process-wide switch, and the tile configuration. Inline functions with one instance per process, so
// the panel linear and the attention kernel turn on and off together (PAGED_BACKEND_CPU_AMX).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#define PB_AMX 1

namespace pb_amx {

struct TileConfig {  // the tile unit's configuration (palette 1), as LDTILECFG reads it
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// Linux hands out the tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); a
// kernel that refuses (before 5.16, or a hypervisor without it) leaves the vector code in use.
inline bool tiles_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

inline std::atomic<bool>& enabled() {  // on from the first use wherever the tiles are granted
  static std::atomic<bool> state{tiles_granted()};
  return state;
}

inline bool in_use() { return enabled().load(std::memory_order_relaxed); }

}  // namespace pb_amx
#endif
