// fp8 (e4m3fn and e5m2, as torch.float8_e4m3fn / float8_e5m2 store them) to float32 on the host: one value, or
// sixteen in GCC's vector types by moving each byte's exponent and mantissa bits into an fp16's, so a KV row
// widens with a few vector instructions instead of a table lookup per element (the same values lane by lane).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels.h"

inline float fp8_e4m3_to_float(uint8_t bits) {
  const int exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
  float magnitude;
  if (exponent == 0xF && mantissa == 0x7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();  // e4m3fn has no infinities, and one NaN per sign
  } else if (exponent == 0) {
    magnitude = std::ldexp(mantissa / 8.0f, -6);
  } else {
    magnitude = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  }
  return bits >> 7 ? -magnitude : magnitude;
}

// e5m2 is the top byte of an fp16 number
inline float fp8_e5m2_to_float(uint8_t bits) {
  const uint16_t half_bits = static_cast<uint16_t>(bits) << 8;
  _Float16 half;
  std::memcpy(&half, &half_bits, sizeof(half));
  return static_cast<float>(half);
}

typedef uint8_t fp8_u8x16 __attribute__((vector_size(16)));
typedef uint16_t fp8_u16x16 __attribute__((vector_size(32)));
typedef float fp8_f32x16 __attribute__((vector_size(64)));  // the attention kernel's v16f

// Sixteen bytes of format CODE (PB_FP8_E4M3 or PB_FP8_E5M2) at `p` as floats, through fp16 (one vcvtph2ps).
template <int32_t CODE>
inline fp8_f32x16 fp8x16_to_float(const uint8_t* p) {
  fp8_u8x16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const fp8_u16x16 byte = __builtin_convertvector(raw, fp8_u16x16);
  fp8_u16x16 bits;
  if constexpr (CODE == PB_FP8_E5M2) {
    bits = byte << 8;  // the top byte of an fp16 number, infinities and NaNs included
  } else {
    // e4m3fn's exponent and mantissa bits, put where fp16's go, read 2^-8 of the value (fp16's exponent bias is 15,
    // e4m3's 7), subnormals included; only its NaN (S.1111.111) would read 480, so it becomes fp16's NaN
    const fp8_u16x16 magnitude = byte & 0x7F;
    bits = magnitude == 0x7F ? fp8_u16x16{} + 0x7E00 : magnitude << 7;
    bits |= (byte & 0x80) << 8;
  }
  _Float16 half[16];
  std::memcpy(half, &bits, sizeof(half));
  float widened[16];  // this loop is one vcvtph2ps; GCC 12 converts a vector of _Float16 a lane at a time
  for (int i = 0; i < 16; ++i) widened[i] = static_cast<float>(half[i]);
  fp8_f32x16 value;
  std::memcpy(&value, widened, sizeof(value));
  return CODE == PB_FP8_E5M2 ? value : value * 256.0f;
}
