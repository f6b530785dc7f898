// amp/float8/nvfp4.h: NVFP4, NVIDIA's 4-bit format: FP4 (E2M1) codes in
// blocks of 16 along the last dimension (or 16x16 tiles, for weights), each
// block an E4M3 scale, the tensor one fp32 scale from its amax.
//
//   namespace f8 = amp::float8::detail;  // internal: the block-scaled recipes' quantizer
//   f8::Nvfp4Blocks q = f8::to_nvfp4(w, /*tiles_16x16=*/true);   // w [M, K], K % 16 == 0
//   at::Tensor g = f8::to_nvfp4(f8::rht16(x.t().contiguous())).data;  // wgrad's operand, Hadamard-rotated
//
// The reference is Transformer Engine's (transformer_engine/pytorch/
// custom_recipes/reference_nvfp4.py: NVFP4QuantizerRef._quantize and
// _quantize_blockwise_reference without pow-2 scales or 4over6, cast_to_fp4x2,
// _apply_rht, _build_hadamard_matrix, get_wgrad_sign_vector), bit for bit:
//   - global_amax = max|x| (in x's dtype, then fp32); global_encode =
//     (448 * 6) / global_amax, at most FLT_MAX, 1 where it is 0 (an infinite
//     amax; an amax of 0 gives FLT_MAX); global_decode = 1 / global_encode;
//   - per block (1x16, or 16x16 with rows padded with zeros to 16): s =
//     e4m3(clamp(min(block_amax * (global_encode * fp32(1/6)), FLT_MAX),
//     +-448)); encode = min(1 / (s * global_decode), FLT_MAX);
//   - elements: clamp(x * encode, +-6), rounded to E2M1 to nearest, ties to
//     even, as TE's thresholds do it (-0 and NaN give the code 0);
//   - two codes a byte, the even element in the low nibble (TE's and
//     torchao's packing, pack_uint4);
//   - or, for gradients, stochastic rounding (e2m1_codes_stochastic: amp's
//     definition, TE has no Python reference for it).
// torchao's nvfp4_tensor.py (nvfp4_quantize) places the reciprocal
// differently (block_amax / 6 / per_tensor_scale, then (1 / per_tensor_scale)
// / s), so the two can part in the last bit: amp quantizes as TE does.
// TE's reference has no stand-alone dequantize (its GEMM applies the tensor
// scale after the block sums); from_nvfp4 is torchao's NVFP4Tensor.dequantize
// with its per_tensor_amax_to_scale: code * (global_amax / (448 * 6) * s).
// Codes are at::kFloat4_e2m1fn_x2 where LibTorch has the dtype, else bytes.
// Needs the float8 dtypes (LibTorch 2.1+).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <limits>

#include "amp/detail/compat_float8.h"

namespace amp {
namespace float8 {
namespace detail {

// An NVFP4 tensor: `data` [M, K / 2] (two codes a byte), `scale` [M, K / 16]
// e4m3 block scales, `global_amax` [1] fp32 (the tensor scale's source).
struct Nvfp4Blocks {
  at::Tensor data;
  at::Tensor scale;
  at::Tensor global_amax;
};

inline constexpr int64_t kNvfp4Block = 16;
inline constexpr double kFp4Max = 6.0;

#if AMP_DETAIL_HAS_FLOAT8_DTYPE

// Code bytes as LibTorch names them (at::kFloat4_e2m1fn_x2 from 2.8), and back.
inline at::Tensor as_fp4x2(const at::Tensor& bytes) {
#if AMP_DETAIL_HAS_BLOCK_SCALED_DTYPES
  return bytes.view(at::kFloat4_e2m1fn_x2);
#else
  return bytes;
#endif
}

// x (fp32, within +-6 or NaN) to E2M1 codes, one a byte: TE's cast_to_fp4x2
// before its packing, round to nearest even on the E2M1 grid.
inline at::Tensor e2m1_codes(const at::Tensor& x) {
  at::Tensor r = at::zeros_like(x, x.options().dtype(at::kByte));
  auto set = [&](const at::Tensor& where, int64_t code) { r.masked_fill_(where, code); };
  set((x >= 0.0).logical_and(x <= 0.25), 0);
  set((x > 0.25).logical_and(x < 0.75), 1);
  set((x >= 0.75).logical_and(x <= 1.25), 2);
  set((x > 1.25).logical_and(x < 1.75), 3);
  set((x >= 1.75).logical_and(x <= 2.5), 4);
  set((x > 2.5).logical_and(x < 3.5), 5);
  set((x >= 3.5).logical_and(x <= 5.0), 6);
  set(x > 5.0, 7);
  set((x >= -0.25).logical_and(x < -0.0), 8);
  set((x < -0.25).logical_and(x > -0.75), 9);
  set((x <= -0.75).logical_and(x >= -1.25), 10);
  set((x < -1.25).logical_and(x > -1.75), 11);
  set((x <= -1.75).logical_and(x >= -2.5), 12);
  set((x < -2.5).logical_and(x > -3.5), 13);
  set((x <= -3.5).logical_and(x >= -5.0), 14);
  set(x < -5.0, 15);
  return r;
}

// x (fp32, within +-6 or NaN) to E2M1 codes, one a byte, rounded
// stochastically: between its neighbours lo < |x| < hi on the E2M1 grid,
// |x| becomes hi with probability (|x| - lo) / (hi - lo), drawn from `gen`
// (one uniform fp32 draw an element, at::rand's), so the expected value is x
// and the same generator state gives the same codes. Grid values stay; the
// sign is kept (a negative x that rounds to 0 gives -0, code 8, as
// e2m1_codes); NaN gives 0. Transformer Engine rounds gradients this way in
// CUDA and has no Python reference for it: this definition is amp's.
inline at::Tensor e2m1_codes_stochastic(const at::Tensor& x, at::Generator gen) {
  const float kGrid[] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const at::Tensor grid = at::tensor(at::ArrayRef<float>(kGrid)).to(x.device());
  const at::Tensor a = at::abs(x);
  at::Tensor lo = at::zeros(x.sizes(), x.options().dtype(at::kLong));  // the grid point at or below |x|
  for (int i = 1; i < 8; ++i) lo.add_(a >= kGrid[i]);
  const at::Tensor hi = (lo + 1).clamp_max(7);
  const at::Tensor lo_v = grid.index({lo}), hi_v = grid.index({hi});
  const at::Tensor p = at::where(hi > lo, (a - lo_v) / (hi_v - lo_v), at::zeros_like(a));
  // Drawn on the generator's device (a Trainer's is a CPU one), then moved to x's.
  const at::Tensor draws = at::rand(x.sizes(), gen, at::TensorOptions().dtype(at::kFloat).device(gen.device()));
  const at::Tensor up = draws.to(x.device()) < p;
  at::Tensor code = lo + up.to(lo.scalar_type());
  code = at::where(x < 0.0, code + 8, code);
  return at::where(at::isnan(x), at::zeros_like(code), code).to(at::kByte);
}

// x [M, K] (fp32 or bf16, K a multiple of 16) to NVFP4 with 1x16 blocks, or
// 16x16 tiles (Transformer Engine's weights): NVFP4QuantizerRef's rowwise
// cast; with `stochastic`, the elements are rounded by e2m1_codes_stochastic
// with that generator instead of to nearest (the scales are the same).
inline Nvfp4Blocks to_nvfp4(const at::Tensor& x, bool tiles_16x16 = false,
                            c10::optional<at::Generator> stochastic = c10::nullopt) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "amp: NVFP4 quantizes fp32 or bf16 tensors, not ", x.scalar_type(), "; cast with x.to(at::kFloat)");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kNvfp4Block == 0,
              "amp: NVFP4 quantizes a 2-D tensor [M, K] in blocks of 16 along K; got ", x.sizes(),
              ": reshape it to 2-D, K padded to a multiple of 16");
  const int64_t m = x.size(0), n = x.size(1), tile_rows = tiles_16x16 ? kNvfp4Block : 1;
  const at::Tensor fmax = at::scalar_tensor(std::numeric_limits<float>::max(), at::kFloat);
  const at::Tensor global_amax = at::max(at::abs(x)).to(at::kFloat).view({1});
  at::Tensor xp = x.contiguous();
  const int64_t padded = (m + tile_rows - 1) / tile_rows * tile_rows;
  if (padded != m) xp = at::constant_pad_nd(xp, {0, 0, 0, padded - m}, 0.0);
  at::Tensor vec_max;  // [padded, n / 16, 1]
  if (tiles_16x16) {
    const at::Tensor tiles = xp.unfold(0, kNvfp4Block, kNvfp4Block).unfold(1, kNvfp4Block, kNvfp4Block).to(at::kFloat);
    vec_max = at::amax(at::abs(tiles), {-1, -2}).repeat_interleave(kNvfp4Block, 0).unsqueeze(-1);
  } else {
    vec_max = at::amax(at::abs(xp.view({padded, n / kNvfp4Block, kNvfp4Block})), {-1}, true).to(at::kFloat);
  }
  const at::Tensor blocks = xp.view({padded, n / kNvfp4Block, kNvfp4Block});
  const at::Tensor fp4_max = at::scalar_tensor(kFp4Max, at::kFloat);
  const at::Tensor e4m3_max = at::scalar_tensor(amp::detail::kFloat8E4M3Max, at::kFloat);
  at::Tensor global_encode = at::minimum(at::div(e4m3_max * fp4_max, global_amax), fmax);
  global_encode = at::where(global_encode == 0.0, at::ones_like(global_encode), global_encode);
  const at::Tensor global_decode = at::div(at::scalar_tensor(1.0, at::kFloat), global_encode);
  const at::Tensor multiplier = global_encode * at::reciprocal(fp4_max);
  at::Tensor s = at::minimum(vec_max * multiplier, fmax);
  s = at::clamp(s, -e4m3_max, e4m3_max).to(at::kFloat8_e4m3fn);
  const at::Tensor encode =
      at::minimum(at::div(at::scalar_tensor(1.0, at::kFloat), s.to(at::kFloat) * global_decode), fmax);
  const at::Tensor clipped = at::clamp(blocks.to(at::kFloat) * encode, -fp4_max, fp4_max).reshape({padded, n});
  const at::Tensor codes = stochastic ? e2m1_codes_stochastic(clipped, *stochastic) : e2m1_codes(clipped);
  const at::Tensor packed = codes.slice(1, 0, n, 2) + codes.slice(1, 1, n, 2) * 16;
  return {as_fp4x2(packed.narrow(0, 0, m).contiguous()), s.squeeze(-1).narrow(0, 0, m).contiguous(), global_amax};
}

// The 16x16 matrix of Transformer Engine's random Hadamard transform:
// Sylvester's construction, rows multiplied by TE's fixed sign vector
// (get_wgrad_sign_vector), in `dtype` (_build_hadamard_matrix).
inline at::Tensor hadamard16(at::ScalarType dtype = at::kFloat) {
  at::Tensor h = at::ones({1, 1}, at::kFloat);
  while (h.size(0) < kNvfp4Block) h = at::cat({at::cat({h, h}, 1), at::cat({h, -h}, 1)}, 0);
  const at::Tensor signs = at::tensor(
      {1.0f, 1.0f, 1.0f, -1.0f, 1.0f, -1.0f, -1.0f, -1.0f, -1.0f, -1.0f, -1.0f, 1.0f, -1.0f, 1.0f, -1.0f, -1.0f});
  return at::matmul(signs * at::eye(kNvfp4Block, at::kFloat), h).to(dtype);
}

// x [..., K] (K a multiple of 16) times H/4 in blocks of 16 along K, in x's
// dtype: TE's _apply_rht, what NVFP4 applies to the weight-gradient GEMM's
// operands (their transposes) before quantizing them.
inline at::Tensor rht16(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % kNvfp4Block == 0, "amp: the Hadamard transform works on blocks of 16 ",
              "along the last dimension; it is ", x.dim() >= 1 ? x.size(-1) : 0, " in ", x.sizes());
  const at::Tensor transform = hadamard16(x.scalar_type()).to(x.device()) * (1.0 / 4.0);
  return at::matmul(x.contiguous().view({-1, kNvfp4Block}), transform).view(x.sizes());
}

// The values an Nvfp4Blocks stands for, in `out`: torchao's
// NVFP4Tensor.dequantize (E2M1 code values times the block's scale times
// global_amax / (448 * 6), in fp32, then cast).
inline at::Tensor from_nvfp4(const Nvfp4Blocks& q, at::ScalarType out) {
  TORCH_CHECK(q.data.defined() && q.scale.defined() && q.global_amax.defined() && q.data.dim() == 2 &&
                  q.scale.dim() == 2 && q.scale.size(0) == q.data.size(0) &&
                  q.scale.size(1) * kNvfp4Block == q.data.size(1) * 2,
              "amp: an NVFP4 tensor has codes [M, K / 2], scales [M, K / 16] and a global amax; got ", q.data.sizes(),
              " and ", q.scale.sizes());
  const at::Tensor bytes = q.data.view(at::kByte);
  const int64_t m = bytes.size(0), k = bytes.size(1) * 2;
  const at::Tensor codes =
      at::stack({at::bitwise_and(bytes, 0xF), at::bitwise_right_shift(bytes, 4)}, -1).view({m, k}).to(at::kLong);
  const at::Tensor values = at::tensor({0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                        -2.0f, -3.0f, -4.0f, -6.0f})
                                .to(q.data.device());
  const at::Tensor f32 = values.index({codes}).view({m, k / kNvfp4Block, kNvfp4Block});
  const at::Tensor per_tensor = q.global_amax.to(at::kFloat) / (amp::detail::kFloat8E4M3Max * kFp4Max);
  const at::Tensor scale = (per_tensor * q.scale.to(at::kFloat)).view({m, k / kNvfp4Block, 1});
  return (f32 * scale.to(at::kFloat)).view({m, k}).to(out);
}

#endif  // AMP_DETAIL_HAS_FLOAT8_DTYPE

}  // namespace detail
}  // namespace float8
}  // namespace amp
