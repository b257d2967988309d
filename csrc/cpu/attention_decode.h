// The CPU attention kernel's decode path: named for decode, it runs every tile under panel_min_rows rows per kv head
// (attention_cpu.h): all of them over fp32 caches and bf16 ones on AMX tiles, prefill included. Included by
// paged_attention_cpu.cpp.
#pragma once

#include <optional>

#include "attention_cpu.h"
#include "attention_tiles.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

// ---- the decode path: a few query rows per kv head (decode, short drafts, batch-invariant rows) ----
//
// Keys go sixteen at a time. Scores come from sixteen accumulators (R rows x 16/R keys) whose lanes are summed by
// one shuffle tree, so sixteen dot products share one horizontal sum and a row's sixteen scores land in one
// vector; the online softmax then runs on that vector, and values are accumulated R rows x 4 chunks at a time
// with the rescale folded into the accumulators' load. K/V elements are widened to fp32 as they are loaded, except
// bf16 K/V under a bf16 query: AVX512-BF16's pair dot products take them raw (the weights rounded to bf16 for V).
// Every row's arithmetic is the same whichever rows share its pass, which batch-invariant mode relies on.
// A bf16 query over a bf16 or fp8 cache runs on AMX tiles instead where the CPU has them (attention_tiles.h).

typedef int32_t v16i __attribute__((vector_size(64)));

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
  static v16f load(const char* p) { return bf16x16_to_float(reinterpret_cast<const uint16_t*>(p)); }
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
// bf16 keys against a bf16 query, scored with AVX512-BF16's pair dot product (`vdpbf16ps`: two exact bf16
// products added into each fp32 lane), on the raw query (its scale goes on the scores), so K is not widened.
struct Bf16Pairs : Kv<PB_BF16> {};
template <class L>
constexpr bool kPairs = false;
template <>
constexpr bool kPairs<Bf16Pairs> = true;

template <int32_t CODE>
struct KvFp8 {
  static constexpr int32_t code = CODE;
  static v16f load(const char* p) { return fp8x16_to_float<CODE>(reinterpret_cast<const uint8_t*>(p)); }
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
  const v16f p = exp_mantissa(x, n);
  const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return dead ? v16f{} : p * scale;
}

// `v` as a register value the compiler may not re-read from memory: GCC otherwise folds the same load into
// every FMA that uses it, which doubles the loads of the score loop and makes it load-bound. Only where a
// 16-float vector is one register (AVX-512); elsewhere it is a no-op, as the asm would not compile.
template <class V>
inline V in_register(V v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#endif
  return v;
}

// `scores` (lane r * 16/R + j: row r, key j) plus the elements [d, dim) the vector loop left over, product by
// product as `term(r, j, e)` gives them.
template <int R, class Term>
inline v16f with_tail(v16f scores, int d, int dim, Term term) {
  if (d >= dim) return scores;
  constexpr int KEYS = 16 / R;
  float lanes[16];
  store16(lanes, scores);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < KEYS; ++j)
      for (int e = d; e < dim; ++e) lanes[r * KEYS + j] += term(r, j, e);
  return load16(lanes);
}

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
  return with_tail<R>(sum_lanes16(acc), d, dim,  // head_dim % 16
                      [&](int r, int j, int e) { return q[r][e] * load_scalar(key[j] + e * elem, L::code); });
}

#if defined(__AVX512BF16__)
// dots() for Bf16Pairs: the raw bf16 query rows against bf16 keys, 32 elements per instruction.
template <int R>
inline v16f dots_bf16(const uint16_t* const* q, const char* const* key, int dim, Ahead& ahead) {
  constexpr int KEYS = 16 / R;
  v16f acc[16] = {};
  int d = 0;
  for (; d + 32 <= dim; d += 32) {
    ahead.step();
    __m512bh qv[R];
    for (int r = 0; r < R; ++r) qv[r] = in_register((__m512bh)_mm512_loadu_si512(q[r] + d));
    for (int j = 0; j < KEYS; ++j) {
      const __m512bh k = in_register((__m512bh)_mm512_loadu_si512(key[j] + 2 * d));
      for (int r = 0; r < R; ++r) acc[r * KEYS + j] = (v16f)_mm512_dpbf16_ps((__m512)acc[r * KEYS + j], qv[r], k);
    }
  }
  return with_tail<R>(sum_lanes16(acc), d, dim, [&](int r, int j, int e) {  // head_dim % 32
    return bf16_to_float(q[r][e]) * bf16_to_float(reinterpret_cast<const uint16_t*>(key[j])[e]);
  });
}
#endif

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

// The head_dim % 16 elements [d, dim) the vector loops leave, one product at a time, for R rows.
template <int R>
void accumulate_tail(float* const* acc, const float* const* p, const float* correction, const char* const* value,
                     int m, int d, int dim, size_t elem, int32_t code) {
  for (int r = 0; r < R; ++r) {
    for (int e = d; e < dim; ++e) {
      float x = acc[r][e] * correction[r];
      for (int j = 0; j < m; ++j) x += p[r][j] * load_scalar(value[j] + e * elem, code);
      acc[r][e] = x;
    }
  }
}

// acc[r] = acc[r] * correction[r] + sum_j p[r][j] * value[j] over all of head_dim, for R rows.
template <int R, class L>
void accumulate_head_rows(float* const* acc, const float* const* p, const float* correction,
                          const char* const* value, int m, int dim, size_t elem, Ahead& ahead) {
  int d = 0;
  for (; d + 64 <= dim; d += 64) accumulate_values<R, 4, L>(acc, p, correction, value, m, d, elem, ahead);
  for (; d + 16 <= dim; d += 16) accumulate_values<R, 1, L>(acc, p, correction, value, m, d, elem, ahead);
  accumulate_tail<R>(acc, p, correction, value, m, d, dim, elem, L::code);
}

#if defined(__AVX512BF16__)
// accumulate_values() for bf16 values with the weights rounded to bf16, as torch's CPU flash attention rounds them
// for its bf16 value product: two keys per `vdpbf16ps`, so V is not widened. One two-source permute interleaves
// two value rows element by element (row 2k in the even halves, 2k + 1 in the odd), for sixteen elements;
// `pairs[r][k]` holds row r's weights of keys 2k and 2k + 1 in the same order.
template <int R, int C>
inline void accumulate_value_pairs(float* const* acc, const uint32_t (*pairs)[8], const float* correction,
                                   const char* const* value, int m, int d0, Ahead& ahead) {
  static const __m512i kEven = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                                38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  static const __m512i kOdd = _mm512_add_epi16(kEven, _mm512_set1_epi16(16));
  constexpr __mmask32 kLoad = C == 1 ? 0xFFFF : 0xFFFFFFFF;  // one chunk reads sixteen elements, not past the row
  v16f c[R][C];
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < C; ++x) c[r][x] = load16(acc[r] + d0 + 16 * x) * correction[r];
  for (int k = 0; 2 * k < m; ++k) {  // key 2k + 1 past m has weight 0 and repeats the last key's row
    ahead.step();
    const uint16_t* even = reinterpret_cast<const uint16_t*>(value[2 * k]) + d0;
    const uint16_t* odd = reinterpret_cast<const uint16_t*>(value[2 * k + 1]) + d0;
    __m512bh v[C];
    for (int x = 0; x < C; x += 2) {
      const __m512i a = _mm512_maskz_loadu_epi16(kLoad, even + 16 * x);
      const __m512i b = _mm512_maskz_loadu_epi16(kLoad, odd + 16 * x);
      v[x] = (__m512bh)_mm512_permutex2var_epi16(a, kEven, b);
      if (x + 1 < C) v[x + 1] = (__m512bh)_mm512_permutex2var_epi16(a, kOdd, b);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r][k]));
      for (int x = 0; x < C; ++x) c[r][x] = (v16f)_mm512_dpbf16_ps((__m512)c[r][x], w, v[x]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < C; ++x) store16(acc[r] + d0 + 16 * x, c[r][x]);
}

// accumulate_head_rows() for bf16 values: the weights rounded to bf16 pairs once, then accumulate_value_pairs.
template <int R>
void accumulate_head_pairs(float* const* acc, const float* const* p, const float* correction,
                           const char* const* value, int m, int dim, Ahead& ahead) {
  alignas(64) uint32_t pairs[R][8];
  for (int r = 0; r < R; ++r)
    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[r]), (__m256i)_mm512_cvtneps_pbh((__m512)load16(p[r])));
  int d = 0;
  for (; d + 64 <= dim; d += 64) accumulate_value_pairs<R, 4>(acc, pairs, correction, value, m, d, ahead);
  for (; d + 16 <= dim; d += 16) accumulate_value_pairs<R, 1>(acc, pairs, correction, value, m, d, ahead);
  if (d == dim) return;
  float rounded[R][16];  // the tail takes the same rounded weights
  const float* weights[R];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 16; ++j) rounded[r][j] = bf16_to_float(reinterpret_cast<const uint16_t*>(pairs[r])[j]);
    weights[r] = rounded[r];
  }
  accumulate_tail<R>(acc, weights, correction, value, m, d, dim, 2, PB_BF16);
}
#endif

// Scores of R rows against sixteen keys, into s.probs[row * 16 + j]: R passes of R rows x 16 / R keys.
template <int R, class L>
void score_rows(Scratch& s, const int* rows, const char* const* keys, int dim, size_t elem, Ahead& ahead) {
  constexpr int KEYS = 16 / R;
  const float* q[R];
  [[maybe_unused]] const uint16_t* q16[R];
  for (int r = 0; r < R; ++r) {
    q[r] = s.q.data() + rows[r] * s.dim;
    q16[r] = s.q16.data() + rows[r] * s.dim;
  }
  for (int part = 0; part < R; ++part) {  // keys [part * KEYS, (part + 1) * KEYS)
    float lanes[16];
#if defined(__AVX512BF16__)
    if constexpr (kPairs<L>) {
      store16(lanes, dots_bf16<R>(q16, keys + part * KEYS, dim, ahead));
    } else
#endif
    {
      store16(lanes, dots<R, L>(q, keys + part * KEYS, dim, elem, ahead));
    }
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
#if defined(PB_AMX)
  std::optional<TileDecode> tiles;  // bf16 on AMX tiles (attention_tiles.h)
  if constexpr (kPairs<L> || is_fp8(L::code))
    if (tiles_take(a)) tiles.emplace(s, L::code, a.num_kv_heads, count, dim);  // run_task chose the path by it
  const int64_t key_stride = a.k_stride_slot * static_cast<int64_t>(elem);
  const int64_t value_stride = a.v_stride_slot * static_cast<int64_t>(elem);
  const bool raw_scores = kPairs<L> || tiles;  // scored from the raw bf16 query: its scale goes on the scores
#else
  constexpr bool raw_scores = kPairs<L>;
#endif
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
#if defined(PB_AMX)
        TileDecode::Rows at{};
        if (tiles) {
          at = tiles->staged({keys[0], values[0], key_stride, value_stride}, m);
          tiles->score(h, rows, at, ahead);
        } else
#endif
          decode_scores<L>(s, rows, count, keys, dim, elem, ahead);
        for (int k = 0; k < count; ++k) {  // online softmax of each row over these keys
          const int r = rows[k], pos = tile.first_pos + r / tile.heads;
          float* row_probs = s.probs.data() + r * 16;
          if (raw_scores) store16(row_probs, load16(row_probs) * (a.scale * a.k_scale));
          if (a.softcap > 0.0f)
            for (int j = 0; j < 16; ++j) row_probs[j] = capped(a, row_probs[j]);
          const v16i t = first_key + lane;
          const v16i visible = (lane < m) & (t <= pos) & (tile.window <= 0 ? lane >= 0 : t > pos - tile.window);
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
#if defined(PB_AMX)
        if (tiles) {
          tiles->accumulate(h, rows, at, ahead);
          ahead.finish();
          continue;
        }
#endif
        for (int first = 0; first < count; first += 4) {
          const int r_count = std::min(4, count - first);
          for (int r = 0; r < r_count; ++r) {
            const int row = rows[first + r];
            acc[r] = s.acc.data() + row * dim;
            probs[r] = s.probs.data() + row * 16;
            correction[r] = s.correction[row];
          }
#if defined(__AVX512BF16__)
          if constexpr (kPairs<L>) {
            switch (r_count) {
              case 4: accumulate_head_pairs<4>(acc, probs, correction, values, m, dim, ahead); break;
              case 3: accumulate_head_pairs<3>(acc, probs, correction, values, m, dim, ahead); break;
              case 2: accumulate_head_pairs<2>(acc, probs, correction, values, m, dim, ahead); break;
              default: accumulate_head_pairs<1>(acc, probs, correction, values, m, dim, ahead); break;
            }
            continue;
          }
#endif
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
#if defined(PB_AMX)
  if (tiles) tiles->store_rows();
#endif
}

}  // namespace
