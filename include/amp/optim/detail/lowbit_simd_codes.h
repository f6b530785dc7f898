// amp/optim/detail/lowbit_simd_codes.h: the low-bit step's vector building
// blocks (x86 with GCC or Clang, function `target` attributes): a block's
// values to codes by the 8-/4-bit search (AVX2 gathers, AVX-512 lane
// permutes) or a threshold table (Encoder512), the block absmax, codes packed
// into bytes; each gives the scalar code's result (lowbit_block.h).
// AMP_DETAIL_LOWBIT_X86_CLONES: whether the vector code is compiled.
//
//   amp::detail::lowbit::encode_block_avx512(table, scale, format, x, n, out);
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

#include "amp/optim/detail/lowbit_threshold.h"
#include "amp/optim/state_format.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define AMP_DETAIL_LOWBIT_X86_CLONES 1
#include <immintrin.h>
#else
#define AMP_DETAIL_LOWBIT_X86_CLONES 0
#endif

// GCC 12 warns inside its own AVX-512 intrinsics (their _mm512_undefined_*
// operands) once they are inlined: each lowbit_simd header's vector code
// sits between these two.
#if defined(__GNUC__) && !defined(__clang__)
#define AMP_DETAIL_LOWBIT_SIMD_WARNINGS_OFF                                                  \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#define AMP_DETAIL_LOWBIT_SIMD_WARNINGS_ON _Pragma("GCC diagnostic pop")
#else
#define AMP_DETAIL_LOWBIT_SIMD_WARNINGS_OFF
#define AMP_DETAIL_LOWBIT_SIMD_WARNINGS_ON
#endif

namespace amp {
namespace detail {
namespace lowbit {

#if AMP_DETAIL_LOWBIT_X86_CLONES
AMP_DETAIL_LOWBIT_SIMD_WARNINGS_OFF

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

AMP_DETAIL_LOWBIT_SIMD_WARNINGS_ON
#endif  // AMP_DETAIL_LOWBIT_X86_CLONES

}  // namespace lowbit
}  // namespace detail
}  // namespace amp
