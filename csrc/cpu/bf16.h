// bfloat16 <-> float32 on the host, as torch converts: a bf16 is the top half of a float32; rounding to it is
// round-to-nearest-even, with NaN kept a (quiet) NaN. One value, or sixteen in GCC's vector types (the same
// results lane by lane). Shared by the attention and panel linear kernels.
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

// GCC vector types, also the panel linear kernel's and fp8.h's (the attention kernel's v16f is the same type).
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

inline f32x16 bf16x16_to_float(const uint16_t* p) {
  u16x16 half;
  std::memcpy(&half, p, sizeof(half));
  const u32x16 words = __builtin_convertvector(half, u32x16) << 16;
  f32x16 out;
  std::memcpy(&out, &words, sizeof(out));
  return out;
}

inline void float_to_bf16x16(f32x16 values, uint16_t* out) {
  u32x16 word;
  std::memcpy(&word, &values, sizeof(word));
  const u32x16 nan = (word & 0x7fffffffu) > 0x7f800000u;  // all ones where NaN
  const u32x16 rounded = (word + 0x7fffu + ((word >> 16) & 1u)) >> 16, quiet = (word >> 16) | 0x40u;
  const u16x16 halves = __builtin_convertvector((rounded & ~nan) | (quiet & nan), u16x16);
  std::memcpy(out, &halves, sizeof(halves));
}
