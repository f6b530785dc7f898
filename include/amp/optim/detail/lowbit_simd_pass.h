// amp/optim/detail/lowbit_simd_pass.h: the fused low-bit step's first pass
// with AVX-512 (VectorPassAvx512): the scalar loop's arithmetic on 16 fp32 or
// bf16 parameters at a time, the moments' old values gathered, permuted or
// looked up by AVX512-VBMI byte permutes, their new absmax taken in the same
// loop. Each operation rounds as the scalar kernel's (lowbit_block.h).
//
//   const amp::detail::lowbit::VectorPassAvx512 pass{old, vbmi};
//   pass(k, param, grad, m, v, vmax, rand16, b, m_new, v_new, vmax_new, clipped);  // false: the scalar loop runs
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "amp/detail/compat_float8.h"
#include "amp/optim/detail/lowbit_block.h"
#include "amp/optim/detail/lowbit_simd_codes.h"
#include "amp/optim/state_format.h"

namespace amp {
namespace detail {
namespace lowbit {

#if AMP_DETAIL_LOWBIT_X86_CLONES
AMP_DETAIL_LOWBIT_SIMD_WARNINGS_OFF  // lowbit_simd_codes.h says why

    // fp8 codes as fp32 values (c10's conversion), a table for the vector pass.
    inline const float*
    fp8_values() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256, 0.f);
#if AMP_DETAIL_HAS_FLOAT8_DTYPE
    for (int c = 0; c < 256; ++c)
      t[static_cast<size_t>(c)] =
          static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits()));
#endif
    return t;
  }();
  return table.data();
}

#define AMP_DETAIL_LOWBIT_VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi,avx2,fma")))

// A block's n codes (a multiple of 64; 8-bit or fp8) to their fp32 values
// with AVX512-VBMI byte permutes instead of gathers: the 256 values as 4 byte
// planes (ThresholdTable::planes), each plane looked up for 64 codes by two
// vpermt2b over 128 bytes and a blend on the code's top bit, the planes'
// bytes interleaved back into floats (the codes first permuted so that the
// in-lane unpacks give the floats in order).
AMP_DETAIL_LOWBIT_VBMI inline void lookup_block_vbmi(const uint8_t* codes, int64_t n, const uint8_t* planes,
                                                     float* out) {
  alignas(64) static constexpr uint8_t kOrder[64] = {
      0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4,  5,  6,  7,  20, 21,
      22, 23, 36, 37, 38, 39, 52, 53, 54, 55, 8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43,
      56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};  // [16L+4q+r] = 16q+4L+r
  const __m512i order = _mm512_load_si512(kOrder);
  __m512i table[4][4];
  for (int k = 0; k < 4; ++k)
    for (int h = 0; h < 4; ++h) table[k][h] = _mm512_loadu_si512(planes + 256 * k + 64 * h);
  for (int64_t i = 0; i < n; i += 64) {
    const __m512i idx = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + i));
    const __mmask64 high = _mm512_movepi8_mask(idx);
    __m512i byte[4];
    for (int k = 0; k < 4; ++k)
      byte[k] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(table[k][0], idx, table[k][1]),
                                       _mm512_permutex2var_epi8(table[k][2], idx, table[k][3]));
    const __m512i w_lo = _mm512_unpacklo_epi8(byte[0], byte[1]), w_hi = _mm512_unpackhi_epi8(byte[0], byte[1]);
    const __m512i x_lo = _mm512_unpacklo_epi8(byte[2], byte[3]), x_hi = _mm512_unpackhi_epi8(byte[2], byte[3]);
    _mm512_storeu_si512(out + i, _mm512_unpacklo_epi16(w_lo, x_lo));
    _mm512_storeu_si512(out + i + 16, _mm512_unpackhi_epi16(w_lo, x_lo));
    _mm512_storeu_si512(out + i + 32, _mm512_unpacklo_epi16(w_hi, x_hi));
    _mm512_storeu_si512(out + i + 48, _mm512_unpackhi_epi16(w_hi, x_hi));
  }
}

// x as a rounded fp32 vector (rounded()'s twin).
__attribute__((target("avx512f,avx2,fma"))) inline __m512 rounded512(__m512 x) {
  __asm__("" : "+v"(x));
  return x;
}

// Moment q's values at elements [i, i + 16), fp32: the table entry times the block's scale.
__attribute__((target("avx512f,avx2,fma"))) inline __m512 dequantized16(const MomentRef& q, int64_t i, float scale,
                                                                        const float* fp8) {
  __m512i code;
  __m512 value;
  if (q.format == StateFormat::kInt4) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q.codes + i / 2));
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), low = _mm_and_si128(bytes, nibble);
    code = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(high, low));  // element 2k: the high nibble of byte k
    value = _mm512_maskz_permutexvar_ps(0xFFFF, code, _mm512_loadu_ps(q.map));
  } else {
    code = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q.codes + i)));
    value = _mm512_i32gather_ps(code, q.format == StateFormat::kFp8 ? fp8 : q.map, 4);
  }
  return rounded512(_mm512_mul_ps(value, _mm512_set1_ps(scale)));
}

__attribute__((target("avx512f,avx2,fma"))) inline __m512 lerp16(LerpRounding r, __m512 start, __m512 end, float w) {
  const __m512 d = _mm512_sub_ps(end, start);
  if (std::fabs(w) < 0.5f) {
    const __m512 weight = _mm512_set1_ps(w);
    return r == LerpRounding::kFma ? _mm512_fmadd_ps(weight, d, start)
                                   : _mm512_add_ps(start, rounded512(_mm512_mul_ps(weight, d)));
  }
  return r == LerpRounding::kFma ? _mm512_fmadd_ps(_mm512_set1_ps(w - 1.f), d, end)
                                 : _mm512_sub_ps(end, rounded512(_mm512_mul_ps(d, _mm512_set1_ps(1.f - w))));
}

// 16 parameters or gradients as fp32 (bf16 widened: its bits are fp32's high half).
AMP_DETAIL_LOWBIT_AVX512 C10_ALWAYS_INLINE __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
AMP_DETAIL_LOWBIT_AVX512 C10_ALWAYS_INLINE __m512 load16(const c10::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// c10::BFloat16(float)'s bits (round to nearest even, a NaN to 0x7FC0), in the low half of each lane.
AMP_DETAIL_LOWBIT_AVX512 C10_ALWAYS_INLINE __m512i bf16_bits16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i bias =
      _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// static_cast<P>(x) stored; returns the stored value as fp32.
AMP_DETAIL_LOWBIT_AVX512 C10_ALWAYS_INLINE __m512 store16(float* out, __m512 x) {
  _mm512_storeu_ps(out, x);
  return x;
}
AMP_DETAIL_LOWBIT_AVX512 C10_ALWAYS_INLINE __m512 store16(c10::BFloat16* out, __m512 x) {
  const __m512i b = bf16_bits16(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(b));
  return _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
}

// torchao's _fp32_to_bf16_sr on 16 values (adam_blocks' scalar loop): up
// when the random 16 bits are below the low 16 bits, then the bf16 cast.
AMP_DETAIL_LOWBIT_AVX512 C10_ALWAYS_INLINE void store16_stochastic(c10::BFloat16* out, __m512 x, const int32_t* rand) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i towards_zero = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  const __mmask16 up =
      _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF)), _mm512_loadu_si512(rand));
  const __m512i r = _mm512_mask_add_epi32(towards_zero, up, towards_zero, _mm512_set1_epi32(0x10000));
  store16(out, _mm512_castsi512_ps(r));
}
AMP_DETAIL_LOWBIT_AVX512 C10_ALWAYS_INLINE void store16_stochastic(float*, __m512, const int32_t*) {}

// The scalar loop's arithmetic on 16 parameters (fp32 or bf16, with or
// without stochastic rounding) at a time. `vbmi`: m's and
// v's 8-bit/fp8 codes are looked up a block at a time by lookup_block_vbmi
// into `old` (2 block_size floats) instead of gathered.
struct VectorPassAvx512 {
  float* old = nullptr;
  bool vbmi = false;

  // Whether q's block values come from lookup_block_vbmi.
  bool looked_up(const MomentRef& q, int64_t block_size) const {
    return vbmi && q.table != nullptr && q.table->planes.size() == 1024 && q.format != StateFormat::kInt4 &&
           block_size % 64 == 0;
  }

  template <typename P>
  __attribute__((target("avx512f,avx2,fma"))) bool operator()(const FusedAdam& k, P* param, P* grad, const MomentRef& m,
                                                              const MomentRef& v, const MomentRef& vmax,
                                                              const int32_t* rand16, int64_t b, float* m_new,
                                                              float* v_new, float* vmax_new, float* clipped) const {
    if (k.block_size % 16 != 0) return false;
    const float* fp8 = fp8_values();
    const float m_scale = m.scale[b], v_scale = v.scale[b], vmax_scale = k.amsgrad ? vmax.scale[b] : 0.f;
    const bool m_looked_up = looked_up(m, k.block_size), v_looked_up = looked_up(v, k.block_size);
    float* m_old = old;
    float* v_old = old + k.block_size;
    if (m_looked_up) lookup_block_vbmi(m.codes + b * k.block_size, k.block_size, m.table->planes.data(), m_old);
    if (v_looked_up) lookup_block_vbmi(v.codes + b * k.block_size, k.block_size, v.table->planes.data(), v_old);
    const __m512 m_scale16 = _mm512_set1_ps(m_scale), v_scale16 = _mm512_set1_ps(v_scale);
    const __m512 inv_scale = _mm512_set1_ps(k.inv_scale), lr_wd = _mm512_set1_ps(k.lr_wd), wd = _mm512_set1_ps(k.wd);
    const __m512 bc1 = _mm512_set1_ps(k.bias_correction1), bc2 = _mm512_set1_ps(k.bias_correction2_sqrt);
    const __m512 eps = _mm512_set1_ps(k.eps), lr = _mm512_set1_ps(k.lr), nan = _mm512_set1_ps(k.maximum_nan);
    // absmax_avx512's accumulation of each new moment, in the same loop
    __m512 m_max = _mm512_setzero_ps(), v_max = _mm512_setzero_ps(), vmax_max = _mm512_setzero_ps();
    __mmask16 m_nan = 0, v_nan = 0, vmax_nan = 0;
    for (int64_t j = 0; j < k.block_size; j += 16) {
      const int64_t i = b * k.block_size + j;
      __m512 g = load16(grad + i);
      if (k.unscale) g = store16(grad + i, rounded512(_mm512_mul_ps(g, inv_scale)));  // in the gradient's dtype
      __m512 p = load16(param + i);
      if (k.adamw) {
        p = _mm512_sub_ps(p, rounded512(_mm512_mul_ps(p, lr_wd)));
      } else {
        g = _mm512_add_ps(rounded512(_mm512_mul_ps(p, wd)), g);
      }
      const __m512 m_prev = m_looked_up ? rounded512(_mm512_mul_ps(_mm512_loadu_ps(m_old + j), m_scale16))
                                        : dequantized16(m, i, m_scale, fp8);
      const __m512 mv = lerp16(k.lerp, m_prev, g, k.w1);
      const __m512 g2 = rounded512(_mm512_mul_ps(g, g));
      const __m512 v_prev = v_looked_up ? rounded512(_mm512_mul_ps(_mm512_loadu_ps(v_old + j), v_scale16))
                                        : dequantized16(v, i, v_scale, fp8);
      const __m512 vv = lerp16(k.lerp, v_prev, g2, k.w2);
      __m512 denom;
      if (k.amsgrad) {
        const __m512 old = dequantized16(vmax, i, vmax_scale, fp8);
        const __mmask16 unordered = _mm512_cmp_ps_mask(old, vv, _CMP_UNORD_Q);
        const __m512 mx = _mm512_mask_blend_ps(unordered, _mm512_max_ps(old, vv), nan);  // at::maximum
        _mm512_storeu_ps(vmax_new + j, mx);
        absmax_step(mx, &vmax_max, &vmax_nan);
        denom = _mm512_sqrt_ps(mx);
      } else {
        denom = _mm512_sqrt_ps(vv);
      }
      denom = _mm512_add_ps(_mm512_div_ps(denom, bc2), eps);
      __m512 update = rounded512(_mm512_mul_ps(_mm512_div_ps(mv, bc1), lr));
      update = _mm512_div_ps(update, denom);
      if (rand16 != nullptr) {
        store16_stochastic(param + i, _mm512_sub_ps(p, update), rand16 + i);
      } else {
        store16(param + i, _mm512_sub_ps(p, update));
      }
      _mm512_storeu_ps(m_new + j, mv);
      _mm512_storeu_ps(v_new + j, vv);
      absmax_step(mv, &m_max, &m_nan);
      absmax_step(vv, &v_max, &v_nan);
    }
    clipped[0] = clip_absmax(_mm512_reduce_max_ps(m_max), m_nan != 0);
    clipped[1] = clip_absmax(_mm512_reduce_max_ps(v_max), v_nan != 0);
    clipped[2] = clip_absmax(_mm512_reduce_max_ps(vmax_max), vmax_nan != 0);
    return true;
  }
};

AMP_DETAIL_LOWBIT_SIMD_WARNINGS_ON
#endif  // AMP_DETAIL_LOWBIT_X86_CLONES

}  // namespace lowbit
}  // namespace detail
}  // namespace amp
