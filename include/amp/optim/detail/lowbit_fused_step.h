// amp/optim/detail/lowbit_fused_step.h: the low-bit Adams' fused CPU step.
// One pass per block reads the codes, the scale, the parameter and the
// gradient, computes the new moments and the update, writes the parameter
// and requantizes; blocks run in parallel (detail::parallel_chunks: at::parallel_for, or ATen's pool without -fopenmp).
//
//   detail::lowbit::FusedAdam k{...constants...};
//   detail::lowbit::fused_adam_step(k, param, grad, moments, rand16);
//
// Every step is the IEEE operation LowBitAdam's tensor-op path (torchao's
// eager single_param_adam) performs, in the same order: the update's
// products and quotients one at a time, lerp as ATen's CPU kernel rounds it
// on this machine (aten_cpu_rounding()), the codes as lowbit_codec.h finds them.
// The vector ISA is a run-time choice (an AVX2+FMA clone of the same loop on
// x86 with GCC or Clang, the portable loop elsewhere); the bits are the same.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amp/detail/compat_float8.h"
#include "amp/optim/detail/lowbit_codec.h"
#include "amp/optim/state_format.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define AMP_DETAIL_LOWBIT_X86_CLONES 1
#else
#define AMP_DETAIL_LOWBIT_X86_CLONES 0
#endif

namespace amp {
namespace detail {
namespace lowbit {

// How ATen's CPU kernels round here, measured once per process on ATen
// itself. Its vector kernels (AVX2/AVX-512) lerp with a scalar weight as
// fma(w, end - start, start) (|w| < 0.5) or fma(w - 1, end - start, end); its
// portable build (no FMA, or ATEN_CPU_CAPABILITY=default) multiplies and adds.
// at::maximum's NaN is all ones in the vector kernels and quiet_NaN() in the
// portable one; the NaN's bits matter where torchao's stochastic rounding
// adds 0x10000 to them (0xFFFFFFFF wraps to 0). Unknown (neither formula
// holds, or the NaNs disagree) keeps the tensor-op path.
enum class LerpRounding { kFma, kSeparate, kUnknown };

struct AtenCpuRounding {
  LerpRounding lerp = LerpRounding::kUnknown;
  uint32_t maximum_nan = 0;  // the bits of at::maximum(x, NaN)
  bool known() const { return lerp != LerpRounding::kUnknown; }
};

// x as a rounded fp32 value: a product passed through here is not contracted
// with the next addition into an fma (GCC contracts C++ by default,
// -ffp-contract=fast), which ATen's separate ops never do.
C10_ALWAYS_INLINE float rounded(float x) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(x));
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(x));
#else
  volatile float kept = x;
  x = kept;
#endif
  return x;
}

C10_ALWAYS_INLINE float lerp_as(LerpRounding r, float start, float end, float w) {
  const float d = end - start;
  if (std::fabs(w) < 0.5f) return r == LerpRounding::kFma ? std::fma(w, d, start) : start + rounded(w * d);
  return r == LerpRounding::kFma ? std::fma(w - 1.f, d, end) : end - rounded(d * (1.f - w));
}

inline const AtenCpuRounding& aten_cpu_rounding() {
  static const AtenCpuRounding rounding = [] {
    at::NoGradGuard no_grad;
    constexpr int64_t n = 256;  // past every vector width and unroll, with a scalar tail of 0
    at::Tensor a = at::empty({n}, at::kFloat), b = at::empty({n}, at::kFloat);
    uint32_t x = 12345u;  // a fixed LCG: the same probe in every process
    for (int64_t i = 0; i < n; ++i) {
      x = x * 1664525u + 1013904223u;
      a.data_ptr<float>()[i] = static_cast<float>(x >> 8) / 16777216.f - 0.5f;
      x = x * 1664525u + 1013904223u;
      b.data_ptr<float>()[i] = static_cast<float>(x >> 8) / 4194304.f;
    }
    bool fma = true, separate = true;
    for (double w : {0.1, 0.001, 0.7}) {
      const at::Tensor r = at::lerp(a, b, w);
      for (int64_t i = 0; i < n; ++i) {
        const float got = r.data_ptr<float>()[i], s = a.data_ptr<float>()[i], e = b.data_ptr<float>()[i];
        fma = fma && got == lerp_as(LerpRounding::kFma, s, e, static_cast<float>(w));
        separate = separate && got == lerp_as(LerpRounding::kSeparate, s, e, static_cast<float>(w));
      }
    }
    AtenCpuRounding out;
    out.lerp = fma ? LerpRounding::kFma : separate ? LerpRounding::kSeparate : LerpRounding::kUnknown;
    b.fill_(std::numeric_limits<float>::quiet_NaN());
    const at::Tensor left = at::maximum(a, b), right = at::maximum(b, a);
    const uint32_t* l = reinterpret_cast<const uint32_t*>(left.data_ptr<float>());
    const uint32_t* r = reinterpret_cast<const uint32_t*>(right.data_ptr<float>());
    for (int64_t i = 0; i < n; ++i)
      if (l[i] != l[0] || r[i] != l[0]) out.lerp = LerpRounding::kUnknown;
    out.maximum_nan = l[0];
    return out;
  }();
  return rounding;
}

// One moment's quantized storage, raw (CPU, contiguous).
struct MomentRef {
  StateFormat format = StateFormat::kFloat;
  const float* map = nullptr;  // 8-/4-bit lookup table
  int64_t levels = 0;
  uint8_t* codes = nullptr;        // 8-bit: one per element; 4-bit: two per byte; fp8: e4m3fn bytes
  float* scale = nullptr;          // one per block
  float* values = nullptr;         // kFloat: the plain fp32 moment
  bool ascending = false;          // map strictly ascending: the vector searches apply
  const float* columns = nullptr;  // the map as 17 columns of 16 (map_columns), for the AVX-512 search
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
    const bool done = !plain && vector_pass(k, param, grad, m, v, vmax, rand16, b, m_new, v_new, vmax_new);
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
    quantize(m_new, bs, m, b);
    quantize(v_new, bs, v, b);
    if (k.amsgrad) quantize(vmax_new, bs, vmax, b);
  }
}

// A block's first pass in vector code, or false (then the scalar loop runs).
struct NoVectorPass {
  template <typename P>
  bool operator()(const FusedAdam&, P*, P*, const MomentRef&, const MomentRef&, const MomentRef&, const int32_t*,
                  int64_t, float*, float*, float*) const {
    return false;
  }
};

struct QuantizePortable {
  void operator()(const float* x, int64_t n, const MomentRef& q, int64_t block) const {
    quantize_moment_block(x, n, q, block);
  }
};

template <typename P>
void adam_blocks_portable(const FusedAdam& k, P* param, P* grad, const MomentRef& m, const MomentRef& v,
                          const MomentRef& vmax, const int32_t* rand16, int64_t b0, int64_t b1, float* buffer) {
  adam_blocks(k, param, grad, m, v, vmax, rand16, b0, b1, buffer, QuantizePortable{}, NoVectorPass{});
}

#if AMP_DETAIL_LOWBIT_X86_CLONES
// GCC 12 warns inside its own AVX-512 intrinsics (their _mm512_undefined_*
// operands) once they are inlined here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
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

// quantize_block with the search above (8-/4-bit; fp8 as quantize_block).
// The absmax of n values (a multiple of 16) as quantize_block's loop finds it:
// NaNs set *nan and are skipped (max_ps returns its second operand for a NaN).
__attribute__((target("avx512f,avx2,fma"))) inline float absmax_avx512(const float* x, int64_t n, bool* nan) {
  __m512 acc = _mm512_setzero_ps();
  __mmask16 unordered = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
    unordered = static_cast<__mmask16>(unordered | _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q));
    acc = _mm512_max_ps(a, acc);
  }
  *nan = unordered != 0;
  return _mm512_reduce_max_ps(acc);
}

// n codes (int32, each < 256) to bytes.
__attribute__((target("avx512f,avx2,fma"))) inline void bytes_avx512(const int32_t* codes, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; i += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(_mm512_loadu_si512(codes + i)));
}

template <bool Avx512>
C10_ALWAYS_INLINE void quantize_moment_block_vector(const float* x, int64_t n, const MomentRef& q, int64_t block,
                                                    int32_t* scratch) {
  if (q.format == StateFormat::kFp8 || n % 16 != 0 || !q.ascending) return quantize_moment_block(x, n, q, block);
  float amax = 0.f;
  bool nan = false;
  if (Avx512) {
    amax = absmax_avx512(x, n, &nan);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float a = std::fabs(x[i]);
      nan = nan || std::isnan(a);
      amax = a > amax ? a : amax;
    }
  }
  const float clipped = nan ? std::numeric_limits<float>::quiet_NaN() : std::max(amax, static_cast<float>(1e-12));
  q.scale[block] = clipped;
  if (Avx512) {
    nearest_codes_avx512(x, n, clipped, q.map, q.levels, q.columns, scratch);
  } else {
    nearest_codes_avx2(x, n, clipped, q.map, q.levels, scratch);
  }
  if (q.format == StateFormat::kInt8 && Avx512) {
    bytes_avx512(scratch, n, q.codes + block * n);
  } else if (q.format == StateFormat::kInt8) {
    uint8_t* c = q.codes + block * n;
    for (int64_t i = 0; i < n; ++i) c[i] = static_cast<uint8_t>(scratch[i]);
  } else {
    uint8_t* c = q.codes + block * n / 2;
    for (int64_t i = 0; i < n; i += 2) c[i / 2] = static_cast<uint8_t>((scratch[i] << 4) | scratch[i + 1]);
  }
}

struct QuantizeAvx2 {
  int32_t* scratch;  // block_size codes
  __attribute__((target("avx2,fma"))) void operator()(const float* x, int64_t n, const MomentRef& q,
                                                      int64_t block) const {
    quantize_moment_block_vector<false>(x, n, q, block, scratch);
  }
};

struct QuantizeAvx512 {
  int32_t* scratch;
  __attribute__((target("avx512f,avx2,fma"))) void operator()(const float* x, int64_t n, const MomentRef& q,
                                                              int64_t block) const {
    quantize_moment_block_vector<true>(x, n, q, block, scratch);
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

// The scalar loop's arithmetic on 16 fp32 parameters at a time (bf16
// parameters and stochastic rounding take the scalar loop).
struct VectorPassAvx512 {
  template <typename P>
  __attribute__((target("avx512f,avx2,fma"))) bool operator()(const FusedAdam& k, P* param, P* grad, const MomentRef& m,
                                                              const MomentRef& v, const MomentRef& vmax,
                                                              const int32_t* rand16, int64_t b, float* m_new,
                                                              float* v_new, float* vmax_new) const {
    if (!std::is_same<P, float>::value || rand16 != nullptr || k.block_size % 16 != 0) return false;
    float* pf = reinterpret_cast<float*>(param);
    float* gf = reinterpret_cast<float*>(grad);
    const float* fp8 = fp8_values();
    const float m_scale = m.scale[b], v_scale = v.scale[b], vmax_scale = k.amsgrad ? vmax.scale[b] : 0.f;
    const __m512 inv_scale = _mm512_set1_ps(k.inv_scale), lr_wd = _mm512_set1_ps(k.lr_wd), wd = _mm512_set1_ps(k.wd);
    const __m512 bc1 = _mm512_set1_ps(k.bias_correction1), bc2 = _mm512_set1_ps(k.bias_correction2_sqrt);
    const __m512 eps = _mm512_set1_ps(k.eps), lr = _mm512_set1_ps(k.lr), nan = _mm512_set1_ps(k.maximum_nan);
    for (int64_t j = 0; j < k.block_size; j += 16) {
      const int64_t i = b * k.block_size + j;
      __m512 g = _mm512_loadu_ps(gf + i);
      if (k.unscale) {
        g = rounded512(_mm512_mul_ps(g, inv_scale));
        _mm512_storeu_ps(gf + i, g);
      }
      __m512 p = _mm512_loadu_ps(pf + i);
      if (k.adamw) {
        p = _mm512_sub_ps(p, rounded512(_mm512_mul_ps(p, lr_wd)));
      } else {
        g = _mm512_add_ps(rounded512(_mm512_mul_ps(p, wd)), g);
      }
      const __m512 mv = lerp16(k.lerp, dequantized16(m, i, m_scale, fp8), g, k.w1);
      const __m512 g2 = rounded512(_mm512_mul_ps(g, g));
      const __m512 vv = lerp16(k.lerp, dequantized16(v, i, v_scale, fp8), g2, k.w2);
      __m512 denom;
      if (k.amsgrad) {
        const __m512 old = dequantized16(vmax, i, vmax_scale, fp8);
        const __mmask16 unordered = _mm512_cmp_ps_mask(old, vv, _CMP_UNORD_Q);
        const __m512 mx = _mm512_mask_blend_ps(unordered, _mm512_max_ps(old, vv), nan);  // at::maximum
        _mm512_storeu_ps(vmax_new + j, mx);
        denom = _mm512_sqrt_ps(mx);
      } else {
        denom = _mm512_sqrt_ps(vv);
      }
      denom = _mm512_add_ps(_mm512_div_ps(denom, bc2), eps);
      __m512 update = rounded512(_mm512_mul_ps(_mm512_div_ps(mv, bc1), lr));
      update = _mm512_div_ps(update, denom);
      _mm512_storeu_ps(pf + i, _mm512_sub_ps(p, update));
      _mm512_storeu_ps(m_new + j, mv);
      _mm512_storeu_ps(v_new + j, vv);
    }
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

// The same loop again with the AVX-512 search.
template <typename P>
__attribute__((target("avx512f,avx2,fma"))) void adam_blocks_avx512(const FusedAdam& k, P* param, P* grad,
                                                                    const MomentRef& m, const MomentRef& v,
                                                                    const MomentRef& vmax, const int32_t* rand16,
                                                                    int64_t b0, int64_t b1, float* buffer) {
  adam_blocks(k, param, grad, m, v, vmax, rand16, b0, b1, buffer,
              QuantizeAvx512{reinterpret_cast<int32_t*>(buffer + 3 * k.block_size)}, VectorPassAvx512{});
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // AMP_DETAIL_LOWBIT_X86_CLONES

// The vector ISA the fused step uses: the best this CPU has, at most
// isa_limit() (tests lower it to check every loop on one machine). The bits
// are the same on every ISA.
enum class Isa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

inline std::atomic<int>& isa_limit() {
  static std::atomic<int> limit{static_cast<int>(Isa::kAvx512)};
  return limit;
}

inline Isa cpu_isa() {
#if AMP_DETAIL_LOWBIT_X86_CLONES
  static const Isa best = !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? Isa::kPortable
                          : __builtin_cpu_supports("avx512f")                                ? Isa::kAvx512
                                                                                             : Isa::kAvx2;
#else
  static const Isa best = Isa::kPortable;
#endif
  return static_cast<Isa>(std::min(static_cast<int>(best), isa_limit().load()));
}

// The fused step over a whole parameter (numel a multiple of block_size).
template <typename P>
void fused_adam_step(const FusedAdam& k, P* param, P* grad, int64_t numel, const MomentRef& m, const MomentRef& v,
                     const MomentRef& vmax, const int32_t* rand16) {
  const int64_t blocks = (numel + k.block_size - 1) / k.block_size;
  const Isa isa = cpu_isa();
  parallel_chunks(blocks, /*grain=*/16, [&](int64_t b0, int64_t b1) {
    std::vector<float> buffer(static_cast<size_t>(4 * k.block_size));  // three moments' values, the codes
#if AMP_DETAIL_LOWBIT_X86_CLONES
    if (isa == Isa::kAvx512) return adam_blocks_avx512(k, param, grad, m, v, vmax, rand16, b0, b1, buffer.data());
    if (isa == Isa::kAvx2) return adam_blocks_avx2(k, param, grad, m, v, vmax, rand16, b0, b1, buffer.data());
#endif
    adam_blocks_portable(k, param, grad, m, v, vmax, rand16, b0, b1, buffer.data());
  });
}

// A low-bit Adam's hyperparameters for one parameter (its param group's).
struct AdamHyper {
  double lr = 0, weight_decay = 0, beta1 = 0, beta2 = 0, eps = 0;
  bool amsgrad = false, adamw = true, stochastic_round = false;
  int64_t block_size = 0;
};

// One parameter's fused step (CPU, fp32 or bf16, contiguous; quantized
// moments): LowBitAdam::step_param's result. The constants come from the same
// ATen ops on 0-dim tensors, read from CPU memory (no dispatcher call, no
// sync). `inv_scale`/`keep`: GradScaler's, or undefined.
inline void fused_adam_param(const AdamHyper& h, const at::Tensor& p, at::Tensor& grad, at::Tensor& step_count,
                             const MomentRef& m, const MomentRef& v, const MomentRef& vmax, const at::Tensor& inv_scale,
                             const at::Tensor& keep) {
  const bool bf16 = p.scalar_type() == at::kBFloat16;
  // torchao draws the random bits whether or not the step is kept.
  const at::Tensor rand16 =
      h.stochastic_round && bf16 ? at::randint(0, 1 << 16, p.sizes(), p.options().dtype(at::kInt)) : at::Tensor();
  FusedAdam k;
  k.unscale = inv_scale.defined();
  k.inv_scale = k.unscale ? *inv_scale.data_ptr<float>() : 1.f;
  if (keep.defined() && *keep.data_ptr<bool>()) {  // a skipped step: the gradient is unscaled, nothing else changes
    if (k.unscale) grad.mul_(inv_scale);
    return;
  }
  const at::Tensor lr = at::scalar_tensor(h.lr, p.options().dtype(at::kFloat));
  const at::Tensor lr_wd = lr * h.weight_decay;
  const at::Tensor step = step_count + 1;
  const at::Tensor bias_correction1 = at::rsub(at::pow(h.beta1, step), 1);
  const at::Tensor bias_correction2_sqrt = at::rsub(at::pow(h.beta2, step), 1).sqrt();
  k.lr = *lr.data_ptr<float>();
  k.lr_wd = *lr_wd.data_ptr<float>();
  k.wd = static_cast<float>(h.weight_decay);
  k.w1 = static_cast<float>(1 - h.beta1);
  k.w2 = static_cast<float>(1 - h.beta2);
  k.bias_correction1 = *bias_correction1.data_ptr<float>();
  k.bias_correction2_sqrt = *bias_correction2_sqrt.data_ptr<float>();
  k.eps = static_cast<float>(h.eps);
  k.adamw = h.adamw;
  k.amsgrad = h.amsgrad;
  const AtenCpuRounding& aten = aten_cpu_rounding();
  k.lerp = aten.lerp;
  std::memcpy(&k.maximum_nan, &aten.maximum_nan, sizeof(float));
  k.block_size = h.block_size;
  k.numel = p.numel();
  const int32_t* r = rand16.defined() ? rand16.data_ptr<int32_t>() : nullptr;
  alignas(64) float columns[3][272];
  MomentRef moments[3] = {m, v, vmax};
  for (int q = 0; q < 3; ++q)
    if (moments[q].map != nullptr && moments[q].levels % 16 == 0) {
      map_columns(moments[q].map, moments[q].levels, columns[q]);
      moments[q].columns = columns[q];
    } else {
      moments[q].ascending = false;  // no vector search
    }
  if (bf16) {
    fused_adam_step(k, p.data_ptr<at::BFloat16>(), grad.data_ptr<at::BFloat16>(), p.numel(), moments[0], moments[1],
                    moments[2], r);
  } else {
    fused_adam_step(k, p.data_ptr<float>(), grad.data_ptr<float>(), p.numel(), moments[0], moments[1], moments[2], r);
  }
  step_count.copy_(step);
}

}  // namespace lowbit
}  // namespace detail
}  // namespace amp
