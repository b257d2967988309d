// What the CPU attention kernel's two paths share: dtype conversion, the per-thread
// scratch, 16-float vectors and the tile of query rows. Included by paged_attention_cpu.cpp only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "bf16.h"
#include "fp8.h"
#include "kernels.h"
#include "vector_exp.h"

namespace {

constexpr int kMaxRowsPerTask = 128;  // query rows (tokens x q heads) sharing one pass over the context
// Key positions per task at most (see pb_cpu_paged_attention): kSplitKeys, or down to kMinSplitKeys when a step
// has fewer than kTasksWanted tiles
constexpr int kSplitKeys = 2048;
constexpr int kMinSplitKeys = 512;
constexpr int kTasksWanted = 8;
constexpr int kPanel = 16;            // keys per transposed panel in the many-rows score path
// Rows per kv head from which a task takes the panel path instead of the decode path (`tiles`: a bf16 query over a
// bf16 or fp8 cache on AMX tiles, attention_tiles.h). fp32 and fp16 caches and the tiles: never (past
// kMaxRowsPerTask). On the Xeon the decode path was faster at every count to 128 (2026-11-29): 1.5-1.8x in fp32,
// 2.5-4x on the tiles, 4-8x over fp16 caches; the panels' last win was against an older decode path (EPYC,
// 2026-11-22). fp8 caches off the tiles: 32, where the two tie; the decode path is 1.1-1.6x faster below it, the
// panels 1.05-1.2x at 128 rows (the decode path widens fp8 K once per four rows, the panels once). bf16 without the
// tiles: 8, because its vector decode path rounds the softmax weights to bf16 once, where the panels keep them fp32:
// prefill weights rounded once put the real model's first bf16 answer token on a tie.
inline int panel_min_rows(int32_t kv_dtype, bool tiles) {
  if (kv_dtype == PB_F32 || kv_dtype == PB_F16 || tiles) return kMaxRowsPerTask + 1;
  return kv_dtype == PB_BF16 ? 8 : 32;
}
constexpr int kAheadGroups = 2;       // decode asks for the K/V this many groups of sixteen keys ahead
constexpr int kAheadLines = 2;        // cache lines of K and of V asked for per step of the decode loops

// `n` elements of dtype `code` at `src` as floats in `dst`; fp32 rows are returned in place.
inline const float* load_row(const void* src, int32_t code, int n, float* dst) {
  switch (code) {
    case PB_F32:
      return static_cast<const float*>(src);
    case PB_F16: {
      auto* half = static_cast<const _Float16*>(src);
      for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(half[i]);
      return dst;
    }
    case PB_BF16: {
      auto* bits = static_cast<const uint16_t*>(src);
      for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(bits[i]);
      return dst;
    }
    case PB_FP8_E4M3:
      fp8_row_to_float<PB_FP8_E4M3>(static_cast<const uint8_t*>(src), n, dst);
      return dst;
    default:
      fp8_row_to_float<PB_FP8_E5M2>(static_cast<const uint8_t*>(src), n, dst);
      return dst;
  }
}

inline void store_row(const float* src, int32_t code, int n, void* dst) {
  switch (code) {
    case PB_F32:
      std::memcpy(dst, src, n * sizeof(float));
      break;
    case PB_F16: {
      auto* half = static_cast<_Float16*>(dst);
      for (int i = 0; i < n; ++i) half[i] = static_cast<_Float16>(src[i]);
      break;
    }
    default: {
      auto* bits = static_cast<uint16_t*>(dst);
      for (int i = 0; i < n; ++i) bits[i] = float_to_bf16(src[i]);
      break;
    }
  }
}

// e^x for x <= 0 (a score minus the running max), exactly 0 below -87 (so -inf, a masked key, gives 0).
inline float exp_nonpositive(float x) { return x < -87.0f ? 0.0f : exp_in_range(std::max(x, -87.0f)); }

inline size_t element_size(int32_t code) { return code == PB_F32 ? 4 : code >= PB_FP8_E4M3 ? 1 : 2; }

// A tile of a sequence's query tokens, all heads, over the key positions [key_lo, key_hi) it sees: a long
// context is cut into parts, so that a few long sequences still fill every core, and the parts' unnormalized sums
// are merged after (`partial` is the part's slot, or -1 for a whole context).
struct Task {
  int32_t seq, first_token, num_tokens;
  int32_t key_lo, key_hi, partial;
};

// Per-thread scratch: query rows, accumulators, running max/sum, one block of scores, converted K/V rows.
struct Scratch {
  int dim;
  std::vector<float> q, acc, max, sum, scores, key, values, panel;
  std::vector<int> head_rows;  // row indexes grouped by kv head (see run_task)
  std::vector<const float*> value_rows;  // one block's value rows of one kv head, as fp32
  std::vector<float> probs, correction;  // the decode path's sixteen weights per row, and each row's rescale
  std::vector<uint16_t> q16;             // a bf16 query's raw rows (the decode path's pair dot products)
  std::vector<uint32_t> q_pairs;         // the AMX decode path's query rows as B tiles (attention_tiles.h)
  std::vector<float> acc_pairs;          // its accumulators, even and odd elements apart
  std::vector<uint16_t> tile_rows;       // its zero-padded copy of a partial group's K and V rows
  Scratch(int rows, int dim, int block_size)
      : dim(dim), q(rows * dim), acc(rows * dim), max(rows), sum(rows), scores(rows * block_size), key(rows * dim),
        values(block_size * dim), panel(dim * kPanel), head_rows(rows), value_rows(block_size),
        probs(rows * 16), correction(rows), q16(rows * dim) {}  // the tiles size their own
};

// 16 floats as one GCC/Clang vector: a zmm register with AVX-512, two ymm without; the hot loops below use it so
// their accumulators stay in registers (arrays under `omp simd` were spilled to the stack).
typedef float v16f __attribute__((vector_size(64)));
static_assert(kPanel == 16, "the panel is one v16f wide");

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float capped(const PbCpuAttentionArgs& a, float score) {
  return a.softcap > 0.0f ? a.softcap * std::tanh(score / a.softcap) : score;
}

// The query rows of one task: tile token i sits at position first_pos + i and sees keys
// (pos - window, pos] (all of [0, pos] without a window).
struct Tile {
  int first_pos, tokens, heads, group, window;
  bool sees(int i, int t) const {
    const int pos = first_pos + i;
    return t <= pos && (window <= 0 || t > pos - window);
  }
};

// The next keys' K and V, asked for a line at a time from inside the compute loops, so the loads overlap the math
// without a burst of prefetches filling the miss buffers (which stalled the core as much as the misses did).
// The bf16 loops step once per iteration, as the fp32 ones do, over twice the elements: so a head's share is spread
// over all of its work in both (bf16 stepping twice asked for everything during the scores, and stalled there).
// Into L2 (hint 1): the rows are read soon after from there.
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t next = 0, end = 0;
  void step() {
    for (int i = 0; i < kAheadLines && next < end; ++i, next += 64) {
      __builtin_prefetch(k + next, 0, 1);
      __builtin_prefetch(v + next, 0, 1);
    }
  }
  void finish() {
    while (next < end) step();
  }
};

}  // namespace
