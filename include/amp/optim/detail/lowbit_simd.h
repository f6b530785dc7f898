// amp/optim/detail/lowbit_simd.h: the fused low-bit step's kernel compiled
// for each ISA with function `target` attributes (lowbit_fused_step.h picks
// one at run time: no -march needed): adam_blocks with the vector quantizers
// (QuantizeAvx2, QuantizeAvx512: lowbit_simd_codes.h's searches) and, on
// AVX-512, the vector first pass (lowbit_simd_pass.h). Each operation rounds
// as the scalar kernel's (lowbit_block.h).
//
//   amp::detail::lowbit::adam_blocks_avx512(k, param, grad, m, v, vmax, rand16, b0, b1, buffer, vbmi);
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

#include "amp/detail/compat_float8.h"
#include "amp/optim/detail/lowbit_block.h"
#include "amp/optim/detail/lowbit_simd_codes.h"
#include "amp/optim/detail/lowbit_simd_pass.h"
#include "amp/optim/state_format.h"

namespace amp {
namespace detail {
namespace lowbit {

#if AMP_DETAIL_LOWBIT_X86_CLONES
AMP_DETAIL_LOWBIT_SIMD_WARNINGS_OFF  // lowbit_simd_codes.h says why

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

AMP_DETAIL_LOWBIT_SIMD_WARNINGS_ON
#endif  // AMP_DETAIL_LOWBIT_X86_CLONES

}  // namespace lowbit
}  // namespace detail
}  // namespace amp
