// ABI helpers: error messages and struct sizes for bindings.
#include "paged_attention.h"

extern "C" const char* pb_error_string(int status) {
  switch (status) {
    case PB_UNSUPPORTED_DTYPE: return "unsupported dtype combination (pool must match the input dtype, or be fp8 e4m3)";
    case PB_UNSUPPORTED_HEAD_DIM: return "head_dim must be a multiple of 8 and at most 256";
    case PB_BAD_SHAPE: return "invalid shape: num_q_heads must be a multiple of num_kv_heads and counts positive";
    default: return cudaGetErrorString(static_cast<cudaError_t>(status));
  }
}

extern "C" uint64_t pb_decode_args_size(void) { return sizeof(pb_decode_args); }
extern "C" uint64_t pb_cache_write_args_size(void) { return sizeof(pb_cache_write_args); }
