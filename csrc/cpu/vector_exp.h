// e^x in plain float arithmetic, for loops that must vectorize: glibc's vector expf is only declared under
// -ffast-math (which would also break -inf handling), and std::exp stays a scalar libm call otherwise.
// Range reduction to 2^n * e^r, then Cephes' polynomial: ~1 ulp, branch-free. Shared by csrc/cpu's kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// e^x for x in [-87, 88] (callers clamp: 2^n must stay a normal float)
inline float exp_in_range(float x) {
  const float n = std::nearbyint(x * 1.44269504088896341f);        // round(x / ln 2)
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;        // x - n ln 2, in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
