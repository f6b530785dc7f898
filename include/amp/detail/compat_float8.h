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
//
// Block-scaled formats (amp/float8/mxfp8.h, nvfp4.h): at::kFloat8_e8m0fnu
// (MX scales) and at::kFloat4_e2m1fn_x2 (two FP4 codes a byte) are in 2.14's
// c10/core/ScalarType.h and not in 2.6's (measured); amp views its bytes as
// them from 2.8, a release that has both, and keeps plain bytes (at::kByte)
// before: the formats are bits, the dtypes only names for them. An eager
// fp32 -> e4m3fn cast saturates finite values beyond +-448 from 2.13 and
// gives NaN before (torchao's mx_tensor.py, _TORCH_VERSION_AT_LEAST_2_13, for
// pytorch#177870 and #178817): before 2.13 torchao's to_mx clamps first.
//
// Block-scaled at::_scaled_mm on CUDA (cuBLAS's VEC32_UE8M0 and VEC16_UE4M3
// scale modes: compute capability 10.0+, a CUDA 12.8+ build): e4m3 codes with
// e8m0 scales of blocks of 32 (MXFP8; pytorch#146655, February 2025, so 2.7)
// and Float4_e2m1fn_x2 codes with e4m3 scales of blocks of 16 (NVFP4), each
// scale matrix swizzled into cuBLAS's 128x4 tiles and flattened, the second
// operand column-major, K a multiple of 32 and N of 16
// (aten/src/ATen/native/cuda/Blas.cpp: is_blockwise_1x32_scaling,
// is_blockwise_1x16_scaling, _scaled_mm_out_cuda). amp routes from 2.8, the
// floor of torchao's mx_formats tests and the first line where amp names
// both dtypes; that NVFP4 is in 2.8's _scaled_mm is torchao's word, not
// measured (amp/float8/block_scaled_mm.h). Whether a device runs it is a
// run-time question.
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
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#define AMP_DETAIL_HAS_BLOCK_SCALED_DTYPES 1
#else
#define AMP_DETAIL_HAS_BLOCK_SCALED_DTYPES 0
#endif
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#define AMP_DETAIL_HAS_BLOCK_SCALED_MM 1
#else
#define AMP_DETAIL_HAS_BLOCK_SCALED_MM 0
#endif
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
#define AMP_DETAIL_E4M3_CAST_SATURATES 1
#else
#define AMP_DETAIL_E4M3_CAST_SATURATES 0
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
inline constexpr bool kHasBlockScaledDtypes = AMP_DETAIL_HAS_BLOCK_SCALED_DTYPES;  // e8m0fnu, e2m1fn_x2
inline constexpr bool kE4m3CastSaturates = AMP_DETAIL_E4M3_CAST_SATURATES;
inline constexpr bool kCudaHasBlockScaledMm = AMP_DETAIL_HAS_BLOCK_SCALED_MM;  // MXFP8 and NVFP4 _scaled_mm
static_assert(kHasFloat8Dtype == libtorch_at_least(2, 1) && kHasFloat8Matmul == libtorch_at_least(2, 5) &&
                  kCpuHasScaledMm == libtorch_at_least(2, 8) && kCpuHasRowwiseScaledMm == libtorch_at_least(2, 14) &&
                  kHasBlockScaledDtypes == libtorch_at_least(2, 8) && kE4m3CastSaturates == libtorch_at_least(2, 13) &&
                  kCudaHasBlockScaledMm == libtorch_at_least(2, 8),
              "amp: compat_float8.h's float8 switches disagree with version.h");

}  // namespace compat
}  // namespace detail
}  // namespace amp
