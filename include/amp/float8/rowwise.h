// amp/float8/rowwise.h: a linear layer's matmuls in float8 with rowwise
// scaling, torchao.float8's ROWWISE and ROWWISE_WITH_GW_HP recipes
// (config.py, Float8LinearConfig.from_recipe_name; float8_linear.py's
// matmul_with_hp_or_float8_args; float8_ops.py's addmm_float8_unwrapped).
//
//   auto y = amp::float8::linear<amp::Rowwise>(x, fc->weight, fc->bias);
//
// Every cast is e4m3, with one scale per row or column of the operand
// (fp8_max / amax, rounded down to a power of 2), the operands re-cast from
// the saved bf16 input and fp32 weight in backward, as torchao does:
//   Y  = X·Wᵀ   X per row, W per output feature; the scales applied inside
//               _scaled_mm (torchao's forward uses fast accumulation);
//   dX = dY·W   dY per row, W per input feature (RowwiseWithGwHp: W
//               tensorwise); _scaled_mm with unit scales, then the bf16
//               product times the fp32 outer product of the inverse scales
//               (torchao's path without fast accumulation);
//   dW = dYᵀ·X  dY and X per column, as dX, over the rows padded with zeros
//               to a multiple of 16 (torchao's pad_inner_dim=True);
//               RowwiseWithGwHp: a bf16 at::mm of the unscaled tensors.
// Needs a _scaled_mm that takes rowwise scales: CUDA (compute capability
// 8.9+, LibTorch 2.5+), CPU from LibTorch 2.14 (measured; 2.8's CPU kernel
// is documented for tensorwise scales only), probed at construction.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>
#include <torch/autograd.h>

#include <cstdint>
#include <utility>

#include "amp/core/policy.h"
#include "amp/detail/compat_float8.h"
#include "amp/float8/linear.h"
#include "amp/float8/recipe.h"

namespace amp {
namespace float8 {

#if AMP_DETAIL_HAS_FLOAT8_MATMUL
namespace detail {

// t cast to e4m3 with a power-of-2 scale per slice along `dim` (the amax
// over dim, kept), or one for the whole tensor (whole = true). The scale is
// scale_from_amax's, rounded down to a power of 2 as torchao's
// round_scales_to_power_of_2 does: exp2(floor(log2(scale))). Returns {t8, scale}.
inline std::pair<at::Tensor, at::Tensor> rowwise_cast(const at::Tensor& t, int64_t dim, bool whole = false) {
  const at::Tensor amax = whole ? amax_of(t) : at::amax(t.abs(), {dim}, /*keepdim=*/true);
  at::Tensor scale = at::exp2(at::floor(at::log2(scale_from_amax(amax, kE4M3))));
  return {to_float8(t, scale, kE4M3), scale};
}

// a8 [M, K] (scale [M, 1]) times b8 [K, N] (scale [1, N]) without fast
// accumulation, as torchao computes it: _scaled_mm with unit scales, then the
// product times the fp32 outer product of the inverse scales.
inline at::Tensor rowwise_mm_post_scaled(const at::Tensor& a8, const at::Tensor& b8, const at::Tensor& a_scale,
                                         const at::Tensor& b_scale, at::ScalarType out) {
  const at::Tensor one = at::ones({}, a_scale.options());
  at::Tensor y = scaled_mm_call(a8.contiguous(), b8.t().contiguous().t(), one, one, out, /*fast_accum=*/false);
  y.mul_(a_scale.reciprocal() * b_scale.reciprocal());
  return y;
}

// x [M, K] (compute dtype) · w [N, K]ᵀ (fp32 master weight) -> [M, N] in x's
// dtype, torchao's rowwise recipes; gw_hp: ROWWISE_WITH_GW_HP.
struct RowwiseMatmul : torch::autograd::Function<RowwiseMatmul> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            bool gw_hp) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["gw_hp"] = gw_hp;
    const auto [x8, x_scale] = rowwise_cast(x, 1);       // [M, 1]
    const auto [w8t, w_scale] = rowwise_cast(w.t(), 0);  // [K, N], [1, N]
    return scaled_mm_call(x8.contiguous(), w8t.t().contiguous().t(), x_scale.reciprocal(), w_scale.reciprocal(),
                          x.scalar_type(), /*fast_accum=*/true);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const bool gw_hp = ctx->saved_data["gw_hp"].toBool();
    const at::Tensor dy = grads[0].contiguous();
    // dX [M, K] = dY [M, N] · W [N, K]: dY per row; W per input feature (a
    // row of Wᵀ), or (gw_hp) tensorwise, its scale repeated per column.
    const auto [g8, g_scale] = rowwise_cast(dy, 1);  // [M, 1]
    const at::Tensor wt = w.t();                     // [K, N]
    auto [wt8, wt_scale] = rowwise_cast(wt, 1, gw_hp);
    wt_scale = gw_hp ? wt_scale.repeat({wt.size(0)}).reshape({1, -1}) : wt_scale.t();  // [1, K]
    const at::Tensor dx = rowwise_mm_post_scaled(g8, wt8.t(), g_scale, wt_scale, dy.scalar_type());
    // dW [N, K] = dYᵀ [N, M] · X [M, K].
    at::Tensor dw;
    if (gw_hp) {
      dw = at::mm(dy.t(), x);
    } else {
      const auto [gc8, gc_scale] = rowwise_cast(dy, 0);  // [1, N]
      const auto [xc8, xc_scale] = rowwise_cast(x, 0);   // [1, K]
      dw = rowwise_mm_post_scaled(pad_rows_to_16(gc8).t(), pad_rows_to_16(xc8), gc_scale.t(), xc_scale,
                                  dy.scalar_type());
    }
    return {dx, dw.to(w.scalar_type()), at::Tensor()};
  }
};

inline at::Tensor rowwise_linear(const at::Tensor& input, const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& bias, bool gw_hp) {
  if (!fits(weight)) return at::linear(input, weight, bias);
  return linear_via(input, weight, bias, [&](const at::Tensor& x) { return RowwiseMatmul::apply(x, weight, gw_hp); });
}
}  // namespace detail

// float8::linear with torchao's rowwise recipes (see the top of this file).
template <>
inline at::Tensor linear<Rowwise>(const at::Tensor& input, const at::Tensor& weight,
                                  const c10::optional<at::Tensor>& bias) {
  return detail::rowwise_linear(input, weight, bias, /*gw_hp=*/false);
}
template <>
inline at::Tensor linear<RowwiseWithGwHp>(const at::Tensor& input, const at::Tensor& weight,
                                          const c10::optional<at::Tensor>& bias) {
  return detail::rowwise_linear(input, weight, bias, /*gw_hp=*/true);
}

#endif  // AMP_DETAIL_HAS_FLOAT8_MATMUL

}  // namespace float8
}  // namespace amp
