// Fused CPU kernels for the non-matmul part of a Llama-family decoder layer, so that one decode step costs
// what its math costs: each fusion reads its inputs once and writes its outputs once, where torch runs three
// to six ops with an intermediate tensor each and a dispatch each.
//
//   add_rms_norm:  residual += x (optional; Gemma: x RMS-normed first; Granite: x scaled), out = weight *
//                  rms_normalize(residual)
//                  (Gemma: (1 + weight), in fp32)
//   rotary_cache:  rotary on q (written to a [T, Hq, D] buffer) and on k, then k and v stored into the pool;
//                  optionally each q and k head RMS-normed first (Qwen3's q_norm and k_norm), rotary on the
//                  leading dims of each head only (Phi-4-mini's partial rotary), or none (SmolLM3's NoPE layers)
//   act_mul:       out = act(gate) * up, act SiLU or (Gemma) GELU with the tanh approximation
//
// Rounding follows transformers' modules step by step (fp32 statistics in RMSNorm, each bf16/fp16 op
// rounded back to its dtype), so outputs agree with theirs up to summation order and fused multiply-adds.
// Every row is computed on its own with the same code whatever the row count, so results do not depend on
// the batch. Plain C ABI like paged_attention_cpu.cpp; paged_backend/ops/fused_cpu.py mirrors it.

#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "fp8.h"
#include "kernels.h"
#include "vector_exp.h"

namespace {

enum Dtype : int32_t { F32 = 0, F16 = 1, BF16 = 2 };

inline float from_bf16(uint16_t half) {
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint16_t to_bf16(float v) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;                // NaN stays NaN
  return static_cast<uint16_t>(nan ? (bits >> 16) | 0x40u : rounded);  // a select, so loops vectorize
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const _Float16* p, int64_t i) { return static_cast<float>(p[i]); }
inline float load(const uint16_t* p, int64_t i) { return from_bf16(p[i]); }

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(_Float16* p, int64_t i, float v) { p[i] = static_cast<_Float16>(v); }
inline void store(uint16_t* p, int64_t i, float v) { p[i] = to_bf16(v); }

// The value a float takes once stored in T and read back: one rounding, as a torch op in T does. In registers:
// a round trip through a one-element array kept every loop that rounds (the norms' outputs) from vectorizing.
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}
template <>
inline float round_to<uint16_t>(float v) {
  return from_bf16(to_bf16(v));
}

// Threads only when the work pays for waking them: one decode row (a few microseconds) stays on one core, 16 rows
// split (silu_mul at 16 x 1536: 22.7 -> 14.5 us per call through the Python wrapper, 2 threads; 4096 elements
// are already no slower split).
inline int threads_for(int64_t elements, int32_t num_threads) {
  return elements >= (int64_t{1} << 12) ? num_threads : 1;
}

// One RMSNorm'd element, as the model's norm module rounds it: Llama's rounds the normalized value to T, then
// multiplies by the weight in T; Gemma's (`unit_offset`) keeps fp32 through the scale by (1 + weight) and rounds once.
template <typename T, bool UnitOffset>
inline float normed(float value, float inv, float weight) {
  return UnitOffset ? round_to<T>(value * inv * (1.0f + weight)) : round_to<T>(weight * round_to<T>(value * inv));
}

// out = the RMSNorm'd row x (`inv`: its inverse RMS), plus `base` where given (Gemma's post-norms, added to the
// residual). out may be base; nothing else overlaps. Branch-free loops, so that they vectorize: with the norm's kind
// tested per element they stayed scalar, ~7% of a 16-row bf16 step.
template <typename T, bool UnitOffset>
inline void norm_row(const T* x, float inv, const T* weight, const T* base, T* out, int32_t n) {
  if (base == nullptr) {
#pragma omp simd
    for (int32_t i = 0; i < n; ++i) store(out, i, normed<T, UnitOffset>(load(x, i), inv, load(weight, i)));
  } else {
#pragma omp simd
    for (int32_t i = 0; i < n; ++i)
      store(out, i, load(base, i) + normed<T, UnitOffset>(load(x, i), inv, load(weight, i)));
  }
}

template <typename T>
inline void norm_row(const T* x, float inv, const T* weight, const T* base, T* out, int32_t n, bool unit_offset) {
  if (unit_offset)
    norm_row<T, true>(x, inv, weight, base, out, n);
  else
    norm_row<T, false>(x, inv, weight, base, out, n);
}

// x * scale rounded on its own, as torch's separate multiply before its add: an empty asm keeps GCC from fusing the
// two into one FMA, which rounds once (fp32 results would then differ from torch's in the last bit).
inline float separate_product(float x, float scale) {
  float product = x * scale;
#if defined(__x86_64__)
  asm("" : "+x"(product));
#else
  volatile float held = product;
  product = held;
#endif
  return product;
}

template <typename T>
inline float inverse_rms(const T* row, int32_t hidden, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)  // a fixed vector order per hidden size, the same for every row
  for (int32_t i = 0; i < hidden; ++i) {
    const float v = load(row, i);
    sum += v * v;
  }
  return 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
}

template <typename T>
void add_rms_norm(const T* x, int64_t x_stride, const T* x_weight, float x_scale, T* residual, int64_t r_stride,
                  const T* weight, T* out, int64_t o_stride, int32_t rows, int32_t hidden, float eps,
                  bool unit_offset, int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(int64_t{rows} * hidden, num_threads))
  for (int32_t r = 0; r < rows; ++r) {
    T* res = residual + r * r_stride;
    if (x != nullptr) {
      const T* in = x + r * x_stride;
      if (x_weight != nullptr) {  // Gemma's post-norms: the branch's output is normed before the residual add
        norm_row(in, inverse_rms(in, hidden, eps), x_weight, res, res, hidden, unit_offset);
      } else if (x_scale != 1.0f) {  // Granite's residual multiplier, the product rounded as torch's op is
        for (int32_t i = 0; i < hidden; ++i)
          store(res, i, load(res, i) + round_to<T>(separate_product(load(in, i), x_scale)));
      } else {
#pragma omp simd  // x, residual and out never overlap
        for (int32_t i = 0; i < hidden; ++i) store(res, i, load(res, i) + load(in, i));
      }
    }
    norm_row(res, inverse_rms(res, hidden, eps), weight, static_cast<const T*>(nullptr), out + r * o_stride, hidden,
             unit_offset);
  }
}

template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, int32_t half, T* y) {
  // transformers: x * cos + rotate_half(x) * sin, each op rounded to T. y never overlaps x, cos or sin: the simd
  // pragma says so, without which GCC left this loop scalar (a third of the fused ops' time at 16 decode rows).
#pragma omp simd
  for (int32_t i = 0; i < half; ++i) {
    const float a = load(x, i), b = load(x, i + half);
    store(y, i, round_to<T>(a * load(cos, i)) + round_to<T>(-b * load(sin, i)));
    store(y, i + half, round_to<T>(b * load(cos, i + half)) + round_to<T>(a * load(sin, i + half)));
  }
}

// RMSNorm of one head `x [d]` into `scratch`, as the model's norm module (see `normed`). Without a weight, `x` itself.
template <typename T>
inline const T* norm_head(const T* x, const void* weight, float eps, bool unit_offset, int32_t d, T* scratch) {
  if (weight == nullptr) return x;
  const T* w = static_cast<const T*>(weight);
  norm_row(x, inverse_rms(x, d, eps), w, static_cast<const T*>(nullptr), scratch, d, unit_offset);
  return scratch;
}

// A head into the output: its first `rotary_dim` dims rotated and the rest copied (partial rotary), or all of it
// copied on a NoPE layer (rotary_dim 0).
template <typename T>
inline void place(const T* x, const T* cos, const T* sin, int32_t d, int32_t rotary_dim, T* y) {
  if (rotary_dim > 0) rotate(x, cos, sin, rotary_dim / 2, y);
  if (rotary_dim < d) std::memcpy(y + rotary_dim, x + rotary_dim, sizeof(T) * (d - rotary_dim));
}

template <typename T>
void rotary_cache(const RotaryCacheArgs& a) {
  const bool fp8 = is_fp8(a.kv_dtype);
  const int32_t d = a.head_dim, rotary_width = a.rotary_dim > 0 ? a.rotary_dim : d;
  const int32_t rotary_dim = a.skip_rotary != 0 ? 0 : rotary_width;
  const int64_t work = int64_t{a.num_tokens} * (a.num_q_heads + 2 * a.num_kv_heads) * d;
#pragma omp parallel for schedule(static) num_threads(threads_for(work, a.num_threads))
  for (int32_t t = 0; t < a.num_tokens; ++t) {
    const T* cos = static_cast<const T*>(a.cos) + int64_t{t} * rotary_width;
    const T* sin = static_cast<const T*>(a.sin) + int64_t{t} * rotary_width;
    const T* q = static_cast<const T*>(a.query) + t * a.q_stride;
    T* q_out = static_cast<T*>(a.query_out) + int64_t{t} * a.num_q_heads * d;
    T staged[kMaxNormedHeadDim];
    for (int32_t h = 0; h < a.num_q_heads; ++h)
      place(norm_head(q + int64_t{h} * d, a.q_norm, a.q_norm_eps, a.unit_offset != 0, d, staged), cos, sin, d,
            rotary_dim, q_out + int64_t{h} * d);
    const int64_t slot = a.slot_mapping[t];
    if (slot < 0) continue;
    const int64_t block = slot / a.block_size, offset = slot % a.block_size;
    const int64_t k_at = block * a.k_stride_block + offset * a.k_stride_slot;
    const int64_t v_at = block * a.v_stride_block + offset * a.v_stride_slot;
    const T* k = static_cast<const T*>(a.key) + t * a.k_stride;
    const T* v = static_cast<const T*>(a.value) + t * a.v_stride;
    for (int32_t h = 0; h < a.num_kv_heads; ++h) {
      const T* k_head = norm_head(k + int64_t{h} * d, a.k_norm, a.k_norm_eps, a.unit_offset != 0, d, staged);
      const T* v_head = v + int64_t{h} * d;
      if (fp8) {  // rotated in the activations' dtype, as transformers' forward gives the keys, then stored scaled
        T rotated[kMaxNormedHeadDim];
        place(k_head, cos, sin, d, rotary_dim, rotated);
        uint8_t* k_dst = static_cast<uint8_t*>(a.key_cache) + k_at + h * a.k_stride_head;
        uint8_t* v_dst = static_cast<uint8_t*>(a.value_cache) + v_at + h * a.v_stride_head;
        const auto k_elem = [&](int i) { return load(rotated, i); };
        const auto v_elem = [&](int i) { return load(v_head, i); };
        if (a.kv_dtype == PB_FP8_E4M3) {
          fp8_store_row<PB_FP8_E4M3>(k_elem, d, a.k_scale, k_dst);
          fp8_store_row<PB_FP8_E4M3>(v_elem, d, a.v_scale, v_dst);
        } else {
          fp8_store_row<PB_FP8_E5M2>(k_elem, d, a.k_scale, k_dst);
          fp8_store_row<PB_FP8_E5M2>(v_elem, d, a.v_scale, v_dst);
        }
        continue;
      }
      place(k_head, cos, sin, d, rotary_dim, static_cast<T*>(a.key_cache) + k_at + h * a.k_stride_head);
      std::memcpy(static_cast<T*>(a.value_cache) + v_at + h * a.v_stride_head, v_head, sizeof(T) * d);
    }
  }
}

// GELU, tanh approximation (Gemma's gelu_pytorch_tanh): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), with
// tanh(y) = 1 - 2 / (1 + e^{2y}) on the vectorizable exp.
inline float gelu_tanh(float x) {
  const float y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const float two_y = 2.0f * y < -87.0f ? -87.0f : (2.0f * y > 88.0f ? 88.0f : 2.0f * y);
  return 0.5f * x * (2.0f - 2.0f / (1.0f + exp_in_range(two_y)));
}

template <typename T>
void act_mul(const T* gate, int64_t g_stride, const T* up, int64_t u_stride, T* out, int64_t o_stride,
             int32_t rows, int32_t width, int32_t activation, int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(int64_t{rows} * width, num_threads))
  for (int32_t r = 0; r < rows; ++r) {
    const T* g = gate + r * g_stride;
    const T* u = up + r * u_stride;
    T* o = out + r * o_stride;
    if (activation == PB_GELU_TANH) {
#pragma omp simd
      for (int32_t i = 0; i < width; ++i) store(o, i, round_to<T>(gelu_tanh(load(g, i))) * load(u, i));
      continue;
    }
#pragma omp simd
    for (int32_t i = 0; i < width; ++i) {
      const float x = load(g, i);
      // A plain clamp, not std::fmin/fmax: GCC does not vectorize those, and a NaN gate stays NaN as in torch.
      const float minus_x = -x < -87.0f ? -87.0f : (-x > 88.0f ? 88.0f : -x);
      store(o, i, round_to<T>(x / (1.0f + exp_in_range(minus_x))) * load(u, i));
    }
  }
}

}  // namespace

extern "C" {

uint64_t pb_cpu_rotary_cache_args_size() { return sizeof(RotaryCacheArgs); }

// Status codes: 0 ok, -1 unsupported dtype, -2 bad shape.
int pb_cpu_add_rms_norm(const void* x, int64_t x_stride, const void* x_weight, float x_scale, void* residual,
                        int64_t r_stride, const void* weight, void* out, int64_t o_stride, int32_t rows,
                        int32_t hidden, int32_t dtype, float eps, int32_t unit_offset, int32_t num_threads) {
  if (rows < 0 || hidden <= 0) return -2;
  switch (dtype) {
    case F32:
      add_rms_norm(static_cast<const float*>(x), x_stride, static_cast<const float*>(x_weight), x_scale,
                   static_cast<float*>(residual), r_stride, static_cast<const float*>(weight), static_cast<float*>(out),
                   o_stride, rows, hidden, eps, unit_offset != 0, num_threads);
      return 0;
    case F16:
      add_rms_norm(static_cast<const _Float16*>(x), x_stride, static_cast<const _Float16*>(x_weight), x_scale,
                   static_cast<_Float16*>(residual), r_stride, static_cast<const _Float16*>(weight),
                   static_cast<_Float16*>(out), o_stride, rows, hidden, eps, unit_offset != 0, num_threads);
      return 0;
    case BF16:
      add_rms_norm(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(x_weight), x_scale,
                   static_cast<uint16_t*>(residual), r_stride, static_cast<const uint16_t*>(weight),
                   static_cast<uint16_t*>(out), o_stride, rows, hidden, eps, unit_offset != 0, num_threads);
      return 0;
    default:
      return -1;
  }
}

int pb_cpu_rotary_cache(const RotaryCacheArgs* args, int32_t dtype) {
  if (args->head_dim <= 0 || args->head_dim % 2 != 0 || args->block_size <= 0) return -2;
  if (args->rotary_dim < 0 || args->rotary_dim % 2 != 0 || args->rotary_dim > args->head_dim) return -2;
  const bool fp8 = is_fp8(args->kv_dtype);
  if ((args->q_norm != nullptr || args->k_norm != nullptr || fp8) && args->head_dim > kMaxNormedHeadDim) return -2;
  if (fp8 && !(args->k_scale > 0.0f && args->v_scale > 0.0f)) return -2;
  for (int32_t t = 0; t < args->num_tokens; ++t)  // before any write: a bad slot would land outside the pool
    if (args->slot_mapping[t] >= args->num_slots) return -4;
  switch (dtype) {
    case F32: rotary_cache<float>(*args); return 0;
    case F16: rotary_cache<_Float16>(*args); return 0;
    case BF16: rotary_cache<uint16_t>(*args); return 0;
    default: return -1;
  }
}

int pb_cpu_act_mul(const void* gate, int64_t g_stride, const void* up, int64_t u_stride, void* out, int64_t o_stride,
                   int32_t rows, int32_t width, int32_t dtype, int32_t activation, int32_t num_threads) {
  if (rows < 0 || width <= 0) return -2;
  if (activation != PB_SILU && activation != PB_GELU_TANH) return -3;
  switch (dtype) {
    case F32:
      act_mul(static_cast<const float*>(gate), g_stride, static_cast<const float*>(up), u_stride,
              static_cast<float*>(out), o_stride, rows, width, activation, num_threads);
      return 0;
    case F16:
      act_mul(static_cast<const _Float16*>(gate), g_stride, static_cast<const _Float16*>(up), u_stride,
              static_cast<_Float16*>(out), o_stride, rows, width, activation, num_threads);
      return 0;
    case BF16:
      act_mul(static_cast<const uint16_t*>(gate), g_stride, static_cast<const uint16_t*>(up), u_stride,
              static_cast<uint16_t*>(out), o_stride, rows, width, activation, num_threads);
      return 0;
    default:
      return -1;
  }
}

const char* pb_cpu_fused_error_string(int code) {
  switch (code) {
    case 0: return "ok";
    case -1: return "unsupported dtype code (f32, f16 or bf16)";
    case -3: return "unknown activation code (0 silu, 1 gelu_tanh)";
    case -4: return "cache write: a slot in slot_mapping lies past the pool's last block";
    case -2:
      return "bad shape (rows >= 0, hidden/width > 0, even head_dim, even rotary_dim <= head_dim, block_size > 0, "
             "head_dim <= 512 with q/k norms or an fp8 pool, positive fp8 scales)";
    default: return "unknown error";
  }
}

}  // extern "C"
