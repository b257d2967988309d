// fp8 (e4m3fn and e5m2, as torch.float8_e4m3fn / float8_e5m2 store them) to float32 on the host, sixteen at a time
// in GCC's vector types (bf16.h's): each byte's exponent and mantissa bits move into an fp16's, so a KV row widens
// with a few vector instructions instead of a table lookup per element. A row's last few elements go through a
// zero-padded copy, so there is one rule for every element.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "kernels.h"

// Whether a PbCpuDtype code is one of the fp8 formats.
constexpr bool is_fp8(int32_t code) { return code == PB_FP8_E4M3 || code == PB_FP8_E5M2; }

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

#if defined(__AVX512BW__)
// Thirty-two bytes of format CODE at `p` as bfloat16, by moving bits: a normal number's exponent is rebiased (e4m3's
// 7 and e5m2's 15 to bf16's 127) and its mantissa shifted up; subnormals, which become normal in bf16, come from a
// table; e4m3's NaN (S.1111.111) and e5m2's infinities and NaNs are set apart.
template <int32_t CODE>
inline __m512i fp8x32_to_bf16(const uint8_t* p) {
  constexpr bool kE5M2 = CODE == PB_FP8_E5M2;
  constexpr int kMantissa = kE5M2 ? 2 : 3, kRebias = kE5M2 ? 127 - 15 : 127 - 7;
  constexpr short kLargestNumber = kE5M2 ? 0x7C : 0x7E;  // above it, NaNs (e5m2's 0x7C is its infinity)
  // m * 2^-16 (e5m2) or m * 2^-9 (e4m3) for the subnormal mantissas m, in bf16
  const __m512i subnormal = kE5M2 ? _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, 0x3840380037800000)
                                  : _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0x3C603C403C203C00, 0x3BC03B803B000000);
  const __m512i byte = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i magnitude = _mm512_and_si512(byte, _mm512_set1_epi16(0x7F));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(byte, _mm512_set1_epi16(0x80)), 8);
  __m512i bits = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 7 - kMantissa), _mm512_set1_epi16(kRebias << 7));
  bits = _mm512_mask_permutexvar_epi16(bits, _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(1 << kMantissa)),
                                       magnitude, subnormal);
  if constexpr (kE5M2)  // its infinity; e4m3 has none
    bits = _mm512_mask_mov_epi16(bits, _mm512_cmpeq_epi16_mask(magnitude, _mm512_set1_epi16(0x7C)),
                                 _mm512_set1_epi16(0x7F80));
  bits = _mm512_mask_mov_epi16(bits, _mm512_cmpgt_epu16_mask(magnitude, _mm512_set1_epi16(kLargestNumber)),
                               _mm512_set1_epi16(0x7FC0));  // NaN
  return _mm512_or_si512(bits, sign);
}

// `n` elements (a multiple of 32, as the AMX tiles' head_dim is) of format CODE at `bytes` as bfloat16 in `dst`,
// exactly: an fp8 number has at most three mantissa bits and an exponent within bf16's range.
template <int32_t CODE>
inline void fp8_row_to_bf16(const uint8_t* bytes, int n, uint16_t* dst) {
  for (int i = 0; i < n; i += 32) _mm512_storeu_si512(dst + i, fp8x32_to_bf16<CODE>(bytes + i));
}
#endif

// `x` in format CODE as torch's `x.clamp(-max, max).to(float8_*)` stores it (ops/reference.py's to_fp8): saturated to
// the finite range, then rounded to nearest, ties to even; NaN stays NaN.
template <int32_t CODE>
inline uint8_t float_to_fp8(float x) {
  constexpr int kMantissa = CODE == PB_FP8_E5M2 ? 2 : 3, kBias = CODE == PB_FP8_E5M2 ? 15 : 7;
  constexpr float kMax = CODE == PB_FP8_E5M2 ? 57344.0f : 448.0f;
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  if (std::isnan(x)) return sign | 0x7F;
  const float magnitude = std::fmin(std::fabs(x), kMax);
  constexpr float kSmallestNormal = CODE == PB_FP8_E5M2 ? 0x1p-14f : 0x1p-6f;
  constexpr float kSteps = CODE == PB_FP8_E5M2 ? 0x1p16f : 0x1p9f;  // subnormal steps per unit
  if (magnitude < kSmallestNormal)  // a subnormal (or zero): a whole number of its steps, scaled exactly
    return sign | static_cast<uint8_t>(std::nearbyint(magnitude * kSteps));
  constexpr int kCut = 23 - kMantissa;  // the float mantissa bits that go
  std::memcpy(&bits, &magnitude, sizeof(bits));
  bits += ((bits >> kCut) & 1) + (1u << (kCut - 1)) - 1;  // to nearest even; a carry moves into the exponent
  const uint32_t exponent = (bits >> 23) - 127 + kBias, mantissa = (bits >> kCut) & ((1u << kMantissa) - 1);
  return sign | static_cast<uint8_t>(exponent << kMantissa | mantissa);
}

// `n` elements of `src` over `scale`, in format CODE.
template <int32_t CODE, typename Load>
inline void fp8_store_row(Load load, int n, float scale, uint8_t* dst) {
  for (int i = 0; i < n; ++i) dst[i] = float_to_fp8<CODE>(load(i) / scale);
}
