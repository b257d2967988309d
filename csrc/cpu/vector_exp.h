// e^x in plain float arithmetic, for loops that must vectorize: glibc's vector expf is only declared under
// -ffast-math (which would also break -inf handling), and std::exp stays a scalar libm call otherwise.
// Range reduction to 2^n * e^r, then Cephes' polynomial: ~1 ulp, branch-free. Shared by csrc/cpu's kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// e^r for r = x - n ln 2 (ln 2 in two parts), by the polynomial: on a float or on a GCC float vector, so the
// scalar and vector forms below share one set of coefficients.
template <class F>
inline F exp_mantissa(F x, F n) {
  const F r = x - n * 0.693359375f + n * 2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// e^x for x in [-87, 88] (callers clamp: 2^n must stay a normal float)
inline float exp_in_range(float x) {
  const float n = std::nearbyint(x * 1.44269504088896341f);  // round(x / ln 2)
  const float p = exp_mantissa(x, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
