// Paged decode attention (one query token per sequence), GQA-aware and split over the KV axis.
//
// One CTA = (partition of PB_PARTITION_SIZE tokens, kv head, up to MAX_GROUP of its q heads, sequence).
// Every q head of the chunk is scored against each K row while it is in registers, so a KV byte is read
// once per kv head instead of once per q head. Threads: a token is handled by LANES lanes, 8 head dims per
// lane (one 16-byte load for fp16/bf16), so a warp covers 32 / LANES tokens per step.
//   pass 1: scores for the partition -> shared memory;  pass 2: per-head max / exp / sum;
//   pass 3: probabilities x V accumulated in fp32 registers, summed over lanes and warps.
// With one partition the CTA writes the normalised output; otherwise it writes (max, sum, unnormalised
// output) and pb_reduce_partitions merges the partitions with log-sum-exp weights.
#include <float.h>

#include "dtype_convert.cuh"
#include "paged_attention.h"

namespace pb {

constexpr int NUM_THREADS = 128;
constexpr int NUM_WARPS = NUM_THREADS / 32;
constexpr int MAX_GROUP = 8;  // q heads per CTA; larger GQA groups use several CTAs per kv head
constexpr int MAX_HEAD_DIM = 256;
constexpr int DIMS_PER_LANE = 8;
constexpr int PARTITION = PB_PARTITION_SIZE;

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Physical element offset of (token, kv head, first dim of this lane) in an NHD pool.
__device__ __forceinline__ int64_t pool_offset(const int32_t* table, int token, int block_size, int64_t stride_block,
                                               int64_t stride_slot, int64_t stride_head, int kv_head, int dim0) {
  const int64_t block = table[token / block_size];
  return block * stride_block + (int64_t)(token % block_size) * stride_slot + kv_head * stride_head + dim0;
}

template <typename scalar_t, typename cache_t, int LANES>
__global__ void __launch_bounds__(NUM_THREADS) paged_decode_kernel(const pb_decode_args a) {
  constexpr int TOKENS_PER_WARP = 32 / LANES;
  constexpr int TOKENS_PER_STEP = NUM_WARPS * TOKENS_PER_WARP;

  __shared__ float logits[MAX_GROUP][PARTITION];
  __shared__ float out_smem[MAX_GROUP][MAX_HEAD_DIM];
  __shared__ float head_max[MAX_GROUP];
  __shared__ float head_sum[MAX_GROUP];

  const int partition = blockIdx.x;
  const int seq = blockIdx.z;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int chunks = (group + MAX_GROUP - 1) / MAX_GROUP;
  const int kv_head = blockIdx.y / chunks;
  const int first_head = kv_head * group + (blockIdx.y % chunks) * MAX_GROUP;
  const int heads = min(MAX_GROUP, kv_head * group + group - first_head);
  const int head_dim = a.head_dim;

  const int seq_len = a.seq_lens[seq];
  const int window_begin = a.sliding_window > 0 ? max(0, seq_len - a.sliding_window) : 0;
  const int begin = max(window_begin, partition * PARTITION);
  const int end = min(seq_len, (partition + 1) * PARTITION);
  const int64_t partial_row = ((int64_t)seq * a.num_q_heads + first_head) * a.num_partitions + partition;

  if (begin >= end) {  // nothing visible in this partition (past the end, or before the window)
    if (a.num_partitions > 1) {
      for (int g = threadIdx.x; g < heads; g += NUM_THREADS) {
        a.partial_max[partial_row + (int64_t)g * a.num_partitions] = -FLT_MAX;
        a.partial_sum[partial_row + (int64_t)g * a.num_partitions] = 0.f;
      }
    } else {
      scalar_t* out = static_cast<scalar_t*>(a.out) + seq * a.o_stride_seq;
      for (int i = threadIdx.x; i < heads * head_dim; i += NUM_THREADS)
        out[(first_head + i / head_dim) * a.o_stride_head + i % head_dim] = from_float<scalar_t>(0.f);
    }
    return;
  }

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int token_slot = lane / LANES;
  const int dim0 = (lane % LANES) * DIMS_PER_LANE;
  const bool lane_active = dim0 < head_dim;
  const int32_t* table = a.block_tables + (int64_t)seq * a.table_stride;
  const cache_t* key_cache = static_cast<const cache_t*>(a.key_cache);
  const cache_t* value_cache = static_cast<const cache_t*>(a.value_cache);

  // q in registers, pre-multiplied by scale * k_scale (the fp8 dequant factor of every key)
  float q[MAX_GROUP][DIMS_PER_LANE];
  const scalar_t* query = static_cast<const scalar_t*>(a.query) + seq * a.q_stride_seq;
  const float q_factor = a.scale * a.k_scale;
#pragma unroll
  for (int g = 0; g < MAX_GROUP; ++g)
#pragma unroll
    for (int e = 0; e < DIMS_PER_LANE; ++e)
      q[g][e] = (g < heads && lane_active)
                    ? to_float(query[(first_head + g) * a.q_stride_head + dim0 + e]) * q_factor
                    : 0.f;

  // pass 1: scores. The loop bound is uniform across the CTA so every lane reaches the shuffles.
  // Unrolling lets the compiler issue several steps' K loads before the first one is consumed.
#pragma unroll 4
  for (int step = begin; step < end; step += TOKENS_PER_STEP) {
    const int token = step + warp * TOKENS_PER_WARP + token_slot;
    const bool valid = token < end;
    float k[DIMS_PER_LANE] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (valid && lane_active)
      load8(key_cache + pool_offset(table, token, a.block_size, a.k_stride_block, a.k_stride_slot,
                                    a.k_stride_head, kv_head, dim0), k);
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
      if (g >= heads) break;  // uniform across the CTA, so the shuffles below stay convergent
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < DIMS_PER_LANE; ++e) dot += q[g][e] * k[e];
#pragma unroll
      for (int offset = LANES / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      if (valid && lane % LANES == 0) {
        if (a.softcap > 0.f) dot = a.softcap * tanhf(dot / a.softcap);
        logits[g][token - begin] = dot;
      }
    }
  }
  __syncthreads();

  // pass 2: per-head softmax statistics over this partition; logits become exp(logit - max)
  const int count = end - begin;
  for (int g = warp; g < heads; g += NUM_WARPS) {
    float m = -FLT_MAX;
    for (int i = lane; i < count; i += 32) m = fmaxf(m, logits[g][i]);
    m = warp_max(m);
    float s = 0.f;
    for (int i = lane; i < count; i += 32) {
      const float p = __expf(logits[g][i] - m);
      logits[g][i] = p;
      s += p;
    }
    s = warp_sum(s);
    if (lane == 0) {
      head_max[g] = m;
      head_sum[g] = s;
    }
  }
  __syncthreads();

  // pass 3: unnormalised output = sum_t p[g][t] * V[t]
  float acc[MAX_GROUP][DIMS_PER_LANE];
#pragma unroll
  for (int g = 0; g < MAX_GROUP; ++g)
#pragma unroll
    for (int e = 0; e < DIMS_PER_LANE; ++e) acc[g][e] = 0.f;
#pragma unroll 4
  for (int step = begin; step < end; step += TOKENS_PER_STEP) {
    const int token = step + warp * TOKENS_PER_WARP + token_slot;
    if (token >= end || !lane_active) continue;  // no shuffles in this loop: divergence is fine
    float v[DIMS_PER_LANE];
    load8(value_cache + pool_offset(table, token, a.block_size, a.v_stride_block, a.v_stride_slot,
                                    a.v_stride_head, kv_head, dim0), v);
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
      if (g >= heads) break;
      const float p = logits[g][token - begin];
#pragma unroll
      for (int e = 0; e < DIMS_PER_LANE; ++e) acc[g][e] += p * v[e];
    }
  }
  // sum the token slots of a warp (lanes that share dims differ by multiples of LANES) ...
#pragma unroll
  for (int offset = LANES; offset < 32; offset *= 2)
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
      if (g >= heads) break;
#pragma unroll
      for (int e = 0; e < DIMS_PER_LANE; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], offset);
    }
  // ... then the warps, in a fixed order so results are deterministic
  for (int w = 0; w < NUM_WARPS; ++w) {
    if (warp == w && token_slot == 0 && lane_active) {
#pragma unroll
      for (int g = 0; g < MAX_GROUP; ++g) {
        if (g >= heads) break;
#pragma unroll
        for (int e = 0; e < DIMS_PER_LANE; ++e)
          out_smem[g][dim0 + e] = (w == 0 ? 0.f : out_smem[g][dim0 + e]) + acc[g][e];
      }
    }
    __syncthreads();
  }

  if (a.num_partitions == 1) {
    scalar_t* out = static_cast<scalar_t*>(a.out) + seq * a.o_stride_seq;
    for (int i = threadIdx.x; i < heads * head_dim; i += NUM_THREADS) {
      const int g = i / head_dim;
      out[(first_head + g) * a.o_stride_head + i % head_dim] =
          from_float<scalar_t>(out_smem[g][i % head_dim] / head_sum[g] * a.v_scale);
    }
  } else {
    for (int i = threadIdx.x; i < heads * head_dim; i += NUM_THREADS) {
      const int g = i / head_dim;
      a.partial_out[(partial_row + (int64_t)g * a.num_partitions) * head_dim + i % head_dim] =
          out_smem[g][i % head_dim];
    }
    for (int g = threadIdx.x; g < heads; g += NUM_THREADS) {
      a.partial_max[partial_row + (int64_t)g * a.num_partitions] = head_max[g];
      a.partial_sum[partial_row + (int64_t)g * a.num_partitions] = head_sum[g];
    }
  }
}

// One CTA per (q head, sequence): merge the partitions' partial outputs with weights exp(max_p - max).
template <typename scalar_t>
__global__ void __launch_bounds__(NUM_THREADS) reduce_partitions_kernel(const pb_decode_args a) {
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int seq_len = a.seq_lens[seq];
  const int used = min(a.num_partitions, (seq_len + PARTITION - 1) / PARTITION);
  const int64_t row = ((int64_t)seq * a.num_q_heads + head) * a.num_partitions;
  const float* part_max = a.partial_max + row;
  const float* part_sum = a.partial_sum + row;

  float global_max = -FLT_MAX;
  for (int p = 0; p < used; ++p) global_max = fmaxf(global_max, part_max[p]);
  float denom = 0.f;
  for (int p = 0; p < used; ++p)
    if (part_sum[p] > 0.f) denom += __expf(part_max[p] - global_max) * part_sum[p];

  scalar_t* out = static_cast<scalar_t*>(a.out) + seq * a.o_stride_seq + head * a.o_stride_head;
  for (int d = threadIdx.x; d < a.head_dim; d += NUM_THREADS) {
    float num = 0.f;
    for (int p = 0; p < used; ++p)  // empty partitions (sum 0) never wrote partial_out: skip, not 0 * garbage
      if (part_sum[p] > 0.f) num += __expf(part_max[p] - global_max) * a.partial_out[(row + p) * a.head_dim + d];
    out[d] = from_float<scalar_t>(denom > 0.f ? num / denom * a.v_scale : 0.f);
  }
}

template <typename scalar_t, typename cache_t, int LANES>
int launch(const pb_decode_args& a, cudaStream_t stream) {
  const int chunks = (a.num_q_heads / a.num_kv_heads + MAX_GROUP - 1) / MAX_GROUP;
  const dim3 grid(a.num_partitions, a.num_kv_heads * chunks, a.num_seqs);
  paged_decode_kernel<scalar_t, cache_t, LANES><<<grid, NUM_THREADS, 0, stream>>>(a);
  if (a.num_partitions > 1)
    reduce_partitions_kernel<scalar_t><<<dim3(a.num_q_heads, a.num_seqs), NUM_THREADS, 0, stream>>>(a);
  return (int)cudaGetLastError();
}

template <typename scalar_t, typename cache_t>
int dispatch_lanes(const pb_decode_args& a, cudaStream_t stream) {
  const int lanes = a.head_dim / DIMS_PER_LANE;
  if (lanes <= 4) return launch<scalar_t, cache_t, 4>(a, stream);
  if (lanes <= 8) return launch<scalar_t, cache_t, 8>(a, stream);
  if (lanes <= 16) return launch<scalar_t, cache_t, 16>(a, stream);
  return launch<scalar_t, cache_t, 32>(a, stream);
}

template <typename scalar_t>
int dispatch_cache(const pb_decode_args& a, int query_dtype, int cache_dtype, cudaStream_t stream) {
  if (cache_dtype == PB_FP8_E4M3) return dispatch_lanes<scalar_t, fp8_e4m3>(a, stream);
  if (cache_dtype == query_dtype) return dispatch_lanes<scalar_t, scalar_t>(a, stream);
  return PB_UNSUPPORTED_DTYPE;
}

}  // namespace pb

extern "C" int pb_paged_decode(const pb_decode_args* args, int query_dtype, int cache_dtype, cudaStream_t stream) {
  const pb_decode_args& a = *args;
  if (a.head_dim <= 0 || a.head_dim % pb::DIMS_PER_LANE != 0 || a.head_dim > pb::MAX_HEAD_DIM)
    return PB_UNSUPPORTED_HEAD_DIM;
  if (a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads != 0 || a.num_partitions <= 0 || a.block_size <= 0)
    return PB_BAD_SHAPE;
  if (a.num_seqs == 0) return PB_OK;
  switch (query_dtype) {
    case PB_FLOAT32: return pb::dispatch_cache<float>(a, query_dtype, cache_dtype, stream);
    case PB_FLOAT16: return pb::dispatch_cache<__half>(a, query_dtype, cache_dtype, stream);
    case PB_BFLOAT16: return pb::dispatch_cache<__nv_bfloat16>(a, query_dtype, cache_dtype, stream);
    default: return PB_UNSUPPORTED_DTYPE;
  }
}
