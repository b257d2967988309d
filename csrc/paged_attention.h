// C ABI of libpaged_attention: raw pointers, element strides, ints and a CUDA stream. No torch headers.
//
// Layouts: query/out [num_seqs, num_q_heads, head_dim] (one decode token per sequence);
// key_cache/value_cache NHD [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables [num_seqs, table_stride] int32; seq_lens [num_seqs] int32; slot_mapping [num_tokens] int64.
// Every function returns 0 or an error code that pb_error_string() explains.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum pb_dtype { PB_FLOAT32 = 0, PB_FLOAT16 = 1, PB_BFLOAT16 = 2, PB_FP8_E4M3 = 3 };

enum pb_status {
  PB_OK = 0,
  PB_UNSUPPORTED_DTYPE = -1,
  PB_UNSUPPORTED_HEAD_DIM = -2,  // head_dim must be a multiple of 8 and at most 256
  PB_BAD_SHAPE = -3,             // num_q_heads not a multiple of num_kv_heads, or a count <= 0
};

// Tokens per split-KV partition; partial buffers hold one entry per partition.
#define PB_PARTITION_SIZE 512

typedef struct pb_decode_args {
  const void* query;
  int64_t q_stride_seq, q_stride_head;
  const void* key_cache;
  const void* value_cache;
  int64_t k_stride_block, k_stride_slot, k_stride_head;
  int64_t v_stride_block, v_stride_slot, v_stride_head;
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* seq_lens;
  void* out;
  int64_t o_stride_seq, o_stride_head;
  // used when num_partitions > 1: [num_seqs, num_q_heads, num_partitions, head_dim] and [.., num_partitions]
  float* partial_out;
  float* partial_max;
  float* partial_sum;
  int32_t num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, num_partitions;
  float scale, softcap, k_scale, v_scale;  // softcap <= 0: off
  int32_t sliding_window;                  // <= 0: off; else keys k with p - window < k <= p
} pb_decode_args;

typedef struct pb_cache_write_args {
  const void* key;
  const void* value;
  int64_t key_stride_token, key_stride_head, value_stride_token, value_stride_head;
  void* key_cache;
  void* value_cache;
  int64_t kc_stride_block, kc_stride_slot, kc_stride_head;
  int64_t vc_stride_block, vc_stride_slot, vc_stride_head;
  const int64_t* slot_mapping;  // slot < 0: skip the token
  int32_t num_tokens, num_heads, head_dim, block_size;
  float k_scale, v_scale;  // fp8 pools store x / scale
} pb_cache_write_args;

// Decode attention (q_len 1). query_dtype is the dtype of query and out; cache_dtype is query_dtype or fp8.
int pb_paged_decode(const pb_decode_args* args, int query_dtype, int cache_dtype, cudaStream_t stream);

// Write key/value rows into their slots. src_dtype is the dtype of key/value; cache_dtype equals it or is fp8.
int pb_reshape_and_cache(const pb_cache_write_args* args, int src_dtype, int cache_dtype, cudaStream_t stream);

const char* pb_error_string(int status);

// sizeof of the argument structs, so a binding (ctypes) can check its mirror of the layout.
uint64_t pb_decode_args_size(void);
uint64_t pb_cache_write_args_size(void);

#ifdef __cplusplus
}
#endif
