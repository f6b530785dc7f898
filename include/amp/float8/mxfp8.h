// amp/float8/mxfp8.h: MXFP8, the OCP microscaling format that Blackwell GPUs
// run natively: blocks of 32 elements along the last dimension, each block
// one power-of-2 scale (E8M0: a biased exponent byte) and 32 float8 codes.
//
//   namespace f8 = amp::float8::detail;  // internal: the block-scaled recipes' quantizer
//   f8::MxBlocks q = f8::to_mx(x, f8::MxScale::kRceil);   // x [..., K], K % 32 == 0
//   at::Tensor y = f8::from_mx(q, at::kBFloat16);           // x rounded to MXFP8, as bf16
//
// The reference is torchao's (torchao/prototype/mx_formats/mx_tensor.py:
// to_mx, _to_mx_rceil, _f32_to_e8m0_rceil, _e8m0_scale_to_reciprocal_fp32,
// get_fp_scale, to_dtype; config.py: ScaleCalculationMode), bit for bit:
//   - the block's amax is taken in x's dtype, then read as fp32 bits;
//   - FLOOR (to_mx's default; OCP's): exponent = floor(log2 amax) - emax_elem
//     (8 for e4m3, 15 for e5m2), clamped to [-127, 128], biased by 127;
//     CEIL adds 1 when the amax has mantissa bits; EVEN first rounds the
//     amax's mantissa to the element's mantissa width (half up, on the
//     bits); RCEIL (torchao's MXFP8Linear default; cuBLAS's and Transformer
//     Engine's): the fp32 product amax * (1 / max_elem) rounded up to a power
//     of 2 (an fp32 subnormal rounds up only above 2^-127);
//   - a non-finite amax (a block with inf or NaN) gives the scale byte 0xFF,
//     as torchao does for both; Transformer Engine's non-Blackwell kernel
//     gives 0xFE for inf (ptx_arch_spec.cuh, float_to_e8m0): amp follows torchao;
//   - elements are multiplied by the exact reciprocal 2^(127 - e) in fp32
//     (byte 254's is the subnormal 2^-127, 0xFF's NaN), then cast. FLOOR,
//     CEIL and EVEN clamp to +-max_elem first for e5m2 always and for e4m3
//     where the eager cast does not saturate (LibTorch before 2.13,
//     detail/compat_float8.h); RCEIL never clamps (its scale leaves no room
//     to overflow);
//   - dequantizing: codes to the target dtype, times 2^(e - 127) in that
//     dtype (a NaN block for 0xFF).
// Scales are at::kFloat8_e8m0fnu where LibTorch has the dtype, else bytes.
// Needs the float8 dtypes (LibTorch 2.1+).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "amp/detail/compat_float8.h"

namespace amp {
namespace float8 {
namespace detail {

// How an MX block's scale comes from its amax: torchao's ScaleCalculationMode.
enum class MxScale { kFloor, kRceil, kCeil, kEven };

// An MX tensor: `data` the float8 codes in x's shape, `scale` one E8M0 byte
// per block of 32 along the last dimension ([..., K / 32]).
struct MxBlocks {
  at::Tensor data;
  at::Tensor scale;
};

inline constexpr int64_t kMxBlock = 32;
inline constexpr int32_t kE8m0Bias = 127;
inline constexpr int32_t kE8m0Nan = 255;

#if AMP_DETAIL_HAS_FLOAT8_DTYPE

// Scale bytes as LibTorch names them (at::kFloat8_e8m0fnu from 2.8), and back.
inline at::Tensor as_e8m0(const at::Tensor& bytes) {
#if AMP_DETAIL_HAS_BLOCK_SCALED_DTYPES
  return bytes.view(at::kFloat8_e8m0fnu);
#else
  return bytes;
#endif
}
inline at::Tensor e8m0_bytes(const at::Tensor& scale) { return scale.view(at::kByte); }

// 2^(127 - e) in fp32 for each biased exponent byte e, exactly: byte 254's
// is the subnormal 2^-127, 0xFF's NaN (torchao's _e8m0_scale_to_reciprocal_fp32).
inline at::Tensor e8m0_reciprocal(const at::Tensor& e) {
  const at::Tensor r = (2 * kE8m0Bias - e.to(at::kInt)).to(at::kByte).to(at::kInt);
  at::Tensor bits = at::bitwise_left_shift(r, 23);
  bits = at::where(r == 0, at::scalar_tensor(0x00400000, bits.options()), bits);
  bits = at::where(r == kE8m0Nan, at::scalar_tensor(0x7F800001, bits.options()), bits);
  return bits.view(at::kFloat);
}

// x [..., K] (fp32 or bf16, K a multiple of 32) to MXFP8 with `elem` codes
// (at::kFloat8_e4m3fn or at::kFloat8_e5m2): torchao's to_mx, bit for bit.
inline MxBlocks to_mx(const at::Tensor& x, MxScale mode, at::ScalarType elem = at::kFloat8_e4m3fn) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "amp: MXFP8 quantizes fp32 or bf16 tensors, not ", x.scalar_type(), "; cast with x.to(at::kFloat)");
  TORCH_CHECK(elem == at::kFloat8_e4m3fn || elem == at::kFloat8_e5m2,
              "amp: MXFP8's elements are at::kFloat8_e4m3fn or at::kFloat8_e5m2, not ", elem);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % kMxBlock == 0, "amp: MXFP8 scales blocks of 32 along the last dimension; ",
              "it is ", x.dim() >= 1 ? x.size(-1) : 0, " in ", x.sizes(), ": pad it to a multiple of 32");
  const bool e4m3 = elem == at::kFloat8_e4m3fn;
  const int32_t target_max_pow2 = e4m3 ? 8 : 15;
  const int32_t mbits = e4m3 ? 3 : 2;
  const double max_pos = e4m3 ? amp::detail::kFloat8E4M3Max : amp::detail::kFloat8E5M2Max;

  std::vector<int64_t> blocked = x.sizes().vec();
  blocked.back() /= kMxBlock;
  blocked.push_back(kMxBlock);
  const at::Tensor hp = x.contiguous().reshape(blocked);
  at::Tensor max_abs = at::amax(at::abs(hp), {-1}).unsqueeze(-1).to(at::kFloat);
  const at::Tensor data = hp.to(at::kFloat);
  at::Tensor scale;  // biased exponents, one byte a block
  at::Tensor data_lp;
  if (mode == MxScale::kRceil) {
    const at::Tensor descale = max_abs * (1.0 / max_pos);
    const at::Tensor bits = descale.view(at::kInt);
    const at::Tensor biased = at::bitwise_and(at::bitwise_right_shift(bits, 23), 0xFF);
    const at::Tensor mantissa = at::bitwise_and(bits, 0x7FFFFF);
    const at::Tensor round_up = at::where(biased == 0, mantissa > 0x400000, mantissa != 0);
    scale = at::where(at::isfinite(descale), biased + round_up.to(at::kInt), at::scalar_tensor(kE8m0Nan, at::kInt))
                .to(at::kByte);
    data_lp = data * e8m0_reciprocal(scale);
  } else {
    if (mode == MxScale::kEven) {
      const at::Tensor nan = at::isnan(max_abs);
      const int32_t mask = ((1 << 9) - 1) << 23;
      at::Tensor rounded = at::bitwise_and(max_abs.view(at::kInt) + (1 << (23 - mbits - 1)), mask).view(at::kFloat);
      max_abs = at::where(nan, at::scalar_tensor(std::numeric_limits<float>::quiet_NaN(), at::kFloat), rounded);
    }
    const at::Tensor bits = max_abs.view(at::kInt);
    at::Tensor pow2 = at::bitwise_and(at::bitwise_right_shift(bits, 23), 0xFF) - kE8m0Bias;
    if (mode == MxScale::kCeil) pow2 = pow2 + (at::bitwise_and(bits, 0x7FFFFF) > 0).to(at::kInt);
    const at::Tensor unbiased = at::clamp(pow2 - target_max_pow2, -kE8m0Bias, kE8m0Bias + 1);
    scale = (unbiased + kE8m0Bias).to(at::kByte);
    scale = at::where(at::isfinite(max_abs), scale, at::scalar_tensor(kE8m0Nan, at::kByte));
    data_lp = data * e8m0_reciprocal(scale);
    if (!e4m3 || !amp::detail::compat::kE4m3CastSaturates) data_lp = at::clamp(data_lp, -max_pos, max_pos);
  }
  return {data_lp.to(elem).reshape(x.sizes()), as_e8m0(scale.squeeze(-1))};
}

// 2^(e - 127) in fp32 for each scale byte, NaN for 0xFF (torchao's get_fp_scale).
inline at::Tensor e8m0_to_float(const at::Tensor& scale) {
  const at::Tensor e = e8m0_bytes(scale);
  const at::Tensor offset = e.to(at::kShort) - kE8m0Bias;
  const at::Tensor s = at::pow(at::full_like(offset, 2.0, at::kFloat), offset);
  return at::where(e != kE8m0Nan, s, at::scalar_tensor(std::numeric_limits<float>::quiet_NaN(), at::kFloat));
}

// The values an MxBlocks stands for, in `out` (torchao's to_dtype: codes and
// scales converted to `out`, then multiplied there).
inline at::Tensor from_mx(const MxBlocks& q, at::ScalarType out) {
  TORCH_CHECK(q.data.defined() && q.scale.defined() && q.data.dim() >= 1 && q.data.size(-1) % kMxBlock == 0 &&
                  q.scale.numel() * kMxBlock == q.data.numel(),
              "amp: an MX tensor has codes [..., K] (K a multiple of 32) and one scale per 32 codes; got ",
              q.data.sizes(), " and ", q.scale.sizes());
  const at::Tensor hp = q.data.contiguous().to(out).reshape({-1, kMxBlock});
  const at::Tensor s = e8m0_to_float(q.scale.contiguous()).reshape({-1, 1}).to(out);
  return (hp * s).reshape(q.data.sizes());
}

#endif  // AMP_DETAIL_HAS_FLOAT8_DTYPE

}  // namespace detail
}  // namespace float8
}  // namespace amp
