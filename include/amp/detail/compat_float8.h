// amp/detail/compat_float8.h: what each LibTorch has for float8 matmuls.
//
// at::_scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype,
// use_fast_accum) returning one tensor: 2.5 (2.1-2.4 returned (out, amax));
// the float8 dtypes themselves are 2.1. A CPU kernel arrived in 2.8
// (tensorwise scales; emulated in fp32 where the CPU lacks AMX: for
// correctness, not speed). Rowwise scales (scale_a [M, 1], scale_b [1, N]):
// CUDA from 2.5; CPU measured on 2.14, the first line here whose CPU kernel
// takes them. On CUDA it needs compute capability 8.9+, which is a run-time
// question.
#pragma once

#include "amp/version.h"

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define AMP_DETAIL_HAS_FLOAT8_DTYPE 1
#else
#define AMP_DETAIL_HAS_FLOAT8_DTYPE 0
#endif
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
#define AMP_DETAIL_HAS_FLOAT8_MATMUL 1
#else
#define AMP_DETAIL_HAS_FLOAT8_MATMUL 0
#endif
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#define AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL 1
#else
#define AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL 0
#endif
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
#define AMP_DETAIL_HAS_CPU_ROWWISE_FLOAT8 1
#else
#define AMP_DETAIL_HAS_CPU_ROWWISE_FLOAT8 0
#endif

namespace amp {
namespace detail {

// The largest finite value of each float8 format (torch.finfo(dtype).max):
// float8's recipes and the fp8 optimizer states' scale.
inline constexpr double kFloat8E4M3Max = 448.0;
inline constexpr double kFloat8E5M2Max = 57344.0;

namespace compat {

inline constexpr bool kHasFloat8Dtype = AMP_DETAIL_HAS_FLOAT8_DTYPE;  // at::kFloat8_e4m3fn (fp8 optimizer states)
inline constexpr bool kHasFloat8Matmul = AMP_DETAIL_HAS_FLOAT8_MATMUL;
inline constexpr bool kCpuHasScaledMm = AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL;
inline constexpr bool kCpuHasRowwiseScaledMm = AMP_DETAIL_HAS_CPU_ROWWISE_FLOAT8;
static_assert(kHasFloat8Dtype == libtorch_at_least(2, 1) && kHasFloat8Matmul == libtorch_at_least(2, 5) &&
                  kCpuHasScaledMm == libtorch_at_least(2, 8) && kCpuHasRowwiseScaledMm == libtorch_at_least(2, 14),
              "amp: compat_float8.h's float8 switches disagree with version.h");

}  // namespace compat
}  // namespace detail
}  // namespace amp
