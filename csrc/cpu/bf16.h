// bfloat16 <-> float32 on the host, as torch converts: a bf16 is the top half of a float32; rounding to it is
// round-to-nearest-even, with NaN kept a (quiet) NaN. Shared by the attention and panel linear kernels.
#pragma once

#include <cstdint>
#include <cstring>

inline float bf16_to_float(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

inline uint16_t float_to_bf16(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x40u);
  word += 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>(word >> 16);
}
