// Fused paged attention for CPUs: varlen causal prefill and decode read straight from the block pool.
//
// One task is (sequence, tile of query tokens) over all heads, so every key and value row loaded from the
// pool serves its whole GQA group. Long contexts are cut into parts at multiples of a cut length, one task each,
// merged after (flash-decoding's split), so that one long sequence decodes on every core. Keys are visited block
// by block with an online softmax (one rescale per block), so nothing is gathered or padded: each task reads its
// context once, which is what bounds decode.
// Over fp32 and fp16 caches, and bf16 and fp8 on AMX tiles (attention_tiles.h), every tile, prefill included, goes
// sixteen keys at a time per kv head (attention_decode.h). Over other caches, tiles of 8 or more rows per kv head take
// transposed 16-key panels against four rows at a time (panel_blocks, here): see panel_min_rows. Values are
// accumulated four rows at a time with the accumulators in registers. Math is fp32; the argument struct, the
// dtype conversions and the scratch both paths share are in attention_cpu.h.
//
// Batch-invariant mode (`invariant`): every task is one query token, so a row's scores, softmax sums and
// value sums run the same code over the same keys in the same order whatever the query length, the chunking or
// the other sequences (tiles share K/V loads, but the score path and the softmax's vector sums depend on the
// tile). The score path then depends only on the GQA group, a constant of the model.
//
// Plain C ABI (no torch headers), so it builds with the host compiler alone (7 s); paged_backend/ops/cpu.py mirrors it.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include <omp.h>

#include "attention_cpu.h"
#include "attention_decode.h"

extern "C" {

uint64_t pb_cpu_attention_args_size() { return sizeof(PbCpuAttentionArgs); }
uint64_t pb_cpu_cache_write_args_size() { return sizeof(PbCpuCacheWriteArgs); }

const char* pb_cpu_error_string(int code) {
  switch (code) {
    case 0: return "ok";
    case -1: return "unsupported dtype code (query: f32/f16/bf16; cache: f32/f16/bf16/fp8 e4m3/e5m2)";
    case -2: return "num_q_heads must be a positive multiple of num_kv_heads, head_dim and block_size positive";
    case -3: return "cache write: num_kv_heads, head_dim, block_size and the element size must be positive";
    case -4: return "cache write: a slot in slot_mapping lies past the pool's last block";
    default: return "unknown error";
  }
}

}  // extern "C"

namespace {

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

// The running max and sum and the unnormalized value sums of each row of one part of a split context.
struct Partial {
  float *max, *sum, *acc;
};
// Every part's slot, sized for the most rows a task has; left uninitialized, as each part writes all of its rows.
class Partials {
 public:
  Partials(int slots, int max_rows, int dim)
      : slot_floats_(size_t(max_rows) * (dim + 2)), data_(new float[slots * slot_floats_]) {}
  Partial at(int slot, int rows) const {
    float* base = data_.get() + slot * slot_floats_;
    return {base, base + rows, base + 2 * rows};
  }

 private:
  size_t slot_floats_;
  std::unique_ptr<float[]> data_;
};

// Row r's output: its value sums over its softmax sum (zero where the row saw no key), into the output tensor.
void store_rows(const PbCpuAttentionArgs& a, const Task& task, float* acc_rows, const float* sums, int rows) {
  const int dim = a.head_dim, heads = a.num_q_heads;
  const size_t q_elem = element_size(a.q_dtype);
  const int64_t first_row = a.query_start_loc[task.seq] + task.first_token;
  for (int r = 0; r < rows; ++r) {
    float* acc = acc_rows + r * dim;
    const float norm = sums[r] > 0.0f ? a.v_scale / sums[r] : 0.0f;
    for (int d = 0; d < dim; ++d) acc[d] *= norm;
    const int64_t token = first_row + r / heads;
    char* dst = static_cast<char*>(a.out) + (token * a.o_stride_token + (r % heads) * a.o_stride_head) * q_elem;
    store_row(acc, a.q_dtype, dim, dst);
  }
}

// The position of a sequence's query token `first` (its query tokens are the last of its context).
inline int first_position(const PbCpuAttentionArgs& a, int seq, int first) {
  return a.seq_lens[seq] - (a.query_start_loc[seq + 1] - a.query_start_loc[seq]) + first;
}

// Row r of a task is (token r / Hq, q head r % Hq); the rows of kv head h and token i are contiguous:
// i * Hq + h * group + [0, group).
void run_task(const PbCpuAttentionArgs& a, const Task& task, Partials& partials, Scratch& s) {
  const int dim = a.head_dim, heads = a.num_q_heads, group = heads / a.num_kv_heads;
  const int tokens = task.num_tokens, rows = tokens * heads;
  const int64_t first_row = a.query_start_loc[task.seq] + task.first_token;
  const int window = a.sliding_window;
  const Tile tile{first_position(a, task.seq, task.first_token), tokens, heads, group, window};
  // the rows of each kv head, once per task: head_rows[h * tokens * group + i * group + g] = row of (i, g)
  for (int h = 0, n = 0; h < a.num_kv_heads; ++h)
    for (int i = 0; i < tokens; ++i)
      for (int g = 0; g < group; ++g) s.head_rows[n++] = i * heads + h * group + g;
  const size_t q_elem = element_size(a.q_dtype);
  const float q_scale = a.scale * a.k_scale;
  const bool decode = tokens * group < panel_min_rows(a.kv_dtype, tiles_take(a));  // else the panel path
  const bool raw_bf16 = decode && a.q_dtype == PB_BF16;  // the decode path's pair dot products read these rows

  for (int i = 0; i < tokens; ++i) {
    for (int head = 0; head < heads; ++head) {
      const char* src = static_cast<const char*>(a.query) +
                        ((first_row + i) * a.q_stride_token + head * a.q_stride_head) * q_elem;
      float* q = s.q.data() + (i * heads + head) * dim;
      const float* loaded = load_row(src, a.q_dtype, dim, q);
      for (int d = 0; d < dim; ++d) q[d] = loaded[d] * q_scale;
      if (raw_bf16) std::memcpy(s.q16.data() + (i * heads + head) * dim, src, dim * sizeof(uint16_t));
    }
  }
  std::fill(s.acc.begin(), s.acc.begin() + rows * dim, 0.0f);
  std::fill(s.max.begin(), s.max.begin() + rows, kNegInf);
  std::fill(s.sum.begin(), s.sum.begin() + rows, 0.0f);

  const int lo = task.key_lo, hi = task.key_hi;
  const int32_t* table = a.block_tables + task.seq * a.table_stride;
  if (!decode) {
    panel_blocks(a, s, tile, table, lo, hi);
  } else {
    switch (a.kv_dtype) {
      case PB_F32: decode_blocks<Kv<PB_F32>>(a, s, tile, table, lo, hi); break;
      case PB_F16: decode_blocks<Kv<PB_F16>>(a, s, tile, table, lo, hi); break;
      case PB_BF16:
#if defined(__AVX512BF16__)
        if (a.q_dtype == PB_BF16) {
          decode_blocks<Bf16Pairs>(a, s, tile, table, lo, hi);
          break;
        }
#endif
        decode_blocks<Kv<PB_BF16>>(a, s, tile, table, lo, hi);
        break;
      case PB_FP8_E4M3: decode_blocks<Kv<PB_FP8_E4M3>>(a, s, tile, table, lo, hi); break;
      default: decode_blocks<Kv<PB_FP8_E5M2>>(a, s, tile, table, lo, hi); break;
    }
  }

  if (task.partial >= 0) {  // one part of a split context: keep its running max, sum and unnormalized values
    Partial part = partials.at(task.partial, rows);
    std::copy(s.max.begin(), s.max.begin() + rows, part.max);
    std::copy(s.sum.begin(), s.sum.begin() + rows, part.sum);
    std::copy(s.acc.begin(), s.acc.begin() + rows * dim, part.acc);
    return;
  }
  store_rows(a, task, s.acc.data(), s.sum.data(), rows);
}

// Merges the parts of a split context in key order: each part's sums rescaled to the overall max.
void merge_parts(const PbCpuAttentionArgs& a, const Task& task, int parts, const Partials& partials, Scratch& s) {
  const int dim = a.head_dim, rows = task.num_tokens * a.num_q_heads;
  for (int r = 0; r < rows; ++r) {
    float max = kNegInf;
    for (int p = 0; p < parts; ++p) max = std::max(max, partials.at(task.partial + p, rows).max[r]);
    float* acc = s.acc.data() + r * dim;
    std::fill(acc, acc + dim, 0.0f);
    float sum = 0.0f;
    for (int p = 0; p < parts && max != kNegInf; ++p) {
      const Partial part = partials.at(task.partial + p, rows);
      if (part.max[r] == kNegInf) continue;  // the part saw none of this row's keys
      const float weight = std::exp(part.max[r] - max);
      sum += part.sum[r] * weight;
      for (int d = 0; d < dim; ++d) acc[d] += part.acc[r * dim + d] * weight;
    }
    s.sum[r] = sum;
  }
  store_rows(a, task, s.acc.data(), s.sum.data(), rows);
}

}  // namespace

extern "C" int pb_cpu_paged_attention(const PbCpuAttentionArgs* args) {
  const PbCpuAttentionArgs& a = *args;
  if (a.q_dtype < PB_F32 || a.q_dtype > PB_BF16 || a.kv_dtype < PB_F32 || a.kv_dtype > PB_FP8_E5M2) return -1;
  if (a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads != 0 || a.head_dim <= 0 || a.block_size <= 0) return -2;
  const int tile_tokens = a.invariant ? 1 : std::max(1, kMaxRowsPerTask / a.num_q_heads);

  // Tiles, each cut into parts at multiples of `cut` of the key positions it sees; `split` holds the first part and
  // the count of each tile cut in more than one. A step of few tiles is cut finer, so that they fill the cores
  // (never by the thread count: results stay the same at any). Batch-invariant mode keeps the fixed cut: a row's
  // parts then depend on its own positions only.
  int tiles = 0;
  for (int b = 0; b < a.num_seqs; ++b)
    tiles += (a.query_start_loc[b + 1] - a.query_start_loc[b] + tile_tokens - 1) / tile_tokens;
  int cut = kSplitKeys;  // halved while the step has fewer parts than kTasksWanted, so parts end on block edges
  while (!a.invariant && cut > kMinSplitKeys && tiles * (kSplitKeys / cut) < kTasksWanted) cut /= 2;
  std::vector<Task> tasks;
  std::vector<std::pair<Task, int>> split;
  int slots = 0, most_tokens = 1;  // scratch is sized for the tallest tile: a decode step's are one token high
  for (int b = 0; b < a.num_seqs; ++b) {
    const int q_len = a.query_start_loc[b + 1] - a.query_start_loc[b], context = a.seq_lens[b];
    for (int first = 0; first < q_len; first += tile_tokens) {
      // token i sees keys [first_pos + i - window + 1, first_pos + i]; the tile as a whole sees [lo, hi)
      const int tokens = std::min(tile_tokens, q_len - first), first_pos = first_position(a, b, first);
      most_tokens = std::max(most_tokens, tokens);
      const int lo = a.sliding_window > 0 ? std::max(0, first_pos - a.sliding_window + 1) : 0;
      const int hi = std::min(context, first_pos + tokens);
      const int cut_lo = lo - lo % cut, parts = std::max(1, (hi - cut_lo + cut - 1) / cut);
      if (parts == 1) {
        tasks.push_back({b, first, tokens, lo, hi, -1});
        continue;
      }
      split.push_back({{b, first, tokens, lo, hi, slots}, parts});
      for (int p = 0; p < parts; ++p)
        tasks.push_back(
            {b, first, tokens, std::max(lo, cut_lo + p * cut), std::min(hi, cut_lo + (p + 1) * cut), slots++});
    }
  }
  const int threads = std::max(1, std::min<int>(a.num_threads, static_cast<int>(tasks.size())));
  const int rows = most_tokens * a.num_q_heads;
  Partials partials(slots, rows, a.head_dim);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    Scratch scratch(rows, a.head_dim, a.block_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < static_cast<int64_t>(tasks.size()); ++i) run_task(a, tasks[i], partials, scratch);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < static_cast<int64_t>(split.size()); ++i)
      merge_parts(a, split[i].first, split[i].second, partials, scratch);
  }
  return 0;
}

// The cache write: one memcpy per (token, kv head). A decode step's row is a few hundred bytes, so threads join only
// for prefill chunks, where torch's index_put had spread the copy too.
extern "C" int pb_cpu_reshape_and_cache(const PbCpuCacheWriteArgs* args) {
  const PbCpuCacheWriteArgs& a = *args;
  if (a.num_tokens < 0 || a.num_kv_heads <= 0 || a.head_dim <= 0 || a.block_size <= 0 || a.element_bytes <= 0)
    return -3;
  for (int32_t t = 0; t < a.num_tokens; ++t)
    if (a.slot_mapping[t] >= a.num_slots) return -4;
  const int64_t row_bytes = int64_t{a.head_dim} * a.element_bytes, e = a.element_bytes;
  const auto* key = static_cast<const char*>(a.key);
  const auto* value = static_cast<const char*>(a.value);
  auto* key_cache = static_cast<char*>(a.key_cache);
  auto* value_cache = static_cast<char*>(a.value_cache);
  const int threads = a.num_tokens >= 64 ? std::max(1, a.num_threads) : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int32_t t = 0; t < a.num_tokens; ++t) {
    const int64_t slot = a.slot_mapping[t];
    if (slot < 0) continue;
    const int64_t block = slot / a.block_size, offset = slot % a.block_size;
    char* k_dst = key_cache + (block * a.k_stride_block + offset * a.k_stride_slot) * e;
    char* v_dst = value_cache + (block * a.v_stride_block + offset * a.v_stride_slot) * e;
    for (int32_t h = 0; h < a.num_kv_heads; ++h) {
      std::memcpy(k_dst + h * a.k_stride_head_cache * e, key + (t * a.k_stride_token + h * a.k_stride_head) * e,
                  row_bytes);
      std::memcpy(v_dst + h * a.v_stride_head_cache * e, value + (t * a.v_stride_token + h * a.v_stride_head) * e,
                  row_bytes);
    }
  }
  return 0;
}
