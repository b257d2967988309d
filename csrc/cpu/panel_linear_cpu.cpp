// Linear layers on weights packed once into 16-column panels: y = x @ W^T (+ bias) for x [M, K], W [N, K].
//
// A decode step multiplies one to a few rows by every weight matrix, so it is a stream over the weights: its
// speed is the memory bandwidth the kernel reaches. Packed as panels[N/16][K][16] (bf16: panels[N/16][K/2][16][2],
// the pair layout of AVX512-BF16's dot product), each task reads a few panels front to back, one 64-byte line per
// panel and k, and keeps one vector accumulator per (row, panel): no horizontal sums and no gathers. With 8
// panels per task at one or two rows it reaches the core's streaming bandwidth (~1.6x oneDNN's prepacked
// sgemm at one row, on a 2-core EPYC). More rows go in tiles of up to 8 rows x 3 panels over k in blocks, so each
// block's weight lines come from DRAM once for all the rows (column() says how).
//
// int8 weights (weight-only quantization: q [N, K] int8 with a float32 scale per output, torchao's int8_weight_only,
// or per output and group of K, GGUF's Q8_0, Q6_K and Q5_0; with an offset per group too, GGUF's Q5_1 and Q5_K) pack
// into the same layouts at a byte per weight. A step dequantizes its lines in registers, q * scale (+ offset) in one
// float32 rounding and then the activations' dtype, as torchao's and gguf's dequantization round, and then runs the
// float step: so the output has the bits the float kernel gives on the dequantized weight, from a quarter (fp32) or
// half (bf16) of the bytes. int4 weights (0 to 15, two a byte) always carry a scale and an offset per output and group
// of K: GGUF's Q4_0, Q4_1, Q4_K, Q3_K (q + 4) and Q2_K, and torchao's symmetric int4 (values -8 to 7) as q + 8 with
// offset -8 * scale.
//
// Every output is one fused multiply-add chain over k in order, whatever the row count or the tile it falls in,
// so results do not depend on the batch. On CPUs with AMX (Intel Sapphire Rapids and later), bfloat16 runs on the
// tile unit instead (amx::linear below), at every row count: its sums are the tile unit's own (not rounded after each
// multiply-add), but they too depend on nothing but the row and the weight. Plain C ABI like paged_attention_cpu.cpp;
// paged_backend/ops/panel_linear.py mirrors it and holds the torch oracle (F.linear).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "bf16.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "amx.h"

namespace {

enum Dtype : int32_t { F32 = 0, BF16 = 2 };
enum Status : int32_t { OK = 0, BAD_DTYPE = 1, BAD_SHAPE = 2 };
constexpr int kLanes = 16;  // outputs per panel: one 512-bit vector of floats
// At one or two rows the tile streams its panels from DRAM: it asks for each panel's line this many k steps ahead
// into L2 (prefetches never fault, so running past a panel's end is harmless). The hardware prefetcher alone
// left the stream at ~34 GB/s (bf16) / ~39 (fp32) on 2 cores; with this, ~38 / ~46 (alternating A/B, 2026-11-27).
constexpr int kStreamAhead = 16;
// More rows: tiles of up to kTileRows rows x kTilePanels panels (the register budget: 24 accumulators, 3 weight
// vectors and a broadcast), over k in blocks of kBlockSteps steps (12 KiB of weights), kRowChunk rows at a time.
constexpr int kTileRows = 8;
constexpr int kTilePanels = 3;
constexpr int kBlockSteps = 64;
constexpr int64_t kRowChunk = 6 * kTileRows;

typedef uint16_t u16x32 __attribute__((vector_size(64)));  // (f32x16 and u32x16 come with bf16.h)
inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// `value` in every lane: x - (+0) is x for every x, -0 included, so nothing is left to compute and the load unit
// broadcasts it from memory. (`f32x16{} + value` is not that: adding +0 changes -0, so the compiler added in a
// scalar and broadcast a register, two more uops on the FMA ports per row and step; the fp32 tiles ran at ~63% of
// the FMA peak on a Xeon that way.)
inline f32x16 splat(float value) { return value - f32x16{}; }

inline int64_t panels_of(int64_t n) { return (n + kLanes - 1) / kLanes; }
inline int64_t padded_k(int64_t k, int32_t dtype) { return dtype == BF16 ? (k + 1) / 2 * 2 : k; }

typedef int8_t i8x16 __attribute__((vector_size(16)));

// int4 weights: two a byte. Each line of 32 weights (two fp32 steps k and k + 1, or one bf16 pair step) is 16 bytes,
// byte i holding weight i in its low half and weight i + 16 in its high half, as unsigned nibbles (0 to 15). (fp32
// lines of one step, 8 bytes, cost a broadcast and a variable shift per step: 12 -> 8 instructions a step pair.)
struct UInt4 {
  uint8_t byte;
};

template <typename W>
constexpr bool kQuantized = std::is_same_v<W, int8_t> || std::is_same_v<W, UInt4>;

// `elements` weights further along a panel array (a UInt4 element is half a byte; offsets are whole lines).
template <typename W>
inline const W* advance(const W* p, int64_t elements) {
  if constexpr (std::is_same_v<W, UInt4>) {
    return p + elements / 2;
  } else {
    return p + elements;
  }
}

// A quantized tile's scales: [panel][group][parts][16] floats from the tile's first panel, 16 scales and (parts 2)
// then 16 offsets per group; `group_steps` steps per group (one group spanning K, or e.g. 32 weights: 32 steps of
// fp32 rows or 16 bf16 pair steps).
struct GroupScales {
  const float* at;
  int64_t groups, group_steps;
  int64_t parts;  // 1: scales alone (q * scale); 2: scales and offsets
  const float* levels;  // int4: the 16 values a 4-bit q stands for (IQ4's non-uniform levels); null: 0 to 15
};

// The byte distance a streaming tile prefetches ahead is the float weights': int8 lines hold `ratio` times the steps.
template <int AHEAD, typename W, typename T>
constexpr int ahead_steps() {
  const int ratio = static_cast<int>(sizeof(T) / sizeof(W)) * (std::is_same_v<W, UInt4> ? 2 : 1);
  return AHEAD == kStreamAhead ? AHEAD * ratio : AHEAD;
}

inline f32x16 to_float(i8x16 q) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)q));
#else
  return __builtin_convertvector(q, f32x16);
#endif
}

// A group's dequantization for one panel: q * scale + offset, one rounding (a fused multiply-add: it equals torchao's
// (q - 8) * scale rounded once, and GGUF's d * q + m, whose product is exact). Without offsets the offset is -0, and
// q * scale + -0 is q * scale to the bit, its sign of zero included (+0 would turn a -0 product into +0).
struct Dequant {
  f32x16 scale, offset;
};

inline f32x16 affine(f32x16 q, f32x16 scale, f32x16 offset) {
#if defined(__AVX512F__)
  return (f32x16)_mm512_fmadd_ps((__m512)q, (__m512)scale, (__m512)offset);
#else
  f32x16 out;
  for (int i = 0; i < kLanes; ++i) out[i] = __builtin_fmaf(q[i], scale[i], offset[i]);
  return out;
#endif
}

// The 16 values of an int4 weight as floats: `levels` (a format's own, IQ4's), else 0 to 15. Loaded once per tile.
constexpr float kCounting[kLanes] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
inline f32x16 levels_of(const GroupScales& scales) {
  return load16(scales.levels != nullptr ? scales.levels : kCounting);
}

// A line of int4 weights (16 bytes) as their `levels`: the low nibbles, then the high ones. With AVX-512 each byte
// widens to a 32-bit lane and a permute of the levels reads the lane's low four bits: no masks and no int-to-float
// conversion, and a non-uniform table (IQ4's) costs nothing more than 0 to 15.
inline void int4_values(const uint8_t* bytes, f32x16 levels, f32x16 (&out)[2]) {
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  out[0] = (f32x16)_mm512_permutexvar_ps(wide, (__m512)levels);
  out[1] = (f32x16)_mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), (__m512)levels);
#else
  for (int i = 0; i < 16; ++i) {
    out[0][i] = levels[bytes[i] & 15];
    out[1][i] = levels[bytes[i] >> 4];
  }
#endif
}

// Steps an fp32 tile takes at once: int4 lines hold two.
template <typename W>
constexpr int kF32Steps = std::is_same_v<W, UInt4> ? 2 : 1;

// kF32Steps<W> fp32 steps of a panel from step `line`: 16 floats, or 16 int8 / int4 weights dequantized, per step.
template <typename W>
inline void weights_f32(const W* line, const Dequant& group, f32x16 levels, f32x16 (&out)[kF32Steps<W>]) {
  if constexpr (std::is_same_v<W, UInt4>) {
    f32x16 q[2];
    int4_values(reinterpret_cast<const uint8_t*>(line), levels, q);
    out[0] = affine(q[0], group.scale, group.offset), out[1] = affine(q[1], group.scale, group.offset);
  } else if constexpr (std::is_same_v<W, int8_t>) {
    i8x16 q;
    std::memcpy(&q, line, sizeof(q));
    out[0] = affine(to_float(q), group.scale, group.offset);
  } else {
    (void)group, (void)levels;
    out[0] = load16(line);
  }
}

// A panel group's scale and offset, as the tile reads them from [panel][group][parts][16] (no offsets: -0).
inline Dequant group_of(const GroupScales& scales, int p, int64_t group) {
  const float* at = scales.at + (p * scales.groups + group) * scales.parts * kLanes;
  return {load16(at), scales.parts == 2 ? load16(at + kLanes) : -f32x16{}};
}

// A panel's bf16 dequantization in the pair layout: `low` for lanes 0-7 ([s0, s0, s1, s1, ..., s7, s7]), `high` for
// 8-15, for the scales and the offsets.
struct PairDequant {
  Dequant low, high;
};

inline PairDequant pair_dequant(const Dequant& group) {
  PairDequant out;
#if defined(__AVX512F__)
  // Four permutes: as a scalar loop this ran once per group and panel, ~4 instructions per int4 pair step.
  const __m512i low = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
  out.low.scale = (f32x16)_mm512_permutexvar_ps(low, (__m512)group.scale);
  out.high.scale = (f32x16)_mm512_permutexvar_ps(high, (__m512)group.scale);
  out.low.offset = (f32x16)_mm512_permutexvar_ps(low, (__m512)group.offset);
  out.high.offset = (f32x16)_mm512_permutexvar_ps(high, (__m512)group.offset);
  return out;
#endif
  for (int i = 0; i < 16; ++i) {
    out.low.scale[i] = group.scale[i / 2];
    out.high.scale[i] = group.scale[8 + i / 2];
    out.low.offset[i] = group.offset[i / 2];
    out.high.offset[i] = group.offset[8 + i / 2];
  }
  return out;
}

// One bf16 pair step of a panel: 32 bf16 as (k, k+1) pairs per lane, or 32 int8 / int4 weights in the same pairs
// dequantized and rounded to bf16 (torchao's dequantize to the model's dtype; weights are finite: no NaN case). The
// pair layout's first 16 weights are lanes 0-7, the order AVX512-BF16's two-source conversion fills: no shuffle.
template <typename W>
inline u16x32 weights_bf16(const W* line, const PairDequant& group, f32x16 levels) {
  u16x32 w;
  if constexpr (kQuantized<W>) {
    f32x16 low, high;
    if constexpr (std::is_same_v<W, UInt4>) {
      f32x16 q[2];
      int4_values(reinterpret_cast<const uint8_t*>(line), levels, q);
      low = affine(q[0], group.low.scale, group.low.offset), high = affine(q[1], group.high.scale, group.high.offset);
    } else {
      i8x16 q[2];
      std::memcpy(q, line, sizeof(q));
      low = affine(to_float(q[0]), group.low.scale, group.low.offset);
      high = affine(to_float(q[1]), group.high.scale, group.high.offset);
    }
#if defined(__AVX512BF16__)
    w = (u16x32)_mm512_cvtne2ps_pbh((__m512)high, (__m512)low);
#else
    uint16_t rounded[32];
    float_to_bf16x16(low, rounded);
    float_to_bf16x16(high, rounded + 16);
    std::memcpy(&w, rounded, sizeof(w));
#endif
  } else {
    (void)group, (void)levels;
    std::memcpy(&w, line, sizeof(w));
  }
  return w;
}

// Asks for step `step` of each of the tile's NP panels into L2 (`steps` per panel, `width` elements per step).
// Prefetches never fault, so running past a panel's end is harmless. (Wrapping into the next tile's panels there
// gained nothing measurable.)
template <int NP, typename T>
inline void prefetch_ahead(const T* panels, int64_t steps, int64_t step, int64_t width) {
  for (int p = 0; p < NP; ++p) __builtin_prefetch(advance(panels, (p * steps + step) * width), 0, 1);
}

// Steps [k0, k1) of the float32 tile: acc[m][p] += x[m][k] * panel_p[k]. A step is one 64-byte line per panel
// (quantized: a quarter or an eighth of one). Quantized weights go group by group, the group's scales loaded once
// and its steps a plain loop (a per-step check for the next group cost int4 ~1.7x at one row).
template <int MT, int NP, int AHEAD, typename W>
inline void tile_f32(const float* x, int64_t x_stride, const W* panels, int64_t k_len, int64_t k0, int64_t k1,
                     const GroupScales& scales, f32x16 (&acc)[MT][NP]) {
  Dequant dequant[NP] = {};
  const f32x16 levels = std::is_same_v<W, UInt4> ? levels_of(scales) : f32x16{};
  for (int64_t start = k0, end; start < k1; start = end) {
    end = k1;
    if constexpr (kQuantized<W>) {
      const int64_t group = start / scales.group_steps;
      end = std::min(k1, (group + 1) * scales.group_steps);
      for (int p = 0; p < NP; ++p) dequant[p] = group_of(scales, p, group);
    }
    constexpr int kSteps = kF32Steps<W>;  // (int4: groups, blocks and K are even, so pairs never straddle them)
    for (int64_t k = start; k < end; k += kSteps) {
      if constexpr (AHEAD > 0) prefetch_ahead<NP>(panels, k_len, k + ahead_steps<AHEAD, W, float>(), kLanes);
      f32x16 w[NP][kSteps];
      for (int p = 0; p < NP; ++p) weights_f32(advance(panels, (p * k_len + k) * kLanes), dequant[p], levels, w[p]);
      for (int step = 0; step < kSteps; ++step) {
        for (int m = 0; m < MT; ++m) {
          const f32x16 xb = splat(x[m * x_stride + k + step]);
          for (int p = 0; p < NP; ++p) acc[m][p] += xb * w[p][step];
        }
      }
    }
  }
}

// Pairs [k0, k1) of the bfloat16 tile: acc[m][p] += x[m][k] * w[k] + x[m][k+1] * w[k+1], AVX512-BF16's dot
// product where the CPU has it, else the same products in float32 (the pair layout is the same).
template <int MT, int NP, int AHEAD, typename W>
inline void tile_bf16(const uint16_t* x, int64_t x_stride, const W* panels, int64_t k_len, int64_t k0, int64_t k1,
                      int64_t k_valid, const GroupScales& scales, f32x16 (&acc)[MT][NP]) {
  const int64_t pairs = k_len / 2;
  PairDequant dequant[NP];
  const f32x16 levels = std::is_same_v<W, UInt4> ? levels_of(scales) : f32x16{};
  for (int64_t start = k0, end; start < k1; start = end) {
    end = k1;
    if constexpr (kQuantized<W>) {
      const int64_t group = start / scales.group_steps;
      end = std::min(k1, (group + 1) * scales.group_steps);
      for (int p = 0; p < NP; ++p) dequant[p] = pair_dequant(group_of(scales, p, group));
    }
    for (int64_t kp = start; kp < end; ++kp) {
      if constexpr (AHEAD > 0) prefetch_ahead<NP>(panels, pairs, kp + ahead_steps<AHEAD, W, uint16_t>(), 2 * kLanes);
      u16x32 w[NP];
      for (int p = 0; p < NP; ++p) {
        w[p] = weights_bf16(advance(panels, (p * pairs + kp) * 2 * kLanes), dequant[p], levels);
      }
      const bool whole = 2 * kp + 1 < k_valid;  // both halves of the pair are real (an odd K ends in half a pair)
      for (int m = 0; m < MT; ++m) {
        const uint16_t* row = x + m * x_stride;
        uint32_t pair = row[2 * kp];
        if (whole) std::memcpy(&pair, row + 2 * kp, sizeof(pair));  // x[k] low, x[k+1] high: one 32-bit load
#if defined(__AVX512BF16__)
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
        for (int p = 0; p < NP; ++p) acc[m][p] = (f32x16)_mm512_dpbf16_ps((__m512)acc[m][p], xb, (__m512bh)w[p]);
#else
        const f32x16 b0 = splat(bf16_to_float(static_cast<uint16_t>(pair))),
                     b1 = splat(bf16_to_float(static_cast<uint16_t>(pair >> 16)));
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
}

// One row's NP panels of outputs from their float32 sums: bias added in float32, rounded once to the dtype (as
// float_to_bf16 rounds, lane by lane). Whole panels go as vectors: lane by lane, the rounding cost a fifth of the
// arithmetic at 16 rows and K = 576.
template <typename T, int NP>
inline void store_row(const float* sums, const T* bias, T* out, int64_t n0, int64_t n) {
  for (int p = 0; p < NP; ++p) {
    const int64_t col0 = n0 + p * kLanes;
    if (col0 + kLanes <= n) {
      f32x16 v = load16(sums + p * kLanes);
      if constexpr (sizeof(T) == 4) {
        if (bias != nullptr) v += load16(bias + col0);
        std::memcpy(out + col0, &v, sizeof(v));
      } else {
        if (bias != nullptr) v += bf16x16_to_float(bias + col0);
        float_to_bf16x16(v, out + col0);
      }
      continue;
    }
    for (int64_t col = col0; col < n; ++col) {  // the weight's last, partial panel
      float v = sums[p * kLanes + col - col0];
      if constexpr (sizeof(T) == 4) {
        out[col] = bias != nullptr ? v + bias[col] : v;
      } else {
        if (bias != nullptr) v += bf16_to_float(bias[col]);
        out[col] = float_to_bf16(v);
      }
    }
    break;
  }
}

// One row tile over steps [k0, k1) of NP panels, its accumulators carried in `carry` ([MT][NP][16] floats)
// between k blocks (`resume`: this block follows another): every output stays one multiply-add chain over k in
// order, however k is blocked.
template <typename T, typename W, int MT, int NP>
void tile_steps(const T* x, int64_t x_stride, const W* panels, const GroupScales& scales, int64_t k_len,
                int64_t k_valid, int64_t k0, int64_t k1, bool resume, int64_t ahead, float* carry) {
  f32x16 acc[MT][NP];
  for (int m = 0; m < MT; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = resume ? load16(carry + (m * NP + p) * kLanes) : f32x16{};
  // The prefetch distance is a template argument: as a constant it is a displacement on the load's own address.
  // As a variable, one row's tile rebuilt its eight prefetch addresses every step and ran 5-7% slower in fp32.
  const auto run = [&](auto distance) {
    if constexpr (sizeof(T) == 4) {
      tile_f32<MT, NP, decltype(distance)::value>(x, x_stride, panels, k_len, k0, k1, scales, acc);
    } else {
      tile_bf16<MT, NP, decltype(distance)::value>(x, x_stride, panels, k_len, k0, k1, k_valid, scales, acc);
    }
  };
  if (ahead == kStreamAhead) {
    run(std::integral_constant<int, kStreamAhead>{});
  } else if (ahead == kBlockSteps) {
    run(std::integral_constant<int, kBlockSteps>{});
  } else {
    run(std::integral_constant<int, 0>{});
  }
  for (int m = 0; m < MT; ++m)
    for (int p = 0; p < NP; ++p) std::memcpy(carry + (m * NP + p) * kLanes, &acc[m][p], sizeof(acc[m][p]));
}

// `rows` (1 to kTileRows) rows of the tile, dispatched to the template of that height. The 8-panel streaming tile
// only ever has one or two rows (linear() picks it for those), so only those heights are built for it.
template <typename T, typename W, int NP>
void rows_steps(int64_t rows, const T* x, int64_t x_stride, const W* panels, const GroupScales& scales, int64_t k_len,
                int64_t k_valid, int64_t k0, int64_t k1, bool resume, int64_t ahead, float* carry) {
  const auto height = [&](auto mt) {
    tile_steps<T, W, decltype(mt)::value, NP>(x, x_stride, panels, scales, k_len, k_valid, k0, k1, resume, ahead,
                                              carry);
  };
  if constexpr (NP > kTilePanels) {
    if (rows == 2) height(std::integral_constant<int, 2>{});
    if (rows == 1) height(std::integral_constant<int, 1>{});
  } else {
    switch (rows) {
      case 8: height(std::integral_constant<int, 8>{}); break;
      case 7: height(std::integral_constant<int, 7>{}); break;
      case 6: height(std::integral_constant<int, 6>{}); break;
      case 5: height(std::integral_constant<int, 5>{}); break;
      case 4: height(std::integral_constant<int, 4>{}); break;
      case 3: height(std::integral_constant<int, 3>{}); break;
      case 2: height(std::integral_constant<int, 2>{}); break;
      case 1: height(std::integral_constant<int, 1>{}); break;
      default: break;
    }
  }
}

// Steps [k0, k1) of NP quantized panels (`steps` per panel) dequantized into `out`, float panels of that block in the
// activations' layout ([panel][step][16] floats, or [panel][pair][16][2] bf16), each line exactly as the tiles
// dequantize it; asks for the next block's lines as it goes.
template <typename T, typename W, int NP>
void dequantize_block(const W* panels, const GroupScales& scales, int64_t steps, int64_t k0, int64_t k1, T* out) {
  constexpr int64_t width = sizeof(T) == 4 ? kLanes : 2 * kLanes;  // elements per step
  const f32x16 levels = std::is_same_v<W, UInt4> ? levels_of(scales) : f32x16{};
  for (int p = 0; p < NP; ++p) {
    for (int64_t start = k0, end; start < k1; start = end) {
      const int64_t group = start / scales.group_steps;
      end = std::min(k1, (group + 1) * scales.group_steps);
      const Dequant dequant = group_of(scales, p, group);
      [[maybe_unused]] const PairDequant pair = pair_dequant(dequant);
      constexpr int kSteps = sizeof(T) == 4 ? kF32Steps<W> : 1;
      for (int64_t k = start; k < end; k += kSteps) {
        __builtin_prefetch(advance(panels, (p * steps + k + kBlockSteps) * width), 0, 1);
        const W* line = advance(panels, (p * steps + k) * width);
        T* to = out + (p * (k1 - k0) + k - k0) * width;
        if constexpr (sizeof(T) == 4) {
          f32x16 w[kF32Steps<W>];
          weights_f32(line, dequant, levels, w);
          std::memcpy(to, w, sizeof(w));
        } else {
          const u16x32 w = weights_bf16(line, pair, levels);
          std::memcpy(to, &w, sizeof(w));
        }
      }
    }
  }
}

// Rows x[0, m_len) against NP panels starting at panel `first`, kRowChunk rows at a time. k goes in blocks, and
// every row tile of the chunk runs over a block before the next block starts: the block's weight lines come from
// DRAM once, while the first row tile asks for the next block's, and stay in L1 for the other row tiles. Tiled
// over all of k instead, the first row tile waited on DRAM and the others found L2 (16 rows, bf16: 1.13x faster
// this way; now ~350 GFLOP/s on 2 cores from DRAM, ~415 on cached weights, of a measured 468 peak). One or two
// rows take k in one block with the prefetch kStreamAhead steps ahead: they stream. More rows of a quantized weight
// dequantize each block once (dequantize_block) and run the float tiles on it, the same values so the same bits:
// dequantized again by each row tile, int4 at 64 rows ran 8% (fp32) to 23% (bf16) below the float panels' throughput.
template <typename T, typename W, int NP>
void column(const T* x, int64_t x_stride, const W* packed, const GroupScales& scales, const T* bias, T* y,
            int64_t y_stride, int64_t m_len, int64_t first, int64_t n, int64_t k_len, int64_t k_valid) {
  const W* panels = advance(packed, first * k_len * kLanes);
  const int64_t scales_before = first * scales.groups * scales.parts * kLanes;  // the earlier panels' floats
  const float* first_scales = scales.at == nullptr ? nullptr : scales.at + scales_before;
  const GroupScales panel_scales{first_scales, scales.groups, scales.group_steps, scales.parts, scales.levels};
  const int64_t n0 = first * kLanes, steps = sizeof(T) == 4 ? k_len : k_len / 2;
  const int64_t block = m_len <= 2 ? steps : kBlockSteps, ahead = m_len <= 2 ? kStreamAhead : kBlockSteps;
  alignas(64) float carry[kRowChunk * NP * kLanes];
  constexpr bool kOnce = kQuantized<W> && NP <= kTilePanels;  // (the 8-panel tile only ever streams one or two rows)
  constexpr int64_t kWidth = sizeof(T) == 4 ? kLanes : 2 * kLanes;
  alignas(64) T block_weights[kOnce ? NP * kBlockSteps * kWidth : 1];
  for (int64_t chunk = 0; chunk < m_len; chunk += kRowChunk) {
    const int64_t chunk_rows = std::min(kRowChunk, m_len - chunk);
    for (int64_t k0 = 0; k0 < steps; k0 += block) {
      const int64_t k1 = std::min(steps, k0 + block);
      const bool once = kOnce && m_len > 2;
      if constexpr (kOnce) {
        if (once) dequantize_block<T, W, NP>(panels, panel_scales, steps, k0, k1, block_weights);
      }
      const int64_t tiles = (chunk_rows + kTileRows - 1) / kTileRows;  // rows spread evenly: 12 as 6 + 6, not 8 + 4
      for (int64_t i = 0; i < tiles; ++i) {
        const int64_t m = chunk_rows * i / tiles, rows = chunk_rows * (i + 1) / tiles - m;
        const T* row_x = x + (chunk + m) * x_stride;
        float* row_carry = carry + m * NP * kLanes;
        if (once) {  // the block's float panels: steps [0, k1 - k0) of x's elements from the block's first
          const int64_t skip = sizeof(T) == 4 ? k0 : 2 * k0, block_len = sizeof(T) == 4 ? k1 - k0 : 2 * (k1 - k0);
          rows_steps<T, T, NP>(rows, row_x + skip, x_stride, block_weights, GroupScales{}, block_len, k_valid - skip, 0,
                               k1 - k0, k0 != 0, 0, row_carry);
        } else {
          rows_steps<T, W, NP>(rows, row_x, x_stride, panels, panel_scales, k_len, k_valid, k0, k1, k0 != 0,
                               i == 0 ? ahead : 0, row_carry);
        }
      }
    }
    for (int64_t m = 0; m < chunk_rows; ++m)
      store_row<T, NP>(carry + m * NP * kLanes, bias, y + (chunk + m) * y_stride, n0, n);
  }
}

#if defined(PB_AMX)
// bfloat16 on AMX tiles. The panels' pair layout, [panel][K/2][16][2], is the tile unit's B operand as it is: 16 pair
// steps of one panel are a 16 x 64-byte tile, 1 KiB in a row. A tile of up to 16 rows of x (32 values of k each) is
// the A operand, loaded straight from x, and each panel's 16 outputs per row accumulate in a C tile. A group of up to
// four panels shares each A tile: C tiles 0-3, A tile 4, B tiles 5-7 in turn. At one row the tiles stream the panels
// at the memory bandwidth like the 8-panel vector tile (22-24 GB/s against 19-27 on 2 cores of a Xeon with AMX); at
// 16 rows they run 2.2-2.4x, at 64 rows 4-5x the vector tiles (benchmarks/packed_linear.py --model-pass). Taken where
// K is a multiple of 32 (every tile whole); other shapes keep the vector tiles, so a layer's choice never depends on
// the rows. Quantized panels are dequantized once per group of panels and chunk of 128 rows.
namespace amx {

constexpr int kRows = 16;          // rows of x per A tile
constexpr int kStepValues = 32;    // values of k per tile step (16 pairs)
constexpr int kGroup = 4;          // panels per group (C tiles 0 to 3)
constexpr int64_t kRowChunk = 128;  // rows whose A tiles stay in L2 while every panel group passes over them

using pb_amx::TileConfig;

// C and A tiles of `rows` rows; the B tiles are always 16 pair steps.
inline void configure(int rows) {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = static_cast<uint8_t>(t < 5 ? rows : kStepValues / 2);
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

// `rows` rows of x times NP panels (`panel_stride` elements apart) over all of k: sums [rows][NP][16] floats.
template <int NP>
void group(const uint16_t* x, int64_t x_stride, const uint16_t* panels, int64_t panel_stride, int64_t k,
           float* sums) {
  _tile_zero(0);
  if constexpr (NP > 1) _tile_zero(1);
  if constexpr (NP > 2) _tile_zero(2);
  if constexpr (NP > 3) _tile_zero(3);
  for (int64_t k0 = 0; k0 < k; k0 += kStepValues) {
    const uint16_t* b = panels + k0 * kLanes;  // pair step k0 / 2 of the first panel: (k0 / 2) * 32 elements
    _tile_loadd(4, x + k0, x_stride * sizeof(uint16_t));
    // Panel p's B tile (tiles 5, 6, 7 in turn) into C tile p. GCC's tile intrinsics spell the tile number into their
    // assembly, so each is written out.
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NP > 1) {
      _tile_loadd(6, b + panel_stride, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NP > 2) {
      _tile_loadd(7, b + 2 * panel_stride, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NP > 3) {
      _tile_loadd(5, b + 3 * panel_stride, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  constexpr int64_t stride = NP * kLanes * sizeof(float);
  _tile_stored(0, sums, stride);
  if constexpr (NP > 1) _tile_stored(1, sums + kLanes, stride);
  if constexpr (NP > 2) _tile_stored(2, sums + 2 * kLanes, stride);
  if constexpr (NP > 3) _tile_stored(3, sums + 3 * kLanes, stride);
}

// NP panels from panel `first` (float, or quantized and dequantized into `scratch` first, exactly as the vector
// tiles dequantize them: so quantized panels give the float panels' bits here too) for rows [r0, r1) of x.
template <typename W, int NP>
void panels_for_rows(const uint16_t* x, int64_t x_stride, const W* packed, const GroupScales& scales,
                     const uint16_t* bias, uint16_t* y, int64_t y_stride, int64_t r0, int64_t r1, int64_t first,
                     int64_t n, int64_t k, uint16_t* scratch, int& configured) {
  const int64_t panel_stride = k * kLanes;  // elements per panel (K / 2 pair steps of 32)
  const uint16_t* panels;
  if constexpr (kQuantized<W>) {
    const float* at = scales.at + first * scales.groups * scales.parts * kLanes;
    dequantize_block<uint16_t, W, NP>(advance(packed, first * panel_stride), {at, scales.groups, scales.group_steps,
                                      scales.parts, scales.levels}, k / 2, 0, k / 2, scratch);  // fmt: skip
    panels = scratch;
  } else {
    (void)scales, (void)scratch;
    panels = packed + first * panel_stride;
  }
  alignas(64) float sums[kRows * NP * kLanes];
  for (int64_t r = r0; r < r1; r += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, r1 - r));
    if (rows != configured) configure(configured = rows);
    group<NP>(x + r * x_stride, x_stride, panels, panel_stride, k, sums);
    for (int m = 0; m < rows; ++m) store_row<uint16_t, NP>(sums + m * NP * kLanes, bias, y + (r + m) * y_stride,
                                                           first * kLanes, n);  // fmt: skip
  }
}

template <typename W>
void linear(const uint16_t* x, int64_t x_stride, const W* packed, const GroupScales& scales, const uint16_t* bias,
            uint16_t* y, int64_t y_stride, int64_t m, int64_t n, int64_t k, int threads) {
  const int64_t panels = panels_of(n);
#pragma omp parallel num_threads(threads)
  {
    const int64_t share = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = panels * t / share, last = panels * (t + 1) / share;
    std::vector<uint16_t> scratch(kQuantized<W> ? kGroup * k * kLanes : 0);
    int configured = 0;  // the tile rows set on this thread (the configuration is per thread, and per call: other
                         // code, oneDNN's, sets its own in between)
    for (int64_t r0 = 0; r0 < m; r0 += kRowChunk) {
      const int64_t r1 = std::min(m, r0 + kRowChunk);
      for (int64_t p = first; p < last; p += kGroup) {
        const auto run = [&](auto np) {
          panels_for_rows<W, decltype(np)::value>(x, x_stride, packed, scales, bias, y, y_stride, r0, r1, p, n, k,
                                                  scratch.data(), configured);
        };
        switch (std::min<int64_t>(kGroup, last - p)) {
          case 4: run(std::integral_constant<int, 4>{}); break;
          case 3: run(std::integral_constant<int, 3>{}); break;
          case 2: run(std::integral_constant<int, 2>{}); break;
          default: run(std::integral_constant<int, 1>{}); break;
        }
      }
    }
    if (configured) _tile_release();
  }
}

}  // namespace amx
#endif

// Threads only when the work pays for waking them.
inline int threads_for(int64_t multiply_adds, int32_t num_threads) {
  return multiply_adds >= (int64_t{1} << 17) ? num_threads : 1;
}

// `count` panels from `first`, in the widest tiles that fit (`widest`: 8 or kTilePanels).
template <typename T, typename W>
void columns(const T* x, int64_t x_stride, const W* packed, const GroupScales& scales, const T* bias, T* y,
             int64_t y_stride, int64_t m_len, int64_t first, int64_t count, int64_t widest, int64_t n, int64_t k_len,
             int64_t k_valid) {
  int64_t p = first;
  const int64_t end = first + count;
  const auto run = [&](auto np) {
    column<T, W, decltype(np)::value>(x, x_stride, packed, scales, bias, y, y_stride, m_len, p, n, k_len, k_valid);
  };
  if (widest == 8)
    for (; p + 8 <= end; p += 8) run(std::integral_constant<int, 8>{});
  for (; p + kTilePanels <= end; p += kTilePanels) run(std::integral_constant<int, kTilePanels>{});
  for (; p + 2 <= end; p += 2) run(std::integral_constant<int, 2>{});
  for (; p < end; ++p) run(std::integral_constant<int, 1>{});
}

// `scales`: null for float weights, else [panel][group][parts][16] floats for quantized ones (`offsets`: parts 2,
// the offsets after the scales), `group_size` weights along K per group (0: one group spanning K).
template <typename T, typename W>
void linear(const T* x, int64_t x_stride, const W* packed, const float* scales, int64_t group_size, bool offsets,
            const float* levels, const T* bias, T* y, int64_t y_stride, int64_t m, int64_t n, int64_t k, int32_t dtype,
            int32_t num_threads) {
  const int64_t k_len = padded_k(k, dtype), panels = panels_of(n);
  const int64_t steps = dtype == BF16 ? k_len / 2 : k_len, per_step = dtype == BF16 ? 2 : 1;
  const int64_t group_steps = group_size > 0 ? group_size / per_step : steps;
  const GroupScales grouped{scales, group_size > 0 ? k / group_size : 1, group_steps, offsets ? 2 : 1, levels};
  const int threads = threads_for(m * n * k, num_threads);
#if defined(PB_AMX)
  if constexpr (sizeof(T) == 2) {
    if (k % amx::kStepValues == 0 && pb_amx::in_use()) {
      amx::linear(x, x_stride, packed, grouped, bias, y, y_stride, m, n, k, threads);
      return;
    }
  }
#endif
  // One or two rows stream the weights: 8 panels per tile keep 8 loads in flight. More rows reuse each panel
  // from L1 across row tiles: kTilePanels per tile.
  const int64_t widest = m <= 2 ? 8 : kTilePanels;
  // Each thread takes an equal share of the panels (to one panel), in the widest tiles that fit: in tasks of whole
  // tiles, 36 panels gave one thread 20 and the other 16, and the call took the longer one's time.
#pragma omp parallel num_threads(threads)
  {
    const int64_t share = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = panels * t / share, last = panels * (t + 1) / share;
    if (last > first)
      columns(x, x_stride, packed, grouped, bias, y, y_stride, m, first, last - first, widest, n, k_len, k);
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

// int8 weights in the layout of the activations' `dtype` (pairs for bfloat16).
int32_t pb_cpu_panel_pack_int8(const void* weight, int64_t n, int64_t k, int32_t dtype, void* out) {
  if (n < 1 || k < 1) return BAD_SHAPE;
  if (dtype != F32 && dtype != BF16) return BAD_DTYPE;
  pack(static_cast<const int8_t*>(weight), n, k, dtype, static_cast<int8_t*>(out));
  return OK;
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
    linear(static_cast<const float*>(x), x_stride, static_cast<const float*>(packed), nullptr, 0, false,
           nullptr, static_cast<const float*>(bias), static_cast<float*>(y), y_stride, m, n, k, dtype, num_threads);
  } else if (dtype == BF16) {
    linear(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(packed), nullptr, 0, false,
           nullptr, static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), y_stride, m, n, k, dtype,
           num_threads);
  } else {
    return BAD_DTYPE;
  }
  return OK;
}

// Quantized weights packed by pb_cpu_panel_pack_int8 (`bits` 8) or pb_cpu_panel_pack_int4 (`bits` 4) for `dtype`
// activations, `group_size` weights along K per group (0: one group, a scale per output), each q * scale (+ offset):
// `scales` [panel][groups][16] floats, or with `offsets` [panel][groups][2][16], the scales then the offsets. The
// scales are float32, zero past the last output. int4: q is `levels[q]`, 16 floats (null: 0 to 15). x, bias and y
// are in `dtype`.
int32_t pb_cpu_panel_linear_quantized(const void* x, int64_t x_stride, const void* packed, int32_t bits,
                                      const float* scales, int64_t group_size, int32_t offsets, const float* levels,
                                      const void* bias, void* y, int64_t y_stride, int64_t m, int64_t n, int64_t k,
                                      int32_t dtype, int32_t num_threads) {
  if (m < 0 || n < 1 || k < 1 || scales == nullptr || group_size < 0) return BAD_SHAPE;
  if (group_size > 0 && (group_size % 2 != 0 || k % group_size != 0)) return BAD_SHAPE;
  if (bits == 4 && group_size == 0) return BAD_SHAPE;
  if (bits != 4 && bits != 8) return BAD_DTYPE;
  if (m == 0) return OK;
  const auto run = [&](auto weights) {
    if (dtype == F32) {
      linear(static_cast<const float*>(x), x_stride, weights, scales, group_size, offsets != 0, levels,
             static_cast<const float*>(bias), static_cast<float*>(y), y_stride, m, n, k, dtype, num_threads);
    } else {
      linear(static_cast<const uint16_t*>(x), x_stride, weights, scales, group_size, offsets != 0, levels,
             static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), y_stride, m, n, k, dtype, num_threads);
    }
  };
  if (dtype != F32 && dtype != BF16) return BAD_DTYPE;
  if (bits == 8) {
    run(static_cast<const int8_t*>(packed));
  } else {
    run(static_cast<const UInt4*>(packed));
  }
  return OK;
}

// int4 values (uint8 storage, 0 to 15) in the layout of `dtype` activations, two a byte: `out` holds half the
// elements pb_cpu_panel_packed_elements counts.
int32_t pb_cpu_panel_pack_int4(const void* weight, int64_t n, int64_t k, int32_t dtype, void* out) {
  if (n < 1 || k < 1) return BAD_SHAPE;
  if (dtype != F32 && dtype != BF16) return BAD_DTYPE;
  if (dtype == F32 && k % 2 != 0) return BAD_SHAPE;  // fp32 lines hold two steps
  const int64_t elements = pb_cpu_panel_packed_elements(n, k, dtype), line = 2 * kLanes;
  std::vector<uint8_t> spread(elements);
  pack(static_cast<const uint8_t*>(weight), n, k, dtype, spread.data());
  auto* bytes = static_cast<uint8_t*>(out);
  for (int64_t first = 0, b = 0; first < elements; first += line)
    for (int64_t i = 0; i < line / 2; ++i, ++b)
      bytes[b] = static_cast<uint8_t>((spread[first + i] & 15) | ((spread[first + i + line / 2] & 15) << 4));
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
