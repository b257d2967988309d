// Linear layers on weights packed once into 16-column panels: y = x @ W^T (+ bias) for x [M, K], W [N, K].
//
// A decode step multiplies one to a few rows by every weight matrix, so it is a stream over the weights: its
// speed is the memory bandwidth the kernel reaches. Packed as panels[N/16][K][16] (bf16: panels[N/16][K/2][16][2],
// the pair layout of AVX512-BF16's dot product), each task reads a few panels front to back, one 64-byte line per
// panel and k, and keeps one vector accumulator per (row, panel): no horizontal sums and no gathers. With 8
// panels per task at one or two rows it reaches the core's streaming bandwidth (~1.6x oneDNN's prepacked
// sgemm at one row, on a 2-core EPYC); with 6 rows x 4 panels it matches oneDNN up to prefill sizes.
//
// Every output is one fused multiply-add chain over k in order, whatever the row count or the tile it falls in,
// so results do not depend on the batch. Plain C ABI like paged_attention_cpu.cpp; paged_backend/ops/
// panel_linear.py mirrors it and holds the torch oracle (F.linear).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "bf16.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

enum Dtype : int32_t { F32 = 0, BF16 = 2 };
enum Status : int32_t { OK = 0, BAD_DTYPE = 1, BAD_SHAPE = 2 };
constexpr int kLanes = 16;  // outputs per panel: one 512-bit vector of floats
// At one or two rows the tile streams its panels from DRAM: it asks for each panel's line this many k steps ahead
// into L2 (prefetches never fault, so running past a panel's end is harmless). The hardware prefetcher alone
// left the stream at ~34 GB/s (bf16) / ~39 (fp32) on 2 cores; with this, ~38 / ~46 (alternating A/B, 2026-11-27).
constexpr int64_t kStreamAhead = 16;

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x32 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline int64_t panels_of(int64_t n) { return (n + kLanes - 1) / kLanes; }
inline int64_t padded_k(int64_t k, int32_t dtype) { return dtype == BF16 ? (k + 1) / 2 * 2 : k; }

// One k step of the float32 tile: acc[m][p] += x[m][k] * panel_p[k].
template <int MT, int NP>
inline void tile_f32(const float* x, int64_t x_stride, const float* panels, int64_t k_len, f32x16 (&acc)[MT][NP]) {
  for (int64_t k = 0; k < k_len; ++k) {
    if constexpr (MT <= 2)
      for (int p = 0; p < NP; ++p) __builtin_prefetch(panels + (p * k_len + k + kStreamAhead) * kLanes, 0, 1);
    f32x16 w[NP];
    for (int p = 0; p < NP; ++p) w[p] = load16(panels + (p * k_len + k) * kLanes);
    for (int m = 0; m < MT; ++m) {
      const f32x16 xb = f32x16{} + x[m * x_stride + k];
      for (int p = 0; p < NP; ++p) acc[m][p] += xb * w[p];
    }
  }
}

// One k pair of the bfloat16 tile: acc[m][p] += x[m][k] * w[k] + x[m][k+1] * w[k+1], AVX512-BF16's dot product
// where the CPU has it, else the same products in float32 (the pair layout is the same).
template <int MT, int NP>
inline void tile_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* panels, int64_t k_len, int64_t k_valid,
                      f32x16 (&acc)[MT][NP]) {
  const int64_t pairs = k_len / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    if constexpr (MT <= 2)
      for (int p = 0; p < NP; ++p) __builtin_prefetch(panels + (p * pairs + kp + kStreamAhead) * 2 * kLanes, 0, 1);
    u16x32 w[NP];
    for (int p = 0; p < NP; ++p) std::memcpy(&w[p], panels + (p * pairs + kp) * 2 * kLanes, sizeof(w[p]));
    const bool whole = 2 * kp + 1 < k_valid;  // both halves of the pair are real (an odd K ends in half a pair)
    for (int m = 0; m < MT; ++m) {
      const uint16_t* row = x + m * x_stride;
      uint32_t pair = row[2 * kp];
      if (whole) std::memcpy(&pair, row + 2 * kp, sizeof(pair));  // x[k] low, x[k+1] high: one 32-bit load
#if defined(__AVX512BF16__)
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
      for (int p = 0; p < NP; ++p) acc[m][p] = (f32x16)_mm512_dpbf16_ps((__m512)acc[m][p], xb, (__m512bh)w[p]);
#else
      const f32x16 b0 = f32x16{} + bf16_to_float(static_cast<uint16_t>(pair)),
                   b1 = f32x16{} + bf16_to_float(static_cast<uint16_t>(pair >> 16));
      for (int p = 0; p < NP; ++p) {
        const u32x16 bits = (u32x16)w[p];
        f32x16 even, odd;  // the pair's k and k+1 halves of each 32-bit lane
        const u32x16 lo = bits << 16, hi = bits & 0xffff0000u;
        std::memcpy(&even, &lo, sizeof(even));
        std::memcpy(&odd, &hi, sizeof(odd));
        acc[m][p] += b1 * odd;
        acc[m][p] += b0 * even;
      }
#endif
    }
  }
}

// Rows m0..m0+MT of outputs n0..n0+NP*16 (clipped to n), bias added in float32, rounded once to the dtype.
template <typename T, int MT, int NP>
void tile(const T* x, int64_t x_stride, const T* panels, const T* bias, T* y, int64_t y_stride, int64_t n0, int64_t n,
          int64_t k_len, int64_t k_valid) {
  f32x16 acc[MT][NP] = {};
  if constexpr (sizeof(T) == 4) {
    tile_f32<MT, NP>(x, x_stride, panels, k_len, acc);
  } else {
    tile_bf16<MT, NP>(x, x_stride, panels, k_len, k_valid, acc);
  }
  for (int m = 0; m < MT; ++m) {
    for (int p = 0; p < NP; ++p) {
      for (int j = 0; j < kLanes; ++j) {
        const int64_t col = n0 + p * kLanes + j;
        if (col >= n) break;
        float v = acc[m][p][j];
        if constexpr (sizeof(T) == 4) {
          if (bias != nullptr) v += bias[col];
          y[m * y_stride + col] = v;
        } else {
          if (bias != nullptr) v += bf16_to_float(bias[col]);
          y[m * y_stride + col] = float_to_bf16(v);
        }
      }
    }
  }
}

// Every row of x against NP panels starting at panel `first`, rows in tiles of 6 (the register budget: 6 x 4
// accumulators and 4 weight vectors).
template <typename T, int NP>
void column(const T* x, int64_t x_stride, const T* packed, const T* bias, T* y, int64_t y_stride, int64_t m_len,
            int64_t first, int64_t n, int64_t k_len, int64_t k_valid) {
  const T* panels = packed + first * k_len * kLanes;
  const int64_t n0 = first * kLanes;
  int64_t m = 0;
  for (; m + 6 <= m_len; m += 6) {
    tile<T, 6, NP>(x + m * x_stride, x_stride, panels, bias, y + m * y_stride, y_stride, n0, n, k_len, k_valid);
  }
  const T* xr = x + m * x_stride;
  T* yr = y + m * y_stride;
  switch (m_len - m) {
    case 5: tile<T, 5, NP>(xr, x_stride, panels, bias, yr, y_stride, n0, n, k_len, k_valid); break;
    case 4: tile<T, 4, NP>(xr, x_stride, panels, bias, yr, y_stride, n0, n, k_len, k_valid); break;
    case 3: tile<T, 3, NP>(xr, x_stride, panels, bias, yr, y_stride, n0, n, k_len, k_valid); break;
    case 2: tile<T, 2, NP>(xr, x_stride, panels, bias, yr, y_stride, n0, n, k_len, k_valid); break;
    case 1: tile<T, 1, NP>(xr, x_stride, panels, bias, yr, y_stride, n0, n, k_len, k_valid); break;
    default: break;
  }
}

// Threads only when the work pays for waking them.
inline int threads_for(int64_t multiply_adds, int32_t num_threads) {
  return multiply_adds >= (int64_t{1} << 17) ? num_threads : 1;
}

// `count` panels from `first`, in the widest tiles that fit (`widest`: 8 or 4 panels).
template <typename T>
void columns(const T* x, int64_t x_stride, const T* packed, const T* bias, T* y, int64_t y_stride, int64_t m_len,
             int64_t first, int64_t count, int64_t widest, int64_t n, int64_t k_len, int64_t k_valid) {
  int64_t p = first;
  const int64_t end = first + count;
  if (widest == 8)
    for (; p + 8 <= end; p += 8) column<T, 8>(x, x_stride, packed, bias, y, y_stride, m_len, p, n, k_len, k_valid);
  for (; p + 4 <= end; p += 4) column<T, 4>(x, x_stride, packed, bias, y, y_stride, m_len, p, n, k_len, k_valid);
  for (; p + 2 <= end; p += 2) column<T, 2>(x, x_stride, packed, bias, y, y_stride, m_len, p, n, k_len, k_valid);
  for (; p < end; ++p) column<T, 1>(x, x_stride, packed, bias, y, y_stride, m_len, p, n, k_len, k_valid);
}

template <typename T>
void linear(const T* x, int64_t x_stride, const T* packed, const T* bias, T* y, int64_t y_stride, int64_t m, int64_t n,
            int64_t k, int32_t dtype, int32_t num_threads) {
  const int64_t k_len = padded_k(k, dtype), panels = panels_of(n);
  const int threads = threads_for(m * n * k, num_threads);
  // One or two rows stream the weights: 8 panels per tile keep 8 loads in flight. More rows reuse each panel
  // from L1 across row tiles: 4 panels per tile.
  const int64_t widest = m <= 2 ? 8 : 4;
  // Tasks in a multiple of the threads, of equal panel counts, so no thread waits on another: 36 panels in
  // tasks of 8 gave one thread 24 and the other 12, and the call took the longer one's time.
  int64_t tasks = (panels + widest - 1) / widest;
  tasks = (tasks + threads - 1) / threads * threads;
  const int64_t per_task = (panels + tasks - 1) / tasks;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t first = task * per_task, count = std::min(per_task, panels - first);
    if (count > 0) columns(x, x_stride, packed, bias, y, y_stride, m, first, count, widest, n, k_len, k);
  }
}

template <typename T>
void pack(const T* w, int64_t n, int64_t k, int32_t dtype, T* out) {
  const int64_t k_len = padded_k(k, dtype), panels = panels_of(n);
  const int group = dtype == BF16 ? 2 : 1;  // k values per 32-bit lane
#pragma omp parallel for schedule(static)
  for (int64_t panel = 0; panel < panels; ++panel) {
    T* dst = out + panel * k_len * kLanes;
    for (int64_t kk = 0; kk < k_len; kk += group) {
      for (int j = 0; j < kLanes; ++j) {
        const int64_t row = panel * kLanes + j;
        for (int g = 0; g < group; ++g) {
          const int64_t col = kk + g;
          dst[(kk / group) * kLanes * group + j * group + g] = row < n && col < k ? w[row * k + col] : T{0};
        }
      }
    }
  }
}

}  // namespace

extern "C" {

int64_t pb_cpu_panel_packed_elements(int64_t n, int64_t k, int32_t dtype) {
  return panels_of(n) * kLanes * padded_k(k, dtype);
}

int32_t pb_cpu_panel_pack(const void* weight, int64_t n, int64_t k, int32_t dtype, void* out) {
  if (n < 1 || k < 1) return BAD_SHAPE;
  if (dtype == F32) {
    pack(static_cast<const float*>(weight), n, k, dtype, static_cast<float*>(out));
  } else if (dtype == BF16) {
    pack(static_cast<const uint16_t*>(weight), n, k, dtype, static_cast<uint16_t*>(out));
  } else {
    return BAD_DTYPE;
  }
  return OK;
}

int32_t pb_cpu_panel_linear(const void* x, int64_t x_stride, const void* packed, const void* bias, void* y,
                            int64_t y_stride, int64_t m, int64_t n, int64_t k, int32_t dtype, int32_t num_threads) {
  if (m < 0 || n < 1 || k < 1) return BAD_SHAPE;
  if (m == 0) return OK;
  if (dtype == F32) {
    linear(static_cast<const float*>(x), x_stride, static_cast<const float*>(packed), static_cast<const float*>(bias),
           static_cast<float*>(y), y_stride, m, n, k, dtype, num_threads);
  } else if (dtype == BF16) {
    linear(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(packed),
           static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), y_stride, m, n, k, dtype, num_threads);
  } else {
    return BAD_DTYPE;
  }
  return OK;
}

const char* pb_cpu_panel_error_string(int32_t status) {
  switch (status) {
    case OK: return "ok";
    case BAD_DTYPE: return "unsupported dtype (panel linear takes float32 or bfloat16)";
    case BAD_SHAPE: return "empty weight (N and K must be at least 1) or a negative row count";
    default: return "unknown status";
  }
}

}  // extern "C"
