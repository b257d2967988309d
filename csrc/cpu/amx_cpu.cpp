// The process-wide AMX switch (amx.h) as a C entry point: paged_backend/ops/cpu.py's `amx_tiles` and
// PAGED_BACKEND_CPU_AMX. It turns the tiles on or off for every kernel of this library together.

#include <cstdint>

#include "amx.h"
#include "kernels.h"

extern "C" {

// `use` 1 turns the tiles on where this build and the OS allow them, 0 off (the AVX-512 code), -1 asks. Returns the
// state now.
int32_t pb_cpu_amx(int32_t use) {
#if defined(PB_AMX)
  if (use >= 0) pb_amx::enabled().store(use == 1 && pb_amx::tiles_granted());
  return pb_amx::in_use() ? 1 : 0;
#else
  (void)use;
  return 0;
#endif
}

}  // extern "C"
