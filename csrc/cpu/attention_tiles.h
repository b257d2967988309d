// The CPU attention kernel's decode path on AMX tiles, for a bf16 query over a bf16 or fp8 cache (every tile:
// decode, drafts and prefill). Included by attention_decode.h.
//
// On Sapphire Rapids `vdpbf16ps` issues at a quarter of an fp32 FMA's rate, which made the vector decode path
// compute-bound in bf16 (its rate from cache no higher than DRAM streams). The tile unit does both products of a kv
// head's rows against sixteen keys, reading the cache's rows as they lie, so nothing is shuffled:
// - scores, transposed: sixteen keys (A: 16 rows x 32 elements, the slot stride apart) times the rows' query pairs
//   (B: 16 pairs x rows) give a keys x rows C tile, over head_dim / 32 steps;
// - values: each query row's weights go in as A rows holding them in the even elements and zeros in the odd, and the
//   reverse. Against sixteen value rows as B (16 keys x 32 elements: the pair of key k is elements 2n, 2n + 1 of its
//   row) they give that row's even and odd elements in separate C rows, so V needs no pair interleaving. The weights
//   go in twice, as their bf16 high parts and as the bf16 rounding of the rest, so that they count within 2^-17 of
//   their fp32 values: rounded once to bf16 (as the AVX-512 path does), the real model's first answer token in
//   bf16 fell on a tie with another. So four A and C rows per query row. Accumulators live in memory in that layout
//   ([kv head][slice of rows][32-element chunk][row: high/low x even/odd][16]), scaled there by the online
//   softmax's rescale when it is not 1, loaded into C tiles 4-7 per group, and summed and interleaved back into the
//   rows at the end.
// A partial group (fewer than sixteen keys left in the block) is copied into a zero-padded buffer first, so every
// group runs the same code; a row's bits depend only on its keys' positions, as batch-invariant mode needs. An fp8
// cache's groups are all widened into that buffer as bf16, which holds every fp8 number exactly (its scales go on
// the scores and the output, as on the other paths): a prefill tile widens each key once for all its rows, where the
// fp8 panels widened it into fp32 and multiplied there (1.5-1.75x slower on the real model's heads, 2026-11-29).
#pragma once

#include "amx.h"
#include "attention_cpu.h"

#if defined(PB_AMX)

namespace {

class TileDecode {
 public:
  // Any number of rows per kv head: the scores' C tile has 16 columns, so more rows are scored in passes of 16; the
  // values' C tiles hold 4 rows per query row, so more than 4 rows go through them in slices of 4. A last pass or
  // slice is padded with zero queries or weights. The scratch it needs is sized here, on the tasks that use it.
  TileDecode(Scratch& s, int32_t kv_dtype, int kv_heads, int rows_per_head, int dim)
      : s_(s), kv_dtype_(kv_dtype), kv_heads_(kv_heads), count_(rows_per_head), dim_(dim), chunks_(dim / 32),
        columns_(std::min(rows_per_head, 16)), passes_((rows_per_head + 15) / 16),
        slice_rows_(std::min(rows_per_head, 4)), slices_((rows_per_head + 3) / 4) {
    pb_amx::TileConfig config{};
    config.palette = 1;
    // 0: scores C (16 keys x a pass's rows); 1: K as A / V as B (16 x 32 elements); 2: query pairs as B (16 pairs x a
    // pass's rows); 3: weights as A (4 rows per query row of a slice x 16 keys' pairs); 4-7: value C (4 rows per
    // query row of a slice x 16 floats)
    const int slice = 4 * slice_rows_;
    const int rows[8] = {16, 16, 16, slice, slice, slice, slice, slice};
    const int bytes[8] = {4 * columns_, 64, 4 * columns_, 64, 64, 64, 64, 64};
    for (int t = 0; t < 8; ++t) {
      config.rows[t] = static_cast<uint8_t>(rows[t]);
      config.bytes_per_row[t] = static_cast<uint16_t>(bytes[t]);
    }
    _tile_loadconfig(&config);
    // [kv head][pass][step][pair][column]: elements 32 * step + 2 * pair, + 1 of row 16 * pass + column (0 past
    // the last row)
    s.q_pairs.resize(static_cast<size_t>(kv_heads) * passes_ * chunks_ * 16 * columns_);
    s.acc_pairs.assign(static_cast<size_t>(kv_heads) * slices_ * slice_rows_ * 2 * dim, 0.0f);
    s.tile_rows.resize(32 * static_cast<size_t>(dim));
    uint32_t* out = s.q_pairs.data();
    for (int h = 0; h < kv_heads; ++h)
      for (int pass = 0; pass < passes_; ++pass)
        for (int step = 0; step < chunks_; ++step)
          for (int pair = 0; pair < 16; ++pair)
            for (int column = 0, n = 16 * pass; column < columns_; ++column, ++n, ++out)
              if (n < count_)
                std::memcpy(out, s.q16.data() + s.head_rows[h * count_ + n] * dim + 32 * step + 2 * pair, 4);
              else
                *out = 0;
  }

  TileDecode(const TileDecode&) = delete;
  TileDecode& operator=(const TileDecode&) = delete;
  ~TileDecode() { _tile_release(); }

  // The accumulators, even and odd elements interleaved back, into s.acc's rows (after the last group).
  void store_rows() {
    static const __m512i kLow = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    static const __m512i kHigh = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    for (int h = 0; h < kv_heads_; ++h)
      for (int n = 0; n < count_; ++n)
        for (int x = 0; x < chunks_; ++x) {
          const float* split = accumulators(h, n / 4, x) + 4 * (n % 4) * 16;  // high parts' even, odd; low parts'
          const __m512 even = _mm512_add_ps(_mm512_loadu_ps(split), _mm512_loadu_ps(split + 32));
          const __m512 odd = _mm512_add_ps(_mm512_loadu_ps(split + 16), _mm512_loadu_ps(split + 48));
          float* row = s_.acc.data() + s_.head_rows[h * count_ + n] * dim_ + 32 * x;
          _mm512_storeu_ps(row, _mm512_permutex2var_ps(even, kLow, odd));
          _mm512_storeu_ps(row + 16, _mm512_permutex2var_ps(even, kHigh, odd));
        }
  }

  // Sixteen keys and values of kv head h from `key` and `value`, `stride` bytes apart, of which the first `m` are
  // real. Returns where to read them as bf16: in place when all sixteen are real and bf16, else a zero-padded copy,
  // fp8 widened to bf16 in it (exactly: fp8_row_to_bf16).
  struct Rows {
    const char *key, *value;
    int64_t key_stride, value_stride;
  };
  Rows staged(Rows rows, int m) {
    if (m == 16 && kv_dtype_ == PB_BF16) return rows;
    const size_t bytes = dim_ * sizeof(uint16_t);
    char* key = reinterpret_cast<char*>(s_.tile_rows.data());
    char* value = key + 16 * bytes;
    for (int j = 0; j < m; ++j) {
      stage_row(rows.key + j * rows.key_stride, key + j * bytes);
      stage_row(rows.value + j * rows.value_stride, value + j * bytes);
    }
    std::memset(key + m * bytes, 0, (16 - m) * bytes);  // zeros, not an earlier group's rows: 0 * inf would be NaN
    std::memset(value + m * bytes, 0, (16 - m) * bytes);
    return {key, value, static_cast<int64_t>(bytes), static_cast<int64_t>(bytes)};
  }

  // Kv head h's rows (`rows`) against the sixteen keys: raw scores into s.probs[row * 16 + j].
  void score(int h, const int* rows, const Rows& at, Ahead& ahead) {
    const uint32_t* b = s_.q_pairs.data() + static_cast<int64_t>(h) * passes_ * chunks_ * 16 * columns_;
    for (int pass = 0; pass < passes_; ++pass) {
      _tile_zero(0);
      for (int step = 0; step < chunks_; ++step, b += 16 * columns_) {
        if (pass == 0) ahead.step();
        _tile_loadd(1, at.key + 64 * step, at.key_stride);
        _tile_loadd(2, b, 4 * columns_);
        _tile_dpbf16ps(0, 1, 2);
      }
      alignas(64) float c[16 * 16];
      _tile_stored(0, c, 4 * columns_);
      for (int column = 0, n = 16 * pass; column < columns_ && n < count_; ++column, ++n)
        for (int j = 0; j < 16; ++j) s_.probs[rows[n] * 16 + j] = c[j * columns_ + column];
    }
  }

  // acc = acc * correction + weights . values for kv head h's rows, the weights in s.probs and the rescales in
  // s.correction.
  void accumulate(int h, const int* rows, const Rows& at, Ahead& ahead) {
    for (int slice = 0; slice < slices_; ++slice) accumulate_slice(h, slice, rows, at, ahead);
  }

 private:
  void accumulate_slice(int h, int slice, const int* rows, const Rows& at, Ahead& ahead) {
    // A: per query row, its weights' bf16 high parts in the even halves, then in the odd, then their low parts
    // (weight - high, rounded) alike: the two sum to the fp32 weight within 2^-17 of it
    alignas(64) uint32_t weights[16 * 16];
    bool rescale = false;
    for (int i = 0; i < slice_rows_; ++i) {
      const int n = slice * 4 + i;
      __m512i high = _mm512_setzero_si512(), low = high;  // rows past count_ pad the last slice with zero weights
      if (n < count_) {
        const __m512 p = _mm512_loadu_ps(s_.probs.data() + rows[n] * 16);
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(p);
        high = _mm512_cvtepu16_epi32(rounded);
        const __m512 rest = _mm512_sub_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(high, 16)));
        low = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(rest));
        rescale |= s_.correction[rows[n]] != 1.0f;
      }
      _mm512_store_si512(weights + 4 * i * 16, high);
      _mm512_store_si512(weights + (4 * i + 1) * 16, _mm512_slli_epi32(high, 16));
      _mm512_store_si512(weights + (4 * i + 2) * 16, low);
      _mm512_store_si512(weights + (4 * i + 3) * 16, _mm512_slli_epi32(low, 16));
    }
    if (rescale) scale(h, slice, rows);
    _tile_loadd(3, weights, 64);
    for (int x = 0; x < chunks_; x += 4) {
      const int n = std::min(4, chunks_ - x);
      const char* v = at.value + 64 * x;
      float* c = accumulators(h, slice, x);
      const int64_t next = 4 * slice_rows_ * 16;  // floats from one chunk's accumulators to the next
      // GCC's tile intrinsics spell the tile number into their assembly, so each tile is written out
      ahead.step();
      _tile_loadd(4, c, 64);
      _tile_loadd(1, v, at.value_stride);
      _tile_dpbf16ps(4, 3, 1);
      if (n > 1) {
        ahead.step();
        _tile_loadd(5, c + next, 64);
        _tile_loadd(1, v + 64, at.value_stride);
        _tile_dpbf16ps(5, 3, 1);
      }
      if (n > 2) {
        ahead.step();
        _tile_loadd(6, c + 2 * next, 64);
        _tile_loadd(1, v + 128, at.value_stride);
        _tile_dpbf16ps(6, 3, 1);
      }
      if (n > 3) {
        ahead.step();
        _tile_loadd(7, c + 3 * next, 64);
        _tile_loadd(1, v + 192, at.value_stride);
        _tile_dpbf16ps(7, 3, 1);
      }
      _tile_stored(4, c, 64);
      if (n > 1) _tile_stored(5, c + next, 64);
      if (n > 2) _tile_stored(6, c + 2 * next, 64);
      if (n > 3) _tile_stored(7, c + 3 * next, 64);
    }
  }

  // Kv head h's accumulators of one slice and one 32-element chunk: [4 rows per query row][16] floats.
  float* accumulators(int h, int slice, int x) {
    return s_.acc_pairs.data() + ((static_cast<int64_t>(h) * slices_ + slice) * chunks_ + x) * 4 * slice_rows_ * 16;
  }

  void scale(int h, int slice, const int* rows) {
    for (int x = 0; x < chunks_; ++x) {
      float* c = accumulators(h, slice, x);
      for (int i = 0; i < 4 * slice_rows_; ++i) {
        const int n = slice * 4 + i / 4;
        if (n >= count_) break;  // padding rows stay zero
        const __m512 by = _mm512_set1_ps(s_.correction[rows[n]]);
        _mm512_storeu_ps(c + i * 16, _mm512_mul_ps(_mm512_loadu_ps(c + i * 16), by));
      }
    }
  }

  void stage_row(const char* src, char* dst) const {
    const auto* bytes = reinterpret_cast<const uint8_t*>(src);
    auto* out = reinterpret_cast<uint16_t*>(dst);
    switch (kv_dtype_) {
      case PB_FP8_E4M3: fp8_row_to_bf16<PB_FP8_E4M3>(bytes, dim_, out); break;
      case PB_FP8_E5M2: fp8_row_to_bf16<PB_FP8_E5M2>(bytes, dim_, out); break;
      default: std::memcpy(dst, src, dim_ * sizeof(uint16_t));
    }
  }

  Scratch& s_;
  int32_t kv_dtype_;
  int kv_heads_, count_, dim_, chunks_;
  int columns_, passes_;     // the scores' rows per pass (C tile columns), and passes over the rows
  int slice_rows_, slices_;  // the values' rows per slice, and slices over the rows
};

// Whether a bf16 query over a bf16 or fp8 cache runs on the tiles: head_dim a multiple of 32, the tiles granted and on.
inline bool tiles_take(const PbCpuAttentionArgs& a) {
  return a.q_dtype == PB_BF16 && (a.kv_dtype == PB_BF16 || is_fp8(a.kv_dtype)) && a.head_dim % 32 == 0 &&
         pb_amx::in_use();
}

}  // namespace

#else

namespace {

inline bool tiles_take(const PbCpuAttentionArgs&) { return false; }  // this build has no tiles

}  // namespace

#endif
