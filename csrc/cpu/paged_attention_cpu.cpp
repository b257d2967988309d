// Fused paged attention for CPUs: varlen causal prefill and decode read straight from the block pool.
//
// One task is (sequence, tile of query tokens) over all heads, so every key and value row loaded from the
// pool serves its whole GQA group and each block is read front to back. Keys are
// visited block by block with an online softmax (one rescale per block), so nothing is gathered or padded:
// each task reads its context once, which is what bounds decode on a CPU. Math is fp32.
//
// Plain C ABI (no torch headers) so it builds in about a second; paged_backend/ops/_cpu_abi.py mirrors it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

extern "C" {

enum PbCpuDtype : int32_t { PB_F32 = 0, PB_F16 = 1, PB_BF16 = 2, PB_FP8_E4M3 = 3 };

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
  int32_t q_dtype, kv_dtype;  // PbCpuDtype
  int32_t sliding_window;     // 0: off
  int32_t num_threads;
  float scale, softcap, k_scale, v_scale;  // softcap 0: off
};

uint64_t pb_cpu_attention_args_size() { return sizeof(PbCpuAttentionArgs); }

const char* pb_cpu_error_string(int code) {
  switch (code) {
    case 0: return "ok";
    case -1: return "unsupported dtype code (query: f32/f16/bf16; cache: f32/f16/bf16/fp8 e4m3)";
    case -2: return "num_q_heads must be a positive multiple of num_kv_heads, head_dim and block_size positive";
    default: return "unknown error";
  }
}

}  // extern "C"

namespace {

constexpr int kMaxRowsPerTask = 128;  // query rows (tokens x q heads) sharing one pass over the context

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

struct Fp8Table {
  float values[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) values[i] = fp8_e4m3_to_float(static_cast<uint8_t>(i));
  }
};
const Fp8Table kFp8;

inline float bf16_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

inline uint16_t float_to_bf16(float value) {  // round to nearest even, NaN kept quiet
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  if ((word & 0x7FFFFFFF) > 0x7F800000) return static_cast<uint16_t>((word >> 16) | 0x40);
  word += 0x7FFF + ((word >> 16) & 1);
  return static_cast<uint16_t>(word >> 16);
}

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
      for (int i = 0; i < n; ++i) dst[i] = kFp8.values[bytes[i]];
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

inline size_t element_size(int32_t code) { return code == PB_F32 ? 4 : code == PB_FP8_E4M3 ? 1 : 2; }

inline float dot(const float* a, const float* b, int n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += alpha * x[i];
}

struct Task {
  int32_t seq, first_token, num_tokens;  // a tile of the sequence's query tokens, all heads
};

// Per-thread scratch: query rows, accumulators, running max/sum, one block of scores, converted K/V rows.
struct Scratch {
  std::vector<float> q, acc, max, sum, scores, key, value;
  Scratch(int rows, int dim, int block_size)
      : q(rows * dim), acc(rows * dim), max(rows), sum(rows), scores(rows * block_size), key(dim), value(dim) {}
};

// Row r of a task is (token r / Hq, q head r % Hq); the rows of kv head h and token i are contiguous:
// i * Hq + h * group + [0, group). Per key slot the loop runs over kv heads, so a block is read in memory
// order (slot-major, as the pool stores it) and the hardware prefetcher keeps up.
void run_task(const PbCpuAttentionArgs& a, const Task& task, Scratch& s) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int dim = a.head_dim, heads = a.num_q_heads, group = heads / a.num_kv_heads, bs = a.block_size;
  const int tokens = task.num_tokens, rows = tokens * heads;
  const int64_t first_row = a.query_start_loc[task.seq] + task.first_token;
  const int q_len = a.query_start_loc[task.seq + 1] - a.query_start_loc[task.seq];
  const int context = a.seq_lens[task.seq];
  const int first_pos = context - q_len + task.first_token;  // position of the tile's first query token
  const int window = a.sliding_window;
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
  const char* k_base = static_cast<const char*>(a.key_cache);
  const char* v_base = static_cast<const char*>(a.value_cache);

  for (int block_start = lo - lo % bs; block_start < hi; block_start += bs) {
    const int64_t block = table[block_start / bs];
    const int t0 = std::max(lo, block_start), n = std::min(hi, block_start + bs) - t0;
    // scores of this block's keys for every row (-inf where the row may not see the key)
    for (int j = 0; j < n; ++j) {
      const int t = t0 + j;
      const int64_t slot = block * a.k_stride_block + (t - block_start) * a.k_stride_slot;
      for (int h = 0; h < a.num_kv_heads; ++h) {
        const float* key = load_row(k_base + (slot + h * a.k_stride_head) * kv_elem, a.kv_dtype, dim, s.key.data());
        for (int i = 0; i < tokens; ++i) {
          const int pos = first_pos + i;
          const bool visible = t <= pos && (window <= 0 || t > pos - window);
          for (int r = i * heads + h * group; r < i * heads + (h + 1) * group; ++r) {
            float score = kNegInf;
            if (visible) {
              score = dot(s.q.data() + r * dim, key, dim);
              if (a.softcap > 0.0f) score = a.softcap * std::tanh(score / a.softcap);
            }
            s.scores[r * bs + j] = score;
          }
        }
      }
    }
    // online softmax: one rescale of each row's accumulator per block, scores become probabilities
    for (int r = 0; r < rows; ++r) {
      float* row_scores = s.scores.data() + r * bs;
      float block_max = kNegInf;
      for (int j = 0; j < n; ++j) block_max = std::max(block_max, row_scores[j]);
      if (block_max == kNegInf) continue;  // the row sees none of this block: its scores stay -inf
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
        row_scores[j] = std::exp(row_scores[j] - new_max);
        total += row_scores[j];
      }
      s.sum[r] += total;
      s.max[r] = new_max;
    }
    // accumulate probabilities x values (a row that sees none of this block has only -inf scores: skipped)
    for (int j = 0; j < n; ++j) {
      const int64_t slot = block * a.v_stride_block + (t0 + j - block_start) * a.v_stride_slot;
      for (int h = 0; h < a.num_kv_heads; ++h) {
        const float* value = load_row(v_base + (slot + h * a.v_stride_head) * kv_elem, a.kv_dtype, dim, s.value.data());
        for (int i = 0; i < tokens; ++i) {
          for (int r = i * heads + h * group; r < i * heads + (h + 1) * group; ++r) {
            const float p = s.scores[r * bs + j];
            if (p > 0.0f) axpy(p, value, s.acc.data() + r * dim, dim);
          }
        }
      }
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
  if (a.q_dtype < PB_F32 || a.q_dtype > PB_BF16 || a.kv_dtype < PB_F32 || a.kv_dtype > PB_FP8_E4M3) return -1;
  if (a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads != 0 || a.head_dim <= 0 || a.block_size <= 0) return -2;
  const int tile_tokens = std::max(1, kMaxRowsPerTask / a.num_q_heads);

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
