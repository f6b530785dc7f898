// amp/optim/detail/lowbit_simd.h: the fused low-bit step's vector code
// (x86 with GCC or Clang): the 8-/4-bit search with AVX2 gathers or AVX-512
// lane permutes, the block absmax and codes, the first pass on 16 fp32
// parameters, and the kernel compiled for each ISA (function `target`
// attributes, chosen at run time: no -march needed). Each operation rounds
// as the scalar kernel's (optim/detail/lowbit_block.h).
//
//   amp::detail::lowbit::adam_blocks_avx512(k, param, grad, m, v, vmax, rand16, b0, b1, buffer, vbmi);
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "amp/detail/compat_float8.h"
#include "amp/optim/detail/lowbit_block.h"
#include "amp/optim/state_format.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define AMP_DETAIL_LOWBIT_X86_CLONES 1
#include <immintrin.h>
#else
#define AMP_DETAIL_LOWBIT_X86_CLONES 0
#endif

namespace amp {
namespace detail {
namespace lowbit {

#if AMP_DETAIL_LOWBIT_X86_CLONES
// GCC 12 warns inside its own AVX-512 intrinsics (their _mm512_undefined_*
// operands) once they are inlined here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// nearest_code for 8 values at a time: the same comparisons, the probes
// gathered. n is a multiple of 8; codes as int32.
__attribute__((target("avx2,fma"))) inline void nearest_codes_avx2(const float* x, int64_t n, float scale,
                                                                   const float* m, int64_t levels, int32_t* codes) {
  const __m256 divisor = _mm256_set1_ps(scale), half = _mm256_set1_ps(0.5f);
  const __m256i last = _mm256_set1_epi32(static_cast<int32_t>(levels - 1)), one = _mm256_set1_epi32(1);
  const __m256 middle = _mm256_set1_ps(m[levels / 2]);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), divisor);
    __m256i code = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(v, middle, _CMP_GE_OQ)),
                                    _mm256_set1_epi32(static_cast<int32_t>(levels / 2)));
    for (int64_t step = levels / 4; step >= 1; step /= 2) {
      const __m256i stride = _mm256_set1_epi32(static_cast<int32_t>(step));
      const __m256 probe = _mm256_i32gather_ps(m, _mm256_add_epi32(code, stride), 4);
      code = _mm256_add_epi32(code, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(v, probe, _CMP_GE_OQ)), stride));
    }
    const __m256i up = _mm256_min_epi32(_mm256_add_epi32(code, one), last);
    const __m256 down_v = _mm256_i32gather_ps(m, code, 4), up_v = _mm256_i32gather_ps(m, up, 4);
    const __m256 residual = _mm256_sub_ps(v, down_v);
    const __m256 half_gap = _mm256_mul_ps(_mm256_sub_ps(up_v, down_v), half);
    const __m256i take_up = _mm256_castps_si256(_mm256_cmp_ps(residual, half_gap, _CMP_GE_OQ));
    code = _mm256_add_epi32(code, _mm256_and_si256(_mm256_sub_epi32(up, code), take_up));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), code);
  }
}

// nearest_code for 16 values at a time without gathers (8-bit: 256 entries,
// 4-bit: 16; the map strictly ascending, as create_dynamic_map and
// linspace make it). The binary search's result is the count of entries
// m[1..] <= v; it is counted over the map as a 16 x 16 matrix, the row by its
// first entries, the column by the row's entries permuted into each lane
// (`columns`, map_columns()).
__attribute__((target("avx512f,avx2,fma"))) inline void nearest_codes_avx512(const float* x, int64_t n, float scale,
                                                                             const float* m, int64_t levels,
                                                                             const float* columns, int32_t* codes) {
  const int64_t rows = levels / 16;  // 16 or 1
  const __m512 divisor = _mm512_set1_ps(scale), half = _mm512_set1_ps(0.5f);
  const __m512i one = _mm512_set1_epi32(1), sixteen = _mm512_set1_epi32(16);
  const __m512i last = _mm512_set1_epi32(static_cast<int32_t>(levels - 1));
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i), divisor);
    __m512i row = _mm512_setzero_si512();
    for (int64_t h = 1; h < rows; ++h)
      row = _mm512_mask_add_epi32(row, _mm512_cmp_ps_mask(v, _mm512_set1_ps(m[16 * h]), _CMP_GE_OQ), row, one);
    __m512i code = _mm512_mullo_epi32(row, sixteen);
    __m512 down = _mm512_maskz_permutexvar_ps(0xFFFF, row, _mm512_load_ps(columns));
    __m512 up = _mm512_maskz_permutexvar_ps(0xFFFF, row, _mm512_load_ps(columns + 16 * 16));
    __mmask16 below = 0xFFFF;  // lanes whose entries so far are all <= v (the row is ascending)
    for (int64_t j = 1; j < 16; ++j) {
      const __m512 entry = _mm512_maskz_permutexvar_ps(0xFFFF, row, _mm512_load_ps(columns + 16 * j));
      const __mmask16 ge = _mm512_cmp_ps_mask(v, entry, _CMP_GE_OQ);
      code = _mm512_mask_add_epi32(code, ge, code, one);
      down = _mm512_mask_blend_ps(ge, down, entry);                               // the largest entry <= v
      up = _mm512_mask_blend_ps(static_cast<__mmask16>(below & ~ge), up, entry);  // the first entry > v
      below = static_cast<__mmask16>(below & ge);
    }
    const __m512 residual = _mm512_sub_ps(v, down);
    const __m512 half_gap = _mm512_mul_ps(_mm512_sub_ps(up, down), half);
    const __mmask16 take_up =
        _mm512_cmp_ps_mask(residual, half_gap, _CMP_GE_OQ) & _mm512_cmp_epi32_mask(code, last, _MM_CMPINT_LT);
    code = _mm512_mask_add_epi32(code, take_up, code, one);
    _mm512_storeu_si512(codes + i, code);
  }
}

// nearest_code from a threshold table (lowbit_threshold.h), 8 values at a
// time: the key's bucket entry gathered, base + (offset >= threshold), NaN 0.
__attribute__((target("avx2,fma"))) inline void table_codes_avx2(const float* x, int64_t n, float scale,
                                                                 const ThresholdTable& t, int32_t* codes) {
  const __m256 divisor = _mm256_set1_ps(scale);
  const __m256i top = _mm256_set1_epi32(static_cast<int32_t>(0x80000000u)), low8 = _mm256_set1_epi32(0xFF);
  const __m256i offset_mask = _mm256_set1_epi32(static_cast<int32_t>((1u << t.shift) - 1u)), one = _mm256_set1_epi32(1);
  const __m128i shift = _mm_cvtsi32_si128(t.shift), eight = _mm_cvtsi32_si128(8);
  const int* table = reinterpret_cast<const int*>(t.entries.data());
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i), divisor);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i key = _mm256_xor_si256(bits, _mm256_or_si256(_mm256_srai_epi32(bits, 31), top));
    const __m256i e = _mm256_i32gather_epi32(table, _mm256_srl_epi32(key, shift), 4);
    // offset >= threshold, both below 2^24: offset + 1 > threshold
    const __m256i ge =
        _mm256_cmpgt_epi32(_mm256_add_epi32(_mm256_and_si256(key, offset_mask), one), _mm256_srl_epi32(e, eight));
    const __m256i code = _mm256_sub_epi32(_mm256_and_si256(e, low8), ge);
    const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm256_and_si256(code, ordered));
  }
}

#define AMP_DETAIL_LOWBIT_AVX512 __attribute__((target("avx512f,avx2,fma")))

// One moment's encoder for a block with AVX-512: 16 values divided by the
// block's scale, their codes from the threshold table (one gather) or, for a
// 16-level map, the register search (its 15 thresholds in one register, a
// 4-step binary search by lane permutes), stored as bytes. fp8: c10's
// conversion on |v|'s bits (arithmetic, or its table from 464 up), the sign
// bit or-ed in.
struct Encoder512 {
  __m512 divisor;
  __m512i offset_mask, thresholds;
  __m128i shift;
  const int* entries;
  bool sixteen, four_bit, fp8;
  uint8_t* out;  // the block's first code byte

  AMP_DETAIL_LOWBIT_AVX512 Encoder512(const ThresholdTable& t, float scale, StateFormat format, uint8_t* codes)
      : divisor(_mm512_set1_ps(scale)),
        offset_mask(_mm512_set1_epi32(static_cast<int32_t>((1u << t.shift) - 1u))),
        thresholds(_mm512_loadu_si512(t.thresholds.data())),
        shift(_mm_cvtsi32_si128(t.shift)),
        entries(reinterpret_cast<const int*>(t.entries.data())),
        sixteen(format == StateFormat::kInt4 && t.map.size() == 16),
        four_bit(format == StateFormat::kInt4),
        fp8(format == StateFormat::kFp8),
        out(codes) {}

  AMP_DETAIL_LOWBIT_AVX512 C10_ALWAYS_INLINE __m512i table_code(__m512i key) const {
    const __m512i e = _mm512_i32gather_epi32(_mm512_srl_epi32(key, shift), entries, 4);
    const __mmask16 ge = _mm512_cmp_epu32_mask(_mm512_and_si512(key, offset_mask),
                                               _mm512_srl_epi32(e, _mm_cvtsi32_si128(8)), _MM_CMPINT_NLT);
    const __m512i base = _mm512_and_si512(e, _mm512_set1_epi32(0xFF));
    return _mm512_mask_add_epi32(base, ge, base, _mm512_set1_epi32(1));
  }

  AMP_DETAIL_LOWBIT_AVX512 C10_ALWAYS_INLINE __m512i codes(__m512 v) const {
    const __m512i bits = _mm512_castps_si512(v);
    if (fp8) {
      const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
      const __m512i a = _mm512_andnot_si512(sign, bits);
      // Below 464 in magnitude every LibTorch line's conversion is the same
      // arithmetic (c10's fp8e4m3fn_from_fp32_value): a denormal add below
      // 2^-6, else round to nearest even on the bits. From 464 up (inf and
      // NaN too) the lines differ (2.14 saturates): the table, built from
      // this line's conversion. All 2^32 floats compared by hand on 2.6 and 2.14.
      const __m512i denorm = _mm512_set1_epi32(141 << 23);
      const __m512i small = _mm512_sub_epi32(
          _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm))), denorm);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
      const __m512i bias = _mm512_set1_epi32(static_cast<int32_t>((static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu));
      const __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, bias), odd), 20);
      __m512i code = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(121 << 23)), normal, small);
      code = _mm512_and_si512(code, _mm512_set1_epi32(0xFF));
      const __mmask16 big = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x43E80000));  // 464.0f
      if (big != 0) code = _mm512_mask_mov_epi32(code, big, table_code(a));
      return _mm512_or_si512(code, _mm512_srli_epi32(_mm512_and_si512(bits, sign), 24));
    }
    const __m512i key = _mm512_xor_si512(
        bits, _mm512_or_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u))));
    __m512i code;
    if (sixteen) {
      code = _mm512_setzero_si512();
      for (int step = 8; step >= 1; step /= 2) {
        const __m512i probe = _mm512_permutexvar_epi32(_mm512_add_epi32(code, _mm512_set1_epi32(step - 1)), thresholds);
        code = _mm512_mask_add_epi32(code, _mm512_cmp_epu32_mask(key, probe, _MM_CMPINT_NLT), code,
                                     _mm512_set1_epi32(step));
      }
    } else {
      code = table_code(key);
    }
    return _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), code);  // NaN: code 0
  }

  // Values [i, i + 16) of the block (x: its first value) to their code bytes:
  // 8-bit and fp8 one per byte, 4-bit two (element 2k in byte k's high nibble).
  AMP_DETAIL_LOWBIT_AVX512 C10_ALWAYS_INLINE void encode(const float* x, int64_t i) const {
    const __m512i code = codes(_mm512_div_ps(_mm512_loadu_ps(x + i), divisor));
    if (four_bit) {
      const __m512i pairs = _mm512_or_si512(_mm512_slli_epi32(code, 4), _mm512_srli_epi64(code, 32));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i / 2), _mm512_cvtepi64_epi8(pairs));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(code));
    }
  }
};

// A table's codes with AVX-512, 16 values at a time, as int32 (8-/4-bit:
// nearest_code; fp8: c10's conversion).
AMP_DETAIL_LOWBIT_AVX512 inline void table_codes_avx512(const float* x, int64_t n, float scale, const ThresholdTable& t,
                                                        StateFormat format, int32_t* codes) {
  const Encoder512 e(t, scale, format, nullptr);
  for (int64_t i = 0; i < n; i += 16)
    _mm512_storeu_si512(codes + i, e.codes(_mm512_div_ps(_mm512_loadu_ps(x + i), e.divisor)));
}

// A block's n values (a multiple of 16) to their code bytes.
AMP_DETAIL_LOWBIT_AVX512 inline void encode_block_avx512(const ThresholdTable& t, float scale, StateFormat format,
                                                         const float* x, int64_t n, uint8_t* out) {
  const Encoder512 e(t, scale, format, out);
  for (int64_t i = 0; i < n; i += 16) e.encode(x, i);
}

// The absmax of n values (a multiple of 16) as quantize_block's loop finds it:
// NaNs set *nan and are skipped (max_ps returns its second operand for a NaN).
AMP_DETAIL_LOWBIT_AVX512 C10_ALWAYS_INLINE void absmax_step(__m512 x, __m512* acc, __mmask16* unordered) {
  const __m512 a = _mm512_abs_ps(x);
  *unordered = static_cast<__mmask16>(*unordered | _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q));
  *acc = _mm512_max_ps(a, *acc);
}

AMP_DETAIL_LOWBIT_AVX512 inline float absmax_avx512(const float* x, int64_t n, bool* nan) {
  __m512 acc = _mm512_setzero_ps();
  __mmask16 unordered = 0;
  for (int64_t i = 0; i < n; i += 16) absmax_step(_mm512_loadu_ps(x + i), &acc, &unordered);
  *nan = unordered != 0;
  return _mm512_reduce_max_ps(acc);
}

// n codes (int32, each < 256) to bytes.
AMP_DETAIL_LOWBIT_AVX512 inline void bytes_avx512(const int32_t* codes, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; i += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(_mm512_loadu_si512(codes + i)));
}

// Whether a block's moment takes a vector search (else quantize_block):
// 8-/4-bit maps that ascend; fp8 with AVX-512 and its table.
template <bool Avx512>
C10_ALWAYS_INLINE bool vector_search(const MomentRef& q, int64_t n) {
  if (n % 16 != 0) return false;
  return q.format == StateFormat::kFp8 ? Avx512 && q.table != nullptr : q.ascending;
}

// The block's scale from its clipped absmax: quantize_block's.
C10_ALWAYS_INLINE float block_scale(const MomentRef& q, float clipped) {
  return q.format == StateFormat::kFp8 ? clipped / static_cast<float>(kFloat8E4M3Max) : clipped;
}

// The block's clipped absmax: `clipped` when the first pass found it, else a pass here.
template <bool Avx512>
C10_ALWAYS_INLINE float block_clipped(const float* x, int64_t n, const float* clipped) {
  if (clipped != nullptr) return *clipped;
  if (!Avx512) return clipped_absmax(x, n);
  bool nan = false;
  const float amax = absmax_avx512(x, n, &nan);  // before nan is read
  return clip_absmax(amax, nan);
}

// quantize_block with the searches above.
template <bool Avx512>
C10_ALWAYS_INLINE void quantize_moment_block_vector(const float* x, int64_t n, const MomentRef& q, int64_t block,
                                                    int32_t* scratch, const float* clipped_in) {
  if (!vector_search<Avx512>(q, n)) return quantize_moment_block(x, n, q, block);
  const float clipped = block_scale(q, block_clipped<Avx512>(x, n, clipped_in));
  q.scale[block] = clipped;
  const bool four_bit = q.format == StateFormat::kInt4;
  uint8_t* out = q.codes + (four_bit ? block * n / 2 : block * n);
  if (Avx512 && q.table != nullptr) return encode_block_avx512(*q.table, clipped, q.format, x, n, out);
  if (Avx512) {
    nearest_codes_avx512(x, n, clipped, q.map, q.levels, q.columns, scratch);
  } else if (q.table != nullptr) {
    table_codes_avx2(x, n, clipped, *q.table, scratch);
  } else {
    nearest_codes_avx2(x, n, clipped, q.map, q.levels, scratch);
  }
  if (!four_bit && Avx512) {
    bytes_avx512(scratch, n, out);
  } else if (!four_bit) {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(scratch[i]);
  } else {
    for (int64_t i = 0; i < n; i += 2) out[i / 2] = static_cast<uint8_t>((scratch[i] << 4) | scratch[i + 1]);
  }
}

struct QuantizeAvx2 {
  int32_t* scratch;  // block_size codes
  __attribute__((target("avx2,fma"))) void operator()(const float* x, int64_t n, const MomentRef& q, int64_t block,
                                                      const float* clipped) const {
    quantize_moment_block_vector<false>(x, n, q, block, scratch, clipped);
  }
  __attribute__((target("avx2,fma"))) void pair(const float* m_new, const float* v_new, int64_t n, const MomentRef& m,
                                                const MomentRef& v, int64_t block, const float* clipped) const {
    (*this)(m_new, n, m, block, clipped);
    (*this)(v_new, n, v, block, clipped == nullptr ? nullptr : clipped + 1);
  }
};

struct QuantizeAvx512 {
  int32_t* scratch;
  AMP_DETAIL_LOWBIT_AVX512 void operator()(const float* x, int64_t n, const MomentRef& q, int64_t block,
                                           const float* clipped) const {
    quantize_moment_block_vector<true>(x, n, q, block, scratch, clipped);
  }
  // m and v in one loop where both take the table: twice the independent work per iteration.
  AMP_DETAIL_LOWBIT_AVX512 void pair(const float* m_new, const float* v_new, int64_t n, const MomentRef& m,
                                     const MomentRef& v, int64_t block, const float* clipped) const {
    if (!vector_search<true>(m, n) || !vector_search<true>(v, n) || m.table == nullptr || v.table == nullptr) {
      (*this)(m_new, n, m, block, clipped);
      return (*this)(v_new, n, v, block, clipped == nullptr ? nullptr : clipped + 1);
    }
    const float m_scale = block_scale(m, block_clipped<true>(m_new, n, clipped));
    const float v_scale = block_scale(v, block_clipped<true>(v_new, n, clipped == nullptr ? nullptr : clipped + 1));
    m.scale[block] = m_scale;
    v.scale[block] = v_scale;
    const int64_t bytes = m.format == StateFormat::kInt4 ? n / 2 : n;
    const Encoder512 em(*m.table, m_scale, m.format, m.codes + block * bytes);
    const Encoder512 ev(*v.table, v_scale, v.format, v.codes + block * bytes);
    for (int64_t i = 0; i < n; i += 16) {
      em.encode(m_new, i);
      ev.encode(v_new, i);
    }
  }
};

// fp8 codes as fp32 values (c10's conversion), a table for the vector pass.
inline const float* fp8_values() {
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

// The same loop compiled for AVX2 with FMA: std::fma is one instruction and
// the compiler may vectorize; every operation rounds as in the portable one.
template <typename P>
__attribute__((target("avx2,fma"))) void adam_blocks_avx2(const FusedAdam& k, P* param, P* grad, const MomentRef& m,
                                                          const MomentRef& v, const MomentRef& vmax,
                                                          const int32_t* rand16, int64_t b0, int64_t b1,
                                                          float* buffer) {
  adam_blocks(k, param, grad, m, v, vmax, rand16, b0, b1, buffer,
              QuantizeAvx2{reinterpret_cast<int32_t*>(buffer + 3 * k.block_size)}, NoVectorPass{});
}

// The same loop again with the AVX-512 search; `vbmi`: the CPU has
// AVX512-VBMI (lookup_block_vbmi). buffer: 6 * block_size floats.
template <typename P>
__attribute__((target("avx512f,avx2,fma"))) void adam_blocks_avx512(const FusedAdam& k, P* param, P* grad,
                                                                    const MomentRef& m, const MomentRef& v,
                                                                    const MomentRef& vmax, const int32_t* rand16,
                                                                    int64_t b0, int64_t b1, float* buffer, bool vbmi) {
  adam_blocks(k, param, grad, m, v, vmax, rand16, b0, b1, buffer,
              QuantizeAvx512{reinterpret_cast<int32_t*>(buffer + 3 * k.block_size)},
              VectorPassAvx512{buffer + 4 * k.block_size, vbmi});
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // AMP_DETAIL_LOWBIT_X86_CLONES

}  // namespace lowbit
}  // namespace detail
}  // namespace amp
