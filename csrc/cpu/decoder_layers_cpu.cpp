// A step's decoder layers in one call: the loop of worker/fused_forward.py over a Llama-family stack, run here.
//
// Per layer it calls the same kernels as the Python loop, in the same order, on the same buffers and with the same
// arguments, so its output is bitwise the Python loop's:
//
//   qkv = x @ Wqkv^T; q = rotary(q), rotary(k) and v -> pool (q and k heads normed first where the layer has
//   q/k norms, no rotary on NoPE layers); o = attention(q) @ Wo^T
//   x = add_rms_norm(o, residual); out = act_mul(x @ Wgate_up^T) @ Wdown^T; x = add_rms_norm(out, residual) (next)
//   (Gemma: o and out RMS-normed before their residual adds, inside add_rms_norm; GELU-tanh for SiLU)
//
// What it saves is Python: ~7 us per kernel call from ctypes, eight calls per layer. A deep, narrow model pays that
// 240 times per token at one stream, 1.5-2 ms of a ~11 ms bf16 token on a 2-core host. The caller polls `stop`
// between layers (a step cut for a request that outranks it), as the Python loop does.

#include <cstdint>

#include "kernels.h"

extern "C" {

// How a layer's panel is quantized, as pb_cpu_panel_linear_quantized takes it; `scales` null: a float panel. Each of
// a layer's panels has its own (GGUF files mix kinds in a layer: Q4_K_M's down is Q4_K or Q6_K beside Q5_0).
struct PbCpuPanelQuant {
  const float* scales;
  int32_t bits;  // 8: pb_cpu_panel_pack_int8; 4: pb_cpu_panel_pack_int4
  int32_t group_size;  // weights along K per group (0: one group)
  int32_t offsets;  // 1: each group's scales followed by its offsets
  const float* levels;  // int4: the 16 values of a 4-bit q (IQ4's levels); null: 0 to 15
};

// One of a layer's panels: `outputs` columns of its linear's output, from the column the slots before it end at.
struct PbCpuLayerPanel {
  const void* panels;  // null: an unused slot (and the slots after it)
  const void* bias;  // or null
  PbCpuPanelQuant quant;
  int64_t outputs;
};

struct PbCpuDecoderLayer {
  // q, k and v: [q_size + 2 kv_size] outputs of `hidden` inputs, stacked in qkv[0], or a panel each where their
  // kinds do not stack (Q4_K_M's Q4_K q and k beside a Q6_K v)
  PbCpuLayerPanel qkv[3];
  PbCpuLayerPanel o;  // [hidden] outputs of q_size inputs
  PbCpuLayerPanel gate_up[2];  // gate and up: [2 intermediate] outputs of `hidden` inputs, likewise
  PbCpuLayerPanel down;  // [hidden] outputs of `intermediate` inputs
  const void* attention_norm;  // input_layernorm's weight
  const void* mlp_norm;        // the norm before the MLP: post_attention_layernorm's (Gemma: pre_feedforward_...)
  float attention_eps, mlp_eps;
  void* key_cache;  // this layer's pools [N, block_size, Hkv, D]
  void* value_cache;
  int64_t k_stride_block, k_stride_slot, k_stride_head;
  int64_t v_stride_block, v_stride_slot, v_stride_head;
  int32_t group;  // which of the step's rotary/attention arguments (its window group's tables and slots)
  int32_t sliding_window;  // 0: off
  const void* q_norm;  // or null: per-head RMSNorm weights applied before rotary (Qwen3)
  const void* k_norm;
  float q_norm_eps, k_norm_eps;
  int32_t skip_rotary;  // 1: a NoPE layer (SmolLM3)
  const void* post_attention_norm;  // or null: Gemma's norm of the attention output before its residual add
  const void* post_mlp_norm;        // or null: likewise for the MLP output
  int32_t unit_offset;              // Gemma's norms: (1 + weight) in fp32, one rounding (q/k norms too)
  int32_t activation;               // PbCpuActivation of the MLP's gate
  float residual_scale;             // Granite's residual multiplier on each branch's output (1: none)
  float k_scale, v_scale;           // an fp8 pool's scales for this layer (RotaryCacheArgs, PbCpuAttentionArgs)
};

struct PbCpuDecoderStep {
  const PbCpuDecoderLayer* layers;
  int32_t num_layers;
  const RotaryCacheArgs* rotary;  // per group: the step's cos/sin, slots and shapes (the loop sets the tensors)
  const PbCpuAttentionArgs* attention;  // per group: the step's tables, lengths and shapes
  void* residual;  // [T, hidden]: the embeddings in; out: the residual before the last layer's MLP is added
  void* x;  // [T, hidden]: the first layer's normed input in; then scratch
  void* qkv;  // [T, q_size + 2 kv_size] scratch
  void* query;  // [T, q_size] scratch: rotated queries
  void* attention_out;  // [T, q_size] scratch
  void* o;  // [T, hidden] scratch
  void* gate_up;  // [T, 2 intermediate] scratch
  void* act;  // [T, intermediate] scratch
  void* out;  // [T, hidden] out: the last layer's MLP output
  int64_t tokens, hidden, q_size, kv_size, intermediate, head_dim;
  int32_t dtype;  // PB_F32 or PB_BF16 (the panel kernel's)
  int32_t num_threads;
  int32_t (*stop)();  // or null: polled before each layer; nonzero stops the step
  int32_t failed;  // out: which kernel returned the status (PbCpuLayerKernel)
};

}  // extern "C"

namespace {

// The layer's pools into a kernel's arguments (the rotary and attention structs name these fields alike).
template <typename Args>
void point_at_pools(Args& args, const PbCpuDecoderLayer& layer) {
  args.key_cache = layer.key_cache;
  args.value_cache = layer.value_cache;
  args.k_stride_block = layer.k_stride_block, args.k_stride_slot = layer.k_stride_slot;
  args.k_stride_head = layer.k_stride_head;
  args.v_stride_block = layer.v_stride_block, args.v_stride_slot = layer.v_stride_slot;
  args.v_stride_head = layer.v_stride_head;
}

}  // namespace

extern "C" {

enum PbCpuLayerKernel : int32_t { PB_LINEAR = 1, PB_ROTARY = 2, PB_ATTENTION = 3, PB_NORM = 4, PB_ACT_MUL = 5 };
constexpr int32_t kStopped = 1;  // pb_cpu_decoder_layers: the step stopped before a layer
constexpr int32_t kPanelBadShape = 2;  // pb_cpu_panel_linear's BAD_SHAPE status, for parts that miss the width

uint64_t pb_cpu_decoder_layer_size() { return sizeof(PbCpuDecoderLayer); }
uint64_t pb_cpu_decoder_step_size() { return sizeof(PbCpuDecoderStep); }

// 0 when every layer ran; 1 when `stop` stopped the step; else the failing kernel's status, with `failed` set.
int32_t pb_cpu_decoder_layers(PbCpuDecoderStep* step) {
  PbCpuDecoderStep& s = *step;
  if (s.head_dim <= 0 || s.q_size % s.head_dim != 0 || s.kv_size % s.head_dim != 0) {
    s.failed = PB_ROTARY;  // its "bad shape" names head_dim
    return -2;
  }
  const int64_t t = s.tokens, h = s.hidden, qkv_width = s.q_size + 2 * s.kv_size, inter = s.intermediate;
  const int64_t element = s.dtype == PB_F32 ? 4 : 2;
  char* const qkv = static_cast<char*>(s.qkv);
  char* const gate_up = static_cast<char*>(s.gate_up);
  const int32_t rows = static_cast<int32_t>(t), threads = s.num_threads;
  int32_t status = 0;
  auto failed = [&](int32_t code, PbCpuLayerKernel kernel) {
    status = code;
    if (code != 0) s.failed = kernel;
    return code != 0;
  };
  for (int32_t i = 0; i < s.num_layers; ++i) {
    if (s.stop != nullptr && s.stop() != 0) return kStopped;
    const PbCpuDecoderLayer& layer = s.layers[i];
    // y [t, width] = x [t, k] times `slots` of the layer's panels side by side, each float or quantized
    auto linear = [&](const void* x, int64_t x_stride, const PbCpuLayerPanel* parts, int slots, char* y,
                      int64_t width, int64_t k) {
      int64_t column = 0;
      for (int j = 0; j < slots && parts[j].panels != nullptr; ++j) {
        const PbCpuLayerPanel& part = parts[j];
        const PbCpuPanelQuant& quant = part.quant;
        char* out = y + column * element;
        const int32_t code =
            quant.scales == nullptr
                ? pb_cpu_panel_linear(x, x_stride, part.panels, part.bias, out, width, t, part.outputs, k, s.dtype,
                                      threads)
                : pb_cpu_panel_linear_quantized(x, x_stride, part.panels, quant.bits, quant.scales, quant.group_size,
                                                quant.offsets, quant.levels, part.bias, out, width, t, part.outputs,
                                                k, s.dtype, threads);
        if (code != 0) return code;
        column += part.outputs;
      }
      return column == width ? 0 : kPanelBadShape;  // the parts must fill the output
    };
    if (failed(linear(s.x, h, layer.qkv, 3, qkv, qkv_width, h), PB_LINEAR)) return status;

    RotaryCacheArgs rotary = s.rotary[layer.group];
    rotary.query = qkv;
    rotary.key = qkv + s.q_size * element;
    rotary.value = qkv + (s.q_size + s.kv_size) * element;
    rotary.q_stride = rotary.k_stride = rotary.v_stride = qkv_width;
    rotary.query_out = s.query;
    point_at_pools(rotary, layer);
    rotary.num_q_heads = static_cast<int32_t>(s.q_size / s.head_dim);
    rotary.num_kv_heads = static_cast<int32_t>(s.kv_size / s.head_dim);
    rotary.q_norm = layer.q_norm, rotary.k_norm = layer.k_norm;
    rotary.q_norm_eps = layer.q_norm_eps, rotary.k_norm_eps = layer.k_norm_eps;
    rotary.skip_rotary = layer.skip_rotary;
    rotary.unit_offset = layer.unit_offset;
    rotary.k_scale = layer.k_scale, rotary.v_scale = layer.v_scale;
    if (failed(pb_cpu_rotary_cache(&rotary, s.dtype), PB_ROTARY)) return status;

    PbCpuAttentionArgs attention = s.attention[layer.group];
    attention.query = s.query;
    attention.out = s.attention_out;
    attention.q_stride_token = attention.o_stride_token = s.q_size;
    attention.q_stride_head = attention.o_stride_head = s.head_dim;
    point_at_pools(attention, layer);
    attention.sliding_window = layer.sliding_window;
    attention.k_scale = layer.k_scale, attention.v_scale = layer.v_scale;
    if (failed(pb_cpu_paged_attention(&attention), PB_ATTENTION)) return status;

    if (failed(linear(s.attention_out, s.q_size, &layer.o, 1, static_cast<char*>(s.o), h, s.q_size), PB_LINEAR) ||
        failed(pb_cpu_add_rms_norm(s.o, h, layer.post_attention_norm, layer.residual_scale, s.residual, h,
                                   layer.mlp_norm, s.x, h, rows, static_cast<int32_t>(h), s.dtype, layer.mlp_eps,
                                   layer.unit_offset, threads),
               PB_NORM) ||
        failed(linear(s.x, h, layer.gate_up, 2, gate_up, 2 * inter, h), PB_LINEAR) ||
        failed(pb_cpu_act_mul(gate_up, 2 * inter, gate_up + inter * element, 2 * inter, s.act, inter, rows,
                              static_cast<int32_t>(inter), s.dtype, layer.activation, threads), PB_ACT_MUL) ||
        failed(linear(s.act, inter, &layer.down, 1, static_cast<char*>(s.out), h, inter), PB_LINEAR))
      return status;
    if (i + 1 < s.num_layers) {
      const PbCpuDecoderLayer& next = s.layers[i + 1];
      if (failed(pb_cpu_add_rms_norm(s.out, h, layer.post_mlp_norm, layer.residual_scale, s.residual, h,
                                     next.attention_norm, s.x, h, rows, static_cast<int32_t>(h), s.dtype,
                                     next.attention_eps, next.unit_offset, threads),
                 PB_NORM))
        return status;
    }
  }
  return 0;
}

}  // extern "C"
