// amp/optim/detail/lowbit_block.h: the fused low-bit step's scalar kernel:
// one parameter's blocks, first the moments and the update element by
// element, then each block requantized (optim/detail/lowbit_fused_step.h
// runs it; lowbit_simd*.h have its vector twins).
//
//   amp::detail::lowbit::adam_blocks(k, param, grad, m, v, vmax, rand16, b0, b1, buffer,
//                                    QuantizePortable{}, NoVectorPass{});
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "amp/detail/compat_float8.h"
#include "amp/optim/detail/lowbit_codec.h"
#include "amp/optim/detail/lowbit_rounding.h"
#include "amp/optim/detail/lowbit_threshold.h"
#include "amp/optim/state_format.h"

namespace amp {
namespace detail {
namespace lowbit {

// One moment's quantized storage, raw (CPU, contiguous).
struct MomentRef {
  StateFormat format = StateFormat::kFloat;
  const float* map = nullptr;  // 8-/4-bit lookup table
  int64_t levels = 0;
  uint8_t* codes = nullptr;               // 8-bit: one per element; 4-bit: two per byte; fp8: e4m3fn bytes
  float* scale = nullptr;                 // one per block
  float* values = nullptr;                // kFloat: the plain fp32 moment
  bool ascending = false;                 // map strictly ascending: the vector searches apply
  const float* columns = nullptr;         // the map as 17 columns of 16 (map_columns), for the AVX-512 search
  const ThresholdTable* table = nullptr;  // torchao's map's thresholds (lowbit_threshold.h), for the vector searches
};

// columns[16 j + h] = m[16 h + j] (j < 16), columns[256 + h] = m[min(16 (h + 1), levels - 1)]; rows past
// the map's are 0. 272 floats, 64-byte aligned.
inline void map_columns(const float* m, int64_t levels, float* columns) {
  const int64_t rows = levels / 16;
  for (int64_t h = 0; h < 16; ++h) {
    for (int64_t j = 0; j < 16; ++j) columns[16 * j + h] = h < rows ? m[16 * h + j] : 0.f;
    columns[256 + h] = h < rows ? m[std::min<int64_t>(16 * (h + 1), levels - 1)] : 0.f;
  }
}

inline bool strictly_ascending(const float* m, int64_t n) {
  for (int64_t i = 1; i < n; ++i)
    if (!(m[i - 1] < m[i])) return false;
  return true;
}

// The per-parameter constants, each rounded to fp32 as the tensor-op path
// rounds it (computed there with the same ATen ops).
struct FusedAdam {
  float lr = 0, lr_wd = 0, wd = 0;  // lr; AdamW: fp32(lr) * fp32(wd); Adam: fp32(wd)
  float w1 = 0, w2 = 0;             // lerp weights 1 - beta1, 1 - beta2
  float bias_correction1 = 1, bias_correction2_sqrt = 1, eps = 0;
  float inv_scale = 1;
  bool unscale = false, adamw = true, amsgrad = false;
  LerpRounding lerp = LerpRounding::kFma;
  float maximum_nan = 0;  // at::maximum's NaN
  int64_t block_size = 0;
  int64_t numel = 0;  // plain states: the last block may be shorter
};

C10_ALWAYS_INLINE void quantize_moment_block(const float* x, int64_t n, const MomentRef& q, int64_t block) {
  const int64_t block_bytes = q.format == StateFormat::kInt4 ? n / 2 : n;
  quantize_block(x, n, q.format, q.map, q.levels, q.codes + block * block_bytes, q.scale + block);
}

// torchao's dequantize() of element i: map[code] * scale, or fp8 * scale.
C10_ALWAYS_INLINE float dequantized(const MomentRef& q, int64_t i, float scale) {
  if (q.format == StateFormat::kFloat) return q.values[i];
  if (q.format == StateFormat::kInt8) return rounded(q.map[q.codes[i]] * scale);
  if (q.format == StateFormat::kInt4)
    return rounded(q.map[i % 2 == 0 ? q.codes[i / 2] >> 4 : q.codes[i / 2] & 15] * scale);
#if AMP_DETAIL_HAS_FLOAT8_DTYPE
  return rounded(static_cast<float>(c10::Float8_e4m3fn(q.codes[i], c10::Float8_e4m3fn::from_bits())) * scale);
#else
  return 0.f;  // no fp8 states without the dtype (LowBitAdam refuses them)
#endif
}

C10_ALWAYS_INLINE float to_float(float v) { return v; }
C10_ALWAYS_INLINE float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// Blocks [b0, b1) of one parameter. P: float or c10::BFloat16 (parameter and
// gradient). rand16: torchao's 16 random bits per element for bf16
// stochastic rounding, or null. buffer: 3 * block_size floats. quantize: a
// block's values to its scale and codes (quantize_moment_block or a vector twin).
template <typename P, typename Quantize, typename Pass>
C10_ALWAYS_INLINE void adam_blocks(const FusedAdam& k, P* param, P* grad, const MomentRef& m, const MomentRef& v,
                                   const MomentRef& vmax, const int32_t* rand16, int64_t b0, int64_t b1, float* buffer,
                                   Quantize quantize, Pass vector_pass) {
  const int64_t bs = k.block_size;
  float* m_new = buffer;
  float* v_new = buffer + bs;
  float* vmax_new = buffer + 2 * bs;
  const bool plain = m.format == StateFormat::kFloat;  // all three moments are, or none
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n = std::min(bs, k.numel - b * bs);
    const float m_scale = plain ? 0.f : m.scale[b], v_scale = plain ? 0.f : v.scale[b];
    const float vmax_scale = k.amsgrad && !plain ? vmax.scale[b] : 0.f;
    float clipped[3];  // the vector pass's clipped absmax of each new moment
    const bool done = !plain && vector_pass(k, param, grad, m, v, vmax, rand16, b, m_new, v_new, vmax_new, clipped);
    for (int64_t j = 0; j < n && !done; ++j) {
      const int64_t i = b * bs + j;
      float g = to_float(grad[i]);
      if (k.unscale) {  // grad.mul_(inv_scale), in the gradient's dtype
        grad[i] = static_cast<P>(rounded(g * k.inv_scale));
        g = to_float(grad[i]);
      }
      float p = to_float(param[i]);
      if (k.adamw) {
        const float decay = rounded(p * k.lr_wd);
        p = p - decay;
      } else {
        const float decay = rounded(p * k.wd);
        g = decay + g;
      }
      const float mv = lerp_as(k.lerp, dequantized(m, i, m_scale), g, k.w1);
      const float g2 = rounded(g * g);
      const float vv = lerp_as(k.lerp, dequantized(v, i, v_scale), g2, k.w2);
      float denom;
      if (k.amsgrad) {
        const float old = dequantized(vmax, i, vmax_scale);
        const float mx = std::isnan(old) || std::isnan(vv) ? k.maximum_nan : (old > vv ? old : vv);  // at::maximum
        vmax_new[j] = mx;
        denom = std::sqrt(mx);
      } else {
        denom = std::sqrt(vv);
      }
      denom = denom / k.bias_correction2_sqrt;
      denom = denom + k.eps;
      float update = mv / k.bias_correction1;
      update = rounded(update * k.lr);
      update = update / denom;
      p = p - update;
      m_new[j] = mv;
      v_new[j] = vv;
      if (rand16 != nullptr) {  // torchao's _fp32_to_bf16_sr
        uint32_t bits;
        std::memcpy(&bits, &p, 4);
        const uint32_t towards_zero = bits & 0xFFFF0000u;
        const uint32_t rounded = static_cast<int32_t>(rand16[i]) < static_cast<int32_t>(bits & 0xFFFFu)
                                     ? towards_zero + 0x10000u
                                     : towards_zero;
        float r;
        std::memcpy(&r, &rounded, 4);
        param[i] = static_cast<P>(r);
      } else {
        param[i] = static_cast<P>(p);
      }
    }
    if (plain) {  // assign_ of a plain state: the values as they are
      std::memcpy(m.values + b * bs, m_new, static_cast<size_t>(n) * sizeof(float));
      std::memcpy(v.values + b * bs, v_new, static_cast<size_t>(n) * sizeof(float));
      if (k.amsgrad) std::memcpy(vmax.values + b * bs, vmax_new, static_cast<size_t>(n) * sizeof(float));
      continue;
    }
    quantize.pair(m_new, v_new, bs, m, v, b, done ? clipped : nullptr);
    if (k.amsgrad) quantize(vmax_new, bs, vmax, b, done ? clipped + 2 : nullptr);
  }
}

// A block's first pass in vector code (the new moments and each one's
// clipped absmax), or false (then the scalar loop runs).
struct NoVectorPass {
  template <typename P>
  bool operator()(const FusedAdam&, P*, P*, const MomentRef&, const MomentRef&, const MomentRef&, const int32_t*,
                  int64_t, float*, float*, float*, float*) const {
    return false;
  }
};

// A block's new moment to its scale and codes; `clipped`: its clipped absmax
// when the first pass found it (null: found here). pair(): m and v.
struct QuantizePortable {
  void operator()(const float* x, int64_t n, const MomentRef& q, int64_t block, const float*) const {
    quantize_moment_block(x, n, q, block);
  }
  void pair(const float* m_new, const float* v_new, int64_t n, const MomentRef& m, const MomentRef& v, int64_t block,
            const float*) const {
    quantize_moment_block(m_new, n, m, block);
    quantize_moment_block(v_new, n, v, block);
  }
};

template <typename P>
void adam_blocks_portable(const FusedAdam& k, P* param, P* grad, const MomentRef& m, const MomentRef& v,
                          const MomentRef& vmax, const int32_t* rand16, int64_t b0, int64_t b1, float* buffer) {
  adam_blocks(k, param, grad, m, v, vmax, rand16, b0, b1, buffer, QuantizePortable{}, NoVectorPass{});
}

}  // namespace lowbit
}  // namespace detail
}  // namespace amp
