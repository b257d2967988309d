// The C ABI of the csrc/cpu kernels: the argument structs and entry points, for the ctypes mirrors in
// paged_backend/ops/ and for C++ callers in this library (decoder_layers_cpu.cpp runs a step's layers on them).
#pragma once

#include <cstdint>

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

struct RotaryCacheArgs {
  const void* query;  // [T, Hq * D] rows of q_proj's output
  int64_t q_stride;
  const void* key;  // [T, Hkv * D]
  int64_t k_stride;
  const void* value;
  int64_t v_stride;
  const void* cos;  // [T, rotary_dim]
  const void* sin;
  void* query_out;  // [T, Hq, D] contiguous
  void* key_cache;  // [N, block_size, Hkv, D]
  void* value_cache;
  int64_t k_stride_block, k_stride_slot, k_stride_head;
  int64_t v_stride_block, v_stride_slot, v_stride_head;
  const int64_t* slot_mapping;  // [T], -1: not stored
  int32_t num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, num_threads;
  const void* q_norm;  // or null: an RMSNorm weight [D] applied to each q head before rotary (Qwen3's q_norm)
  const void* k_norm;  // likewise for each k head (k_norm); the stored keys are normed and rotated
  float q_norm_eps, k_norm_eps;
  int32_t skip_rotary;  // 1: a NoPE layer (SmolLM3): q and k pass unrotated (after any norm)
  int32_t rotary_dim;   // the leading dims of each head that rotate, the rest pass (Phi-4-mini); 0: all of head_dim
  int32_t unit_offset;  // the q/k norms are Gemma's: (1 + weight) in fp32, one rounding
  int64_t num_slots;    // the pool's blocks times block_size: a slot at or past it is refused, nothing written
  int32_t kv_dtype;     // PB_FP8_E4M3 or PB_FP8_E5M2: fp8 pools, holding k / k_scale and v / v_scale; else the
                        // activations' dtype (the pools hold k and v as they are)
  float k_scale, v_scale;
};

// reshape_and_cache of the cpu backend: rows `key/value [T, Hkv, D]` (unit stride along D, the pool's dtype) copied
// into the pools at `slot_mapping` (-1: not stored). A byte copy, so one entry serves every pool dtype.
struct PbCpuCacheWriteArgs {
  const void* key;
  int64_t k_stride_token, k_stride_head;
  const void* value;
  int64_t v_stride_token, v_stride_head;
  void* key_cache;  // [N, block_size, Hkv, D]
  void* value_cache;
  int64_t k_stride_block, k_stride_slot, k_stride_head_cache;
  int64_t v_stride_block, v_stride_slot, v_stride_head_cache;
  const int64_t* slot_mapping;  // [T]
  int64_t num_slots;            // blocks x block_size: a slot past it is refused, never written
  int32_t num_tokens, num_kv_heads, head_dim, block_size, element_bytes, num_threads;
};

constexpr int32_t kMaxNormedHeadDim = 512;  // a normed head is staged in a stack buffer of this many elements

int pb_cpu_paged_attention(const PbCpuAttentionArgs* args);
int pb_cpu_reshape_and_cache(const PbCpuCacheWriteArgs* args);
int pb_cpu_rotary_cache(const RotaryCacheArgs* args, int32_t dtype);
// x_weight: or null; x is RMS-normed with it before the add (Gemma's post-norms). x_scale: x times it before the
// add (Granite's residual multiplier; 1: none). unit_offset: Gemma's norms, (1 + weight) in fp32, one rounding.
int pb_cpu_add_rms_norm(const void* x, int64_t x_stride, const void* x_weight, float x_scale, void* residual,
                        int64_t r_stride, const void* weight, void* out, int64_t o_stride, int32_t rows,
                        int32_t hidden, int32_t dtype, float eps, int32_t unit_offset, int32_t num_threads);
enum PbCpuActivation : int32_t { PB_SILU = 0, PB_GELU_TANH = 1 };
int pb_cpu_act_mul(const void* gate, int64_t g_stride, const void* up, int64_t u_stride, void* out, int64_t o_stride,
                   int32_t rows, int32_t width, int32_t dtype, int32_t activation, int32_t num_threads);
int32_t pb_cpu_panel_linear(const void* x, int64_t x_stride, const void* packed, const void* bias, void* y,
                            int64_t y_stride, int64_t m, int64_t n, int64_t k, int32_t dtype, int32_t num_threads);
int32_t pb_cpu_panel_linear_quantized(const void* x, int64_t x_stride, const void* packed, int32_t bits,
                                      const float* scales, int64_t group_size, int32_t offsets, const float* levels,
                                      const void* bias, void* y, int64_t y_stride, int64_t m, int64_t n, int64_t k,
                                      int32_t dtype, int32_t num_threads);
// AMX tiles for the bf16 panel linear and bf16 decode attention: 1 on (where granted), 0 off, -1 asks (amx_cpu.cpp)
int32_t pb_cpu_amx(int32_t use);

}  // extern "C"
