// reshape_and_cache: one CTA per token copies its [num_heads, head_dim] key and value rows into the
// NHD pools at slot_mapping[token]; slot < 0 (CUDA-graph padding) is skipped. fp8 pools store x / scale, other
// pools the rows as they are (the scales are fp8's alone, as in the torch oracle).
#include <type_traits>

#include "dtype_convert.cuh"
#include "paged_attention.h"

namespace pb {

constexpr int WRITE_THREADS = 256;

template <typename src_t, typename cache_t>
__device__ __forceinline__ void write_row(const src_t* src, int64_t stride_token, int64_t stride_head, cache_t* pool,
                                          int64_t stride_block, int64_t stride_slot, int64_t stride_head_pool,
                                          int64_t token, int64_t block, int64_t offset, int num_heads, int head_dim,
                                          float scale) {
  for (int i = threadIdx.x; i < num_heads * head_dim; i += WRITE_THREADS) {
    const int head = i / head_dim;
    const int dim = i % head_dim;
    float x = to_float(src[token * stride_token + head * stride_head + dim]);
    if constexpr (std::is_same_v<cache_t, fp8_e4m3>) x /= scale;
    pool[block * stride_block + offset * stride_slot + head * stride_head_pool + dim] = from_float<cache_t>(x);
  }
}

template <typename src_t, typename cache_t>
__global__ void __launch_bounds__(WRITE_THREADS) reshape_and_cache_kernel(const pb_cache_write_args a) {
  const int64_t token = blockIdx.x;
  const int64_t slot = a.slot_mapping[token];
  if (slot < 0) return;
  const int64_t block = slot / a.block_size;
  const int64_t offset = slot % a.block_size;
  write_row(static_cast<const src_t*>(a.key), a.key_stride_token, a.key_stride_head, static_cast<cache_t*>(a.key_cache),
            a.kc_stride_block, a.kc_stride_slot, a.kc_stride_head, token, block, offset, a.num_heads, a.head_dim,
            a.k_scale);
  write_row(static_cast<const src_t*>(a.value), a.value_stride_token, a.value_stride_head,
            static_cast<cache_t*>(a.value_cache), a.vc_stride_block, a.vc_stride_slot, a.vc_stride_head, token, block,
            offset, a.num_heads, a.head_dim, a.v_scale);
}

template <typename src_t>
int launch_write(const pb_cache_write_args& a, int src_dtype, int cache_dtype, cudaStream_t stream) {
  if (cache_dtype == PB_FP8_E4M3) {
    reshape_and_cache_kernel<src_t, fp8_e4m3><<<a.num_tokens, WRITE_THREADS, 0, stream>>>(a);
  } else if (cache_dtype == src_dtype) {
    reshape_and_cache_kernel<src_t, src_t><<<a.num_tokens, WRITE_THREADS, 0, stream>>>(a);
  } else {
    return PB_UNSUPPORTED_DTYPE;
  }
  return (int)cudaGetLastError();
}

}  // namespace pb

extern "C" int pb_reshape_and_cache(const pb_cache_write_args* args, int src_dtype, int cache_dtype,
                                    cudaStream_t stream) {
  const pb_cache_write_args& a = *args;
  if (a.num_heads <= 0 || a.head_dim <= 0 || a.block_size <= 0) return PB_BAD_SHAPE;
  if (a.num_tokens == 0) return PB_OK;
  switch (src_dtype) {
    case PB_FLOAT32: return pb::launch_write<float>(a, src_dtype, cache_dtype, stream);
    case PB_FLOAT16: return pb::launch_write<__half>(a, src_dtype, cache_dtype, stream);
    case PB_BFLOAT16: return pb::launch_write<__nv_bfloat16>(a, src_dtype, cache_dtype, stream);
    default: return PB_UNSUPPORTED_DTYPE;
  }
}
