// fp8 (e4m3fn and e5m2, as torch.float8_e4m3fn / float8_e5m2 store them) to float32 on the host, sixteen at a time
// in GCC's vector types (bf16.h's): each byte's exponent and mantissa bits move into an fp16's, so a KV row widens
// with a few vector instructions instead of a table lookup per element. A row's last few elements go through a
// zero-padded copy, so there is one rule for every element.
#pragma once

#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "kernels.h"

// Sixteen bytes of format CODE (PB_FP8_E4M3 or PB_FP8_E5M2) at `p` as floats, through fp16 (one vcvtph2ps).
template <int32_t CODE>
inline f32x16 fp8x16_to_float(const uint8_t* p) {
  typedef uint8_t u8x16 __attribute__((vector_size(16)));
  u8x16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  const u16x16 byte = __builtin_convertvector(raw, u16x16);
  u16x16 bits;
  if constexpr (CODE == PB_FP8_E5M2) {
    bits = byte << 8;  // the top byte of an fp16 number, infinities and NaNs included
  } else {
    // e4m3fn's exponent and mantissa bits, put where fp16's go, read 2^-8 of the value (fp16's exponent bias is 15,
    // e4m3's 7), subnormals included; only its NaN (S.1111.111) would read 480, so it becomes fp16's NaN
    const u16x16 magnitude = byte & 0x7F;
    bits = magnitude == 0x7F ? u16x16{} + 0x7E00 : magnitude << 7;
    bits |= (byte & 0x80) << 8;
  }
  _Float16 half[16];
  std::memcpy(half, &bits, sizeof(half));
  float widened[16];  // this loop is one vcvtph2ps; GCC 12 converts a vector of _Float16 a lane at a time
  for (int i = 0; i < 16; ++i) widened[i] = static_cast<float>(half[i]);
  f32x16 value;
  std::memcpy(&value, widened, sizeof(value));
  return CODE == PB_FP8_E5M2 ? value : value * 256.0f;
}

// `n` elements of format CODE at `bytes` as floats in `dst`.
template <int32_t CODE>
inline void fp8_row_to_float(const uint8_t* bytes, int n, float* dst) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const f32x16 values = fp8x16_to_float<CODE>(bytes + i);
    std::memcpy(dst + i, &values, sizeof(values));
  }
  if (i == n) return;
  uint8_t tail[16] = {};
  std::memcpy(tail, bytes + i, n - i);
  const f32x16 values = fp8x16_to_float<CODE>(tail);
  std::memcpy(dst + i, &values, (n - i) * sizeof(float));
}
