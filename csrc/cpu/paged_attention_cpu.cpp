// Fused paged attention for CPUs: varlen causal prefill and decode read straight from the block pool.
//
// One task is (sequence, tile of query tokens) over all heads, so every key and value row loaded from the
// pool serves its whole GQA group. Keys are visited block by block with an online softmax (one rescale per
// block), so nothing is gathered or padded: each task reads its context once, which is what bounds decode.
// With few rows per kv head (decode), keys go sixteen at a time per kv head: sixteen dot products share one
// shuffle tree for their horizontal sums and the softmax runs on whole vectors (decode_blocks). With many rows
// (prefill), scores come from transposed 16-key panels against four rows at a time (panel_blocks). Values are
// accumulated four rows at a time with the accumulators in registers. Math is fp32.
//
// Batch-invariant mode (`invariant`): every task is one query token, so a row's scores, softmax sums and
// value sums run the same code over the same keys in the same order whatever the query length, the chunking or
// the other sequences (tiles share K/V loads, but the score path and the softmax's vector sums depend on the
// tile). The score path then depends only on the GQA group, a constant of the model.
//
// Plain C ABI (no torch headers) so it builds in about a second; paged_backend/ops/cpu.py mirrors it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#include "bf16.h"
#include "vector_exp.h"

extern "C" {

enum PbCpuDtype : int32_t { PB_F32 = 0, PB_F16 = 1, PB_BF16 = 2, PB_FP8_E4M3 = 3, PB_FP8_E5M2 = 4 };

struct PbCpuAttentionArgs {
  const void* query;  // [T, Hq, D]
  int64_t q_stride_token, q_stride_head;
  const void* key_cache;  // [N, block_size, Hkv, D]
  const void* value_cache;
  int64_t k_stride_block, k_stride_slot, k_stride_head;
  int64_t v_stride_block, v_stride_slot, v_stride_head;
  const int32_t* block_tables;  // [B, table_stride]
  int64_t table_stride;
  const int32_t* seq_lens;         // [B]
  const int32_t* query_start_loc;  // [B + 1]
  void* out;                       // [T, Hq, D], dtype of the query
  int64_t o_stride_token, o_stride_head;
  int32_t num_seqs, num_q_heads, num_kv_heads, head_dim, block_size;
  int32_t q_dtype, kv_dtype;  // PbCpuDtype (the query and output share one)
  int32_t sliding_window;     // 0: off
  int32_t num_threads;
  int32_t invariant;  // 1: batch-invariant rows (one query token per task)
  float scale, softcap, k_scale, v_scale;  // softcap 0: off
};

uint64_t pb_cpu_attention_args_size() { return sizeof(PbCpuAttentionArgs); }

const char* pb_cpu_error_string(int code) {
  switch (code) {
    case 0: return "ok";
    case -1: return "unsupported dtype code (query: f32/f16/bf16; cache: f32/f16/bf16/fp8 e4m3/e5m2)";
    case -2: return "num_q_heads must be a positive multiple of num_kv_heads, head_dim and block_size positive";
    default: return "unknown error";
  }
}

}  // extern "C"

namespace {

constexpr int kMaxRowsPerTask = 128;  // query rows (tokens x q heads) sharing one pass over the context
constexpr int kPanel = 16;            // keys per transposed panel in the many-rows score path
constexpr int kPanelMinRows = 8;      // rows per kv head from which the panel path beats the decode path
constexpr int kAheadGroups = 2;       // decode asks for the K/V this many groups of sixteen keys ahead
constexpr int kAheadLines = 2;        // cache lines of K and of V asked for per step of the decode loops

float fp8_e4m3_to_float(uint8_t bits) {
  const int sign = bits >> 7, exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
  float magnitude;
  if (exponent == 0xF && mantissa == 0x7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(mantissa / 8.0f, -6);
  } else {
    magnitude = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  }
  return sign ? -magnitude : magnitude;
}

// e5m2 is the top byte of an fp16 number
inline float fp8_e5m2_to_float(uint8_t bits) {
  const uint16_t half_bits = static_cast<uint16_t>(bits) << 8;
  _Float16 half;
  std::memcpy(&half, &half_bits, sizeof(half));
  return static_cast<float>(half);
}

struct Fp8Tables {  // every byte of both fp8 formats, decoded once
  float e4m3[256], e5m2[256];
  Fp8Tables() {
    for (int i = 0; i < 256; ++i) {
      e4m3[i] = fp8_e4m3_to_float(static_cast<uint8_t>(i));
      e5m2[i] = fp8_e5m2_to_float(static_cast<uint8_t>(i));
    }
  }
};
const Fp8Tables kFp8;

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
    default: {
      auto* bytes = static_cast<const uint8_t*>(src);
      const float* table = code == PB_FP8_E4M3 ? kFp8.e4m3 : kFp8.e5m2;
      for (int i = 0; i < n; ++i) dst[i] = table[bytes[i]];
      return dst;
    }
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

struct Task {
  int32_t seq, first_token, num_tokens;  // a tile of the sequence's query tokens, all heads
};

// Per-thread scratch: query rows, accumulators, running max/sum, one block of scores, converted K/V rows.
struct Scratch {
  int dim;
  std::vector<float> q, acc, max, sum, scores, key, values, panel;
  std::vector<float> probs, correction;  // the decode path's sixteen weights per row, and each row's rescale
  std::vector<int> head_rows;  // row indexes grouped by kv head (see run_task)
  std::vector<const float*> value_rows;  // one block's value rows of one kv head, as fp32
  Scratch(int rows, int dim, int block_size)
      : dim(dim), q(rows * dim), acc(rows * dim), max(rows), sum(rows), scores(rows * block_size), key(rows * dim),
        values(block_size * dim), panel(dim * kPanel), head_rows(rows), value_rows(block_size),
        probs(rows * 16), correction(rows) {}
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

// {sum(a), sum(b), sum(c), sum(d)}: two shuffle-and-add rounds fold the four vectors into one, so four dot
// products share one horizontal sum instead of paying one each.
inline void lane_sums4(v16f a, v16f b, v16f c, v16f d, float* out) {
  typedef int32_t v16i __attribute__((vector_size(64)));
  constexpr v16i lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  constexpr v16i hi = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const v16f ab = __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);  // a's 8 partial sums, then b's
  const v16f cd = __builtin_shuffle(c, d, lo) + __builtin_shuffle(c, d, hi);
  constexpr v16i lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  constexpr v16i hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  float lanes[16];
  store16(lanes, __builtin_shuffle(ab, cd, lo4) + __builtin_shuffle(ab, cd, hi4));  // 4 partials of each
  for (int k = 0; k < 4; ++k) out[k] = (lanes[4 * k] + lanes[4 * k + 2]) + (lanes[4 * k + 1] + lanes[4 * k + 3]);
}

// out[k] = q[k] . key[k] for four (query row, key row) pairs: four independent FMA chains and one shared horizontal
// sum. Decode's score loop (a few rows per kv head) runs on this, over a key slot's heads in memory order.
inline void dot_pairs4(const float* const* q, const float* const* key, int dim, float* out) {
  v16f a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int d = 0;
  for (; d + 16 <= dim; d += 16) {
    a0 += load16(q[0] + d) * load16(key[0] + d);
    a1 += load16(q[1] + d) * load16(key[1] + d);
    a2 += load16(q[2] + d) * load16(key[2] + d);
    a3 += load16(q[3] + d) * load16(key[3] + d);
  }
  lane_sums4(a0, a1, a2, a3, out);
  for (int k = 0; k < 4; ++k)
    for (int e = d; e < dim; ++e) out[k] += q[k][e] * key[k][e];  // head_dim % 16 tail
}

// Raw scores of four query rows against a transposed panel of 16 keys (`panel[d * 16 + j]`): per d, one
// broadcast FMA per row into a 16-wide accumulator, so there is no horizontal sum, and the four independent
// accumulators keep the FMA units busy. This is what makes prefill (many rows per key) fast.
inline void panel_scores4(const float* panel, const float* q0, const float* q1, const float* q2, const float* q3,
                          int dim, float* s0, float* s1, float* s2, float* s3) {
  v16f a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int d = 0; d < dim; ++d) {
    const v16f k = load16(panel + d * kPanel);
    a0 += q0[d] * k;
    a1 += q1[d] * k;
    a2 += q2[d] * k;
    a3 += q3[d] * k;
  }
  store16(s0, a0);
  store16(s1, a1);
  store16(s2, a2);
  store16(s3, a3);
}

// acc[rows[k]] += sum_j p[rows[k]][j] * values[j] for COUNT rows: 16 columns of every accumulator in registers
// while the n value rows stream past, then one store (not a load-FMA-store per value row).
template <int COUNT>
void accumulate_rows(float* acc, const float* scores, const int* rows, const float* const* values, int n, int dim,
                     int bs) {
  int d0 = 0;
  for (; d0 + 16 <= dim; d0 += 16) {
    v16f c[COUNT];
    for (int k = 0; k < COUNT; ++k) c[k] = load16(acc + rows[k] * dim + d0);
    for (int j = 0; j < n; ++j) {
      const v16f v = load16(values[j] + d0);
      for (int k = 0; k < COUNT; ++k) c[k] += scores[rows[k] * bs + j] * v;
    }
    for (int k = 0; k < COUNT; ++k) store16(acc + rows[k] * dim + d0, c[k]);
  }
  for (int k = 0; k < COUNT; ++k) {  // head_dim % 16 tail
    for (int j = 0; j < n; ++j) {
      const float p = scores[rows[k] * bs + j];
      for (int d = d0; d < dim; ++d) acc[rows[k] * dim + d] += p * values[j][d];
    }
  }
}

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

// Scores of every row against keys [t0, t0 + n) of one block, kv head by kv head, through transposed panels.
void panel_block_scores(const PbCpuAttentionArgs& a, Scratch& s, const Tile& tile, int64_t block, int block_start,
                        int t0, int n) {
  const int dim = a.head_dim, bs = a.block_size;
  const size_t kv_elem = element_size(a.kv_dtype);
  const char* k_base = static_cast<const char*>(a.key_cache);
  float out[4][kPanel];
  const int num_rows = tile.tokens * tile.group;
  for (int h = 0; h < a.num_kv_heads; ++h) {
    const int* head_rows = s.head_rows.data() + h * num_rows;
    for (int c = 0; c < n; c += kPanel) {
      const int m = std::min(kPanel, n - c);
      for (int j = 0; j < kPanel; ++j) {  // keys t0 + c + j of head h, transposed; missing columns are zero
        if (j < m) {
          const int64_t offset =
              block * a.k_stride_block + (t0 + c + j - block_start) * a.k_stride_slot + h * a.k_stride_head;
          const float* key = load_row(k_base + offset * kv_elem, a.kv_dtype, dim, s.key.data());
          for (int d = 0; d < dim; ++d) s.panel[d * kPanel + j] = key[d];
        } else {
          for (int d = 0; d < dim; ++d) s.panel[d * kPanel + j] = 0.0f;
        }
      }
      for (int first = 0; first < num_rows; first += 4) {
        const int count = std::min(4, num_rows - first);
        const float* q[4];
        for (int k = 0; k < 4; ++k) q[k] = s.q.data() + head_rows[first + std::min(k, count - 1)] * dim;
        panel_scores4(s.panel.data(), q[0], q[1], q[2], q[3], dim, out[0], out[1], out[2], out[3]);
        for (int k = 0; k < count; ++k) {
          const int r = head_rows[first + k], i = r / tile.heads;
          for (int j = 0; j < m; ++j) {
            s.scores[r * bs + c + j] = tile.sees(i, t0 + c + j) ? capped(a, out[k][j]) : kNegInf;
          }
        }
      }
    }
  }
}

// ---- the decode path: a few query rows per kv head (decode, short drafts, batch-invariant rows) ----
//
// Keys go sixteen at a time. Scores come from sixteen accumulators (R rows x 16/R keys) whose lanes are summed by
// one shuffle tree, so sixteen dot products share one horizontal sum and a row's sixteen scores land in one
// vector; the online softmax then runs on that vector, and values are accumulated R rows x 4 chunks at a time
// with the rescale folded into the accumulators' load. K/V elements are widened to fp32 as they are loaded.
// Every row's arithmetic is the same whichever rows share its pass, which batch-invariant mode relies on.

typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

template <int32_t CODE>
struct Kv;  // sixteen cache elements from `p` as fp32
template <>
struct Kv<PB_F32> {
  static constexpr int32_t code = PB_F32;
  static v16f load(const char* p) { return load16(reinterpret_cast<const float*>(p)); }
};
template <>
struct Kv<PB_BF16> {
  static constexpr int32_t code = PB_BF16;
  static v16f load(const char* p) {
    v16h bits;
    std::memcpy(&bits, p, sizeof(bits));
    const v16u words = __builtin_convertvector(bits, v16u) << 16;
    v16f out;
    std::memcpy(&out, &words, sizeof(out));
    return out;
  }
};
template <>
struct Kv<PB_F16> {
  static constexpr int32_t code = PB_F16;
  static v16f load(const char* p) {
    float out[16];
    for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(reinterpret_cast<const _Float16*>(p)[i]);
    return load16(out);
  }
};
template <int32_t CODE>
struct KvFp8 {
  static constexpr int32_t code = CODE;
  static v16f load(const char* p) {
    const float* table = CODE == PB_FP8_E4M3 ? kFp8.e4m3 : kFp8.e5m2;
    float out[16];
    for (int i = 0; i < 16; ++i) out[i] = table[reinterpret_cast<const uint8_t*>(p)[i]];
    return load16(out);
  }
};
template <>
struct Kv<PB_FP8_E4M3> : KvFp8<PB_FP8_E4M3> {};
template <>
struct Kv<PB_FP8_E5M2> : KvFp8<PB_FP8_E5M2> {};

inline float load_scalar(const char* p, int32_t code) {
  float value;
  return *load_row(p, code, 1, &value);
}

// Lane i of the result is the sum of a[i]'s lanes, for sixteen vectors at once: four rounds of pairwise
// shuffle-and-add (halves, quarters, pairs, lanes). Every vector is summed in the same order, whatever its
// place; the inputs go in bit-reversed order so that the lanes come out in natural order.
inline v16f sum_lanes16(const v16f* a) {
  constexpr int order[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  constexpr v16i lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  constexpr v16i hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  constexpr v16i lo2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  constexpr v16i hi2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  constexpr v16i lo3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  constexpr v16i hi3 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  constexpr v16i lo4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  constexpr v16i hi4 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  v16f b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k) {
    const v16f x = a[order[2 * k]], y = a[order[2 * k + 1]];
    b[k] = __builtin_shuffle(x, y, lo1) + __builtin_shuffle(x, y, hi1);
  }
  for (int k = 0; k < 4; ++k) c[k] = __builtin_shuffle(b[2 * k], b[2 * k + 1], lo2) + __builtin_shuffle(b[2 * k], b[2 * k + 1], hi2);
  for (int k = 0; k < 2; ++k) d[k] = __builtin_shuffle(c[2 * k], c[2 * k + 1], lo3) + __builtin_shuffle(c[2 * k], c[2 * k + 1], hi3);
  return __builtin_shuffle(d[0], d[1], lo4) + __builtin_shuffle(d[0], d[1], hi4);
}

// Horizontal sum and max: halves, quarters, pairs, lanes (a fixed order, the same for every row).
template <class Op>
inline float fold16(v16f v, Op op) {
  constexpr v16i half = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  constexpr v16i quarter = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  constexpr v16i pair = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  constexpr v16i lane = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  v = op(v, __builtin_shuffle(v, half));
  v = op(v, __builtin_shuffle(v, quarter));
  v = op(v, __builtin_shuffle(v, pair));
  v = op(v, __builtin_shuffle(v, lane));
  return v[0];
}

inline float hsum(v16f v) { return fold16(v, [](v16f a, v16f b) { return a + b; }); }
inline float hmax(v16f v) { return fold16(v, [](v16f a, v16f b) { return a > b ? a : b; }); }

// e^x lane by lane for x <= 0, exactly 0 below -87 (so -inf gives 0): exp_in_range on a vector, rounding by the
// 1.5 * 2^23 trick (round to nearest even, as nearbyint).
inline v16f exp16_nonpositive(v16f x) {
  const v16i dead = x < -87.0f;
  x = dead ? v16f{} - 87.0f : x;
  const v16f n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const v16f r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v16f p = v16f{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return dead ? v16f{} : p * scale;
}

// `v` as a register value the compiler may not re-read from memory: GCC otherwise folds the same load into
// every FMA that uses it, which doubles the loads of the score loop and makes it load-bound.
inline v16f in_register(v16f v) {
  asm("" : "+v"(v));
  return v;
}

// The next keys' K and V, asked for a line at a time from inside the compute loops, so the loads overlap the math
// without a burst of prefetches filling the miss buffers (which stalled the core as much as the misses did).
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

// Scores of R query rows against KEYS = 16 / R keys, all in one vector: lane r * KEYS + j is q[r] . key[j].
template <int R, class L>
inline v16f dots(const float* const* q, const char* const* key, int dim, size_t elem, Ahead& ahead) {
  constexpr int KEYS = 16 / R;
  v16f acc[16] = {};
  int d = 0;
  for (; d + 16 <= dim; d += 16) {  // each key and query chunk is loaded once, then used by every FMA it feeds
    v16f qv[R];
    ahead.step();
    for (int r = 0; r < R; ++r) qv[r] = in_register(load16(q[r] + d));
    for (int j = 0; j < KEYS; ++j) {
      const v16f k = in_register(L::load(key[j] + d * elem));
      for (int r = 0; r < R; ++r) acc[r * KEYS + j] += qv[r] * k;
    }
  }
  v16f out = sum_lanes16(acc);
  if (d < dim) {  // head_dim % 16 tail
    float lanes[16];
    store16(lanes, out);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < KEYS; ++j)
        for (int e = d; e < dim; ++e) lanes[r * KEYS + j] += q[r][e] * load_scalar(key[j] + e * elem, L::code);
    out = load16(lanes);
  }
  return out;
}

// acc[row] = acc[row] * correction[row] + sum_j p[row][j] * value[j] for R rows over C 16-wide chunks at d0.
template <int R, int C, class L>
inline void accumulate_values(float* const* acc, const float* const* p, const float* correction,
                              const char* const* value, int m, int d0, size_t elem, Ahead& ahead) {
  v16f c[R][C];
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < C; ++x) c[r][x] = load16(acc[r] + d0 + 16 * x) * correction[r];
  for (int j = 0; j < m; ++j) {
    ahead.step();
    v16f v[C];
    for (int x = 0; x < C; ++x) v[x] = L::load(value[j] + (d0 + 16 * x) * elem);
    for (int r = 0; r < R; ++r) {
      const float w = p[r][j];
      for (int x = 0; x < C; ++x) c[r][x] += w * v[x];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < C; ++x) store16(acc[r] + d0 + 16 * x, c[r][x]);
}

// acc[r] = acc[r] * correction[r] + sum_j p[r][j] * value[j] over all of head_dim, for R rows.
template <int R, class L>
void accumulate_head_rows(float* const* acc, const float* const* p, const float* correction,
                          const char* const* value, int m, int dim, size_t elem, Ahead& ahead) {
  int d = 0;
  for (; d + 64 <= dim; d += 64) accumulate_values<R, 4, L>(acc, p, correction, value, m, d, elem, ahead);
  for (; d + 16 <= dim; d += 16) accumulate_values<R, 1, L>(acc, p, correction, value, m, d, elem, ahead);
  for (int r = 0; r < R; ++r) {  // head_dim % 16 tail
    for (int e = d; e < dim; ++e) {
      float x = acc[r][e] * correction[r];
      for (int j = 0; j < m; ++j) x += p[r][j] * load_scalar(value[j] + e * elem, L::code);
      acc[r][e] = x;
    }
  }
}

// Scores of R rows against sixteen keys, into s.probs[row * 16 + j]: R passes of R rows x 16 / R keys.
template <int R, class L>
void score_rows(Scratch& s, const int* rows, const char* const* keys, int dim, size_t elem, Ahead& ahead) {
  constexpr int KEYS = 16 / R;
  const float* q[R];
  for (int r = 0; r < R; ++r) q[r] = s.q.data() + rows[r] * s.dim;
  for (int part = 0; part < R; ++part) {  // keys [part * KEYS, (part + 1) * KEYS)
    float lanes[16];
    store16(lanes, dots<R, L>(q, keys + part * KEYS, dim, elem, ahead));
    for (int r = 0; r < R; ++r)
      std::memcpy(s.probs.data() + rows[r] * 16 + part * KEYS, lanes + r * KEYS, KEYS * sizeof(float));
  }
}

// Scores of `count` rows (their indexes in `rows`) against sixteen keys: four rows at a time, then two, then one.
template <class L>
void decode_scores(Scratch& s, const int* rows, int count, const char* const* keys, int dim, size_t elem,
                   Ahead& ahead) {
  int first = 0;
  for (; first + 4 <= count; first += 4) score_rows<4, L>(s, rows + first, keys, dim, elem, ahead);
  for (; first + 2 <= count; first += 2) score_rows<2, L>(s, rows + first, keys, dim, elem, ahead);
  for (; first < count; ++first) score_rows<1, L>(s, rows + first, keys, dim, elem, ahead);
}

// Keys [lo, hi) sixteen at a time for a tile with a few rows per kv head (decode): per kv head, its rows' scores,
// their online softmax (one rescale per sixteen keys, folded into the value pass), then their values.
template <class L>
void decode_blocks(const PbCpuAttentionArgs& a, Scratch& s, const Tile& tile, const int32_t* table, int lo, int hi) {
  const int dim = a.head_dim, bs = a.block_size, count = tile.tokens * tile.group;
  const size_t elem = element_size(L::code);
  const char* k_base = static_cast<const char*>(a.key_cache);
  const char* v_base = static_cast<const char*>(a.value_cache);
  constexpr v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const char* keys[16];
  const char* values[16];
  float* acc[4];
  const float* probs[4];
  float correction[4];
  for (int block_start = lo - lo % bs; block_start < hi; block_start += bs) {
    const int64_t block = table[block_start / bs];
    const int t0 = std::max(lo, block_start), n = std::min(hi, block_start + bs) - t0;
    for (int c = 0; c < n; c += 16) {
      const int m = std::min(16, n - c), first_key = t0 + c;
      // the keys kAheadGroups groups on, all heads (they sit together in the block), a share per kv head
      const int ahead_key = first_key + 16 * kAheadGroups;
      const int64_t ahead_block = ahead_key < hi ? table[ahead_key / bs] : 0, ahead_slot = ahead_key % bs;
      const int64_t ahead_bytes = ahead_key < hi ? std::min<int64_t>(16, bs - ahead_slot) * a.k_stride_slot * elem : 0;
      const int64_t share = (ahead_bytes / a.num_kv_heads + 63) & ~int64_t{63};
      const char* ahead_k = k_base + (ahead_block * a.k_stride_block + ahead_slot * a.k_stride_slot) * elem;
      const char* ahead_v = v_base + (ahead_block * a.v_stride_block + ahead_slot * a.v_stride_slot) * elem;
      for (int h = 0; h < a.num_kv_heads; ++h) {
        Ahead ahead{ahead_k, ahead_v, h * share, std::min(ahead_bytes, (h + 1) * share)};
        for (int j = 0; j < 16; ++j) {  // keys past m repeat the last one (read, then masked)
          const int64_t slot = first_key + std::min(j, m - 1) - block_start;
          keys[j] = k_base + (block * a.k_stride_block + slot * a.k_stride_slot + h * a.k_stride_head) * elem;
          values[j] = v_base + (block * a.v_stride_block + slot * a.v_stride_slot + h * a.v_stride_head) * elem;
        }
        const int* rows = s.head_rows.data() + h * count;
        decode_scores<L>(s, rows, count, keys, dim, elem, ahead);
        for (int k = 0; k < count; ++k) {  // online softmax of each row over these keys
          const int r = rows[k], pos = tile.first_pos + r / tile.heads;
          float* row_probs = s.probs.data() + r * 16;
          if (a.softcap > 0.0f)
            for (int j = 0; j < 16; ++j) row_probs[j] = capped(a, row_probs[j]);
          const v16i t = first_key + lane;
          const v16i visible = (lane < m) & (t <= pos) & (tile.window <= 0 ? t == t : t > pos - tile.window);
          const v16f scores = visible ? load16(row_probs) : v16f{} + kNegInf;
          const float key_max = hmax(scores);
          if (key_max == kNegInf) {  // the row sees none of these keys: zero weights, nothing else changes
            store16(row_probs, v16f{});
            s.correction[r] = 1.0f;
            continue;
          }
          const float new_max = std::max(s.max[r], key_max);
          // exp(-inf) = 0 on the first visible keys
          const float corr = new_max == s.max[r] ? 1.0f : std::exp(s.max[r] - new_max);
          const v16f p = exp16_nonpositive(scores - new_max);
          s.sum[r] = s.sum[r] * corr + hsum(p);
          s.max[r] = new_max;
          s.correction[r] = corr;
          store16(row_probs, p);
        }
        for (int first = 0; first < count; first += 4) {
          const int r_count = std::min(4, count - first);
          for (int r = 0; r < r_count; ++r) {
            const int row = rows[first + r];
            acc[r] = s.acc.data() + row * dim;
            probs[r] = s.probs.data() + row * 16;
            correction[r] = s.correction[row];
          }
          switch (r_count) {
            case 4: accumulate_head_rows<4, L>(acc, probs, correction, values, m, dim, elem, ahead); break;
            case 3: accumulate_head_rows<3, L>(acc, probs, correction, values, m, dim, elem, ahead); break;
            case 2: accumulate_head_rows<2, L>(acc, probs, correction, values, m, dim, elem, ahead); break;
            default: accumulate_head_rows<1, L>(acc, probs, correction, values, m, dim, elem, ahead); break;
          }
        }
        ahead.finish();
      }
    }
  }
}

// Keys [lo, hi) block by block for a tile with many rows per kv head (prefill): scores through transposed panels,
// then an online softmax with one rescale of each row's accumulator per block, then values four rows at a time.
void panel_blocks(const PbCpuAttentionArgs& a, Scratch& s, const Tile& tile, const int32_t* table, int lo, int hi) {
  const int dim = a.head_dim, bs = a.block_size, rows = tile.tokens * tile.heads, count = tile.tokens * tile.group;
  const size_t kv_elem = element_size(a.kv_dtype);
  const char* v_base = static_cast<const char*>(a.value_cache);
  for (int block_start = lo - lo % bs; block_start < hi; block_start += bs) {
    const int64_t block = table[block_start / bs];
    const int t0 = std::max(lo, block_start), n = std::min(hi, block_start + bs) - t0;
    panel_block_scores(a, s, tile, block, block_start, t0, n);  // -inf where the row may not see the key
    // online softmax: one rescale of each row's accumulator per block, scores become probabilities
    for (int r = 0; r < rows; ++r) {
      float* row_scores = s.scores.data() + r * bs;
      float block_max = kNegInf;
      for (int j = 0; j < n; ++j) block_max = std::max(block_max, row_scores[j]);
      if (block_max == kNegInf) {  // the row sees none of this block: zero weights, nothing else changes
        std::fill(row_scores, row_scores + n, 0.0f);
        continue;
      }
      const float new_max = std::max(s.max[r], block_max);
      const float correction = std::exp(s.max[r] - new_max);  // exp(-inf) = 0 on the first visible block
      if (correction != 1.0f) {
        float* acc = s.acc.data() + r * dim;
        for (int d = 0; d < dim; ++d) acc[d] *= correction;
        s.sum[r] *= correction;
      }
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int j = 0; j < n; ++j) {
        row_scores[j] = exp_nonpositive(row_scores[j] - new_max);
        total += row_scores[j];
      }
      s.sum[r] += total;
      s.max[r] = new_max;
    }
    // accumulate probabilities x values, kv head by kv head, up to four rows at a time
    for (int h = 0; h < a.num_kv_heads; ++h) {
      for (int j = 0; j < n; ++j) {
        const int64_t offset = block * a.v_stride_block + (t0 + j - block_start) * a.v_stride_slot + h * a.v_stride_head;
        s.value_rows[j] = load_row(v_base + offset * kv_elem, a.kv_dtype, dim, s.values.data() + j * dim);
      }
      for (int first = 0; first < count; first += 4) {
        const int* rows_of = s.head_rows.data() + h * count + first;
        const float* const* vals = s.value_rows.data();
        switch (std::min(4, count - first)) {
          case 4: accumulate_rows<4>(s.acc.data(), s.scores.data(), rows_of, vals, n, dim, bs); break;
          case 3: accumulate_rows<3>(s.acc.data(), s.scores.data(), rows_of, vals, n, dim, bs); break;
          case 2: accumulate_rows<2>(s.acc.data(), s.scores.data(), rows_of, vals, n, dim, bs); break;
          default: accumulate_rows<1>(s.acc.data(), s.scores.data(), rows_of, vals, n, dim, bs); break;
        }
      }
    }
  }
}

// Row r of a task is (token r / Hq, q head r % Hq); the rows of kv head h and token i are contiguous:
// i * Hq + h * group + [0, group).
void run_task(const PbCpuAttentionArgs& a, const Task& task, Scratch& s) {
  const int dim = a.head_dim, heads = a.num_q_heads, group = heads / a.num_kv_heads, bs = a.block_size;
  const int tokens = task.num_tokens, rows = tokens * heads;
  const int64_t first_row = a.query_start_loc[task.seq] + task.first_token;
  const int q_len = a.query_start_loc[task.seq + 1] - a.query_start_loc[task.seq];
  const int context = a.seq_lens[task.seq];
  const int first_pos = context - q_len + task.first_token;  // position of the tile's first query token
  const int window = a.sliding_window;
  const Tile tile{first_pos, tokens, heads, group, window};
  // the rows of each kv head, once per task: head_rows[h * tokens * group + i * group + g] = row of (i, g)
  for (int h = 0, n = 0; h < a.num_kv_heads; ++h)
    for (int i = 0; i < tokens; ++i)
      for (int g = 0; g < group; ++g) s.head_rows[n++] = i * heads + h * group + g;
  const size_t q_elem = element_size(a.q_dtype), kv_elem = element_size(a.kv_dtype);
  const float q_scale = a.scale * a.k_scale;

  for (int i = 0; i < tokens; ++i) {
    for (int head = 0; head < heads; ++head) {
      const char* src = static_cast<const char*>(a.query) +
                        ((first_row + i) * a.q_stride_token + head * a.q_stride_head) * q_elem;
      float* q = s.q.data() + (i * heads + head) * dim;
      const float* loaded = load_row(src, a.q_dtype, dim, q);
      for (int d = 0; d < dim; ++d) q[d] = loaded[d] * q_scale;
    }
  }
  std::fill(s.acc.begin(), s.acc.begin() + rows * dim, 0.0f);
  std::fill(s.max.begin(), s.max.begin() + rows, kNegInf);
  std::fill(s.sum.begin(), s.sum.begin() + rows, 0.0f);

  // token i sees keys [first_pos + i - window + 1, first_pos + i]; the tile as a whole sees [lo, hi)
  const int lo = window > 0 ? std::max(0, first_pos - window + 1) : 0;
  const int hi = std::min(context, first_pos + tokens);
  const int32_t* table = a.block_tables + task.seq * a.table_stride;
  if (tokens * group >= kPanelMinRows) {
    panel_blocks(a, s, tile, table, lo, hi);
  } else {
    switch (a.kv_dtype) {
      case PB_F32: decode_blocks<Kv<PB_F32>>(a, s, tile, table, lo, hi); break;
      case PB_F16: decode_blocks<Kv<PB_F16>>(a, s, tile, table, lo, hi); break;
      case PB_BF16: decode_blocks<Kv<PB_BF16>>(a, s, tile, table, lo, hi); break;
      case PB_FP8_E4M3: decode_blocks<Kv<PB_FP8_E4M3>>(a, s, tile, table, lo, hi); break;
      default: decode_blocks<Kv<PB_FP8_E5M2>>(a, s, tile, table, lo, hi); break;
    }
  }

  for (int r = 0; r < rows; ++r) {
    float* acc = s.acc.data() + r * dim;
    const float norm = s.sum[r] > 0.0f ? a.v_scale / s.sum[r] : 0.0f;
    for (int d = 0; d < dim; ++d) acc[d] *= norm;
    const int64_t token = first_row + r / heads;
    char* dst = static_cast<char*>(a.out) + (token * a.o_stride_token + (r % heads) * a.o_stride_head) * q_elem;
    store_row(acc, a.q_dtype, dim, dst);
  }
}

}  // namespace

extern "C" int pb_cpu_paged_attention(const PbCpuAttentionArgs* args) {
  const PbCpuAttentionArgs& a = *args;
  if (a.q_dtype < PB_F32 || a.q_dtype > PB_BF16 || a.kv_dtype < PB_F32 || a.kv_dtype > PB_FP8_E5M2) return -1;
  if (a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads != 0 || a.head_dim <= 0 || a.block_size <= 0) return -2;
  const int tile_tokens = a.invariant ? 1 : std::max(1, kMaxRowsPerTask / a.num_q_heads);

  std::vector<Task> tasks;
  for (int b = 0; b < a.num_seqs; ++b) {
    const int q_len = a.query_start_loc[b + 1] - a.query_start_loc[b];
    for (int first = 0; first < q_len; first += tile_tokens) tasks.push_back({b, first, std::min(tile_tokens, q_len - first)});
  }
  const int threads = std::max(1, std::min<int>(a.num_threads, static_cast<int>(tasks.size())));
  const int rows = tile_tokens * a.num_q_heads;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    Scratch scratch(rows, a.head_dim, a.block_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < static_cast<int64_t>(tasks.size()); ++i) run_task(a, tasks[i], scratch);
  }
  return 0;
}
