// amp/float8/recipe.h: the float8 scaling formulas, as tensors on the data's
// device (no host sync), shared by the fp8 linear and its tests.
//
//   namespace f8 = amp::float8::detail;  // internal: the formulas behind float8::linear
//   auto amax = f8::amax_of(x);                             // max|x|, 0-dim
//   auto scale = f8::scale_from_amax(amax, at::kFloat8_e4m3fn);
//   auto x8 = f8::to_float8(x, scale, at::kFloat8_e4m3fn);   // saturated at +-448
//
// Tensorwise current scaling is torchao.float8's default (float8_utils.py):
// scale = fp8_max / max(amax, 1e-12), computed in fp64 and stored as fp32;
// the cast is (x in fp32 * scale) clamped to +-fp8_max, then rounded to fp8.
// Delayed scaling is Transformer Engine's DelayedScaling (pytorch/fp8.py,
// amax_compute_algo "max", its default fused CUDA kernel's arithmetic): the
// scale is (fp8_max * 2^-margin) / the largest amax of a history, and a step
// whose amax is 0 changes nothing (delayed_scale_update below).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include "amp/detail/compat_float8.h"

namespace amp {
namespace float8 {
namespace detail {

// The largest finite value of each float8 format: amp::detail::kFloat8E4M3Max
// (float8_e4m3fn: forward inputs and weights) and kFloat8E5M2Max (float8_e5m2:
// output gradients), which the fp8 optimizer states share.
// torchao's floor under amax, so that an all-zero tensor gets a finite scale.
inline constexpr double kAmaxEps = 1e-12;

#if AMP_DETAIL_HAS_FLOAT8_MATMUL
inline constexpr at::ScalarType kE4M3 = at::kFloat8_e4m3fn;
inline constexpr at::ScalarType kE5M2 = at::kFloat8_e5m2;

// The largest finite value of a float8 dtype (an amp: error for another dtype).
inline double max_of(at::ScalarType fp8) {
  TORCH_CHECK(fp8 == kE4M3 || fp8 == kE5M2, "amp: float8 formats are at::kFloat8_e4m3fn and at::kFloat8_e5m2, not ",
              c10::toString(fp8));
  return fp8 == kE4M3 ? amp::detail::kFloat8E4M3Max : amp::detail::kFloat8E5M2Max;
}

// max|x| as a 0-dim tensor of x's dtype.
inline at::Tensor amax_of(const at::Tensor& x) { return x.abs().max(); }

// Tensorwise current scaling: fp8_max / max(amax, eps), in fp64, as fp32.
// (Python's `float / tensor` is tensor.reciprocal() * float: so is this.)
inline at::Tensor scale_from_amax(const at::Tensor& amax, at::ScalarType fp8) {
  return (amax.to(at::kDouble).clamp_min(kAmaxEps).reciprocal() * max_of(fp8)).to(at::kFloat);
}

// (x * scale) in fp32, saturated at +-fp8_max, rounded to fp8.
inline at::Tensor to_float8(const at::Tensor& x, const at::Tensor& scale, at::ScalarType fp8) {
  const double max = max_of(fp8);
  return (x.to(at::kFloat) * scale).clamp(-max, max).to(fp8);
}
#endif

// Delayed scaling's update for a group of tensor roles that share a format
// (TE keeps one group for the forward, e4m3, and one for the backward, e5m2):
// history is [length, roles] fp32 with the step's amaxes in slot 0, scale is
// [roles] fp32. Returns the new scales as TE's default, fused kernel computes
// them (common/recipe/delayed_scaling.cu, kernel_bulk, amax_compute_algo
// "max"), per role:
//   - a step amax (slot 0) of 0: nothing changes, not even the history;
//   - otherwise the history rolls by one (slot 0 zeroed for the next step)
//     and amax is its largest entry, NaNs ignored (CUDA's fmaxf);
//   - scale = scaled_max / amax, one fp32 division, scaled_max =
//     fp8_max * 2^-margin; the old scale where amax is 0 or not finite;
//   - an infinite scale (a tiny amax) becomes FLT_MAX.
inline at::Tensor delayed_scale_update(at::Tensor& history, const at::Tensor& scale, double fp8_max, int64_t margin) {
  TORCH_CHECK(history.dim() == 2 && scale.dim() == 1 && history.size(1) == scale.size(0),
              "amp: delayed scaling needs an amax history [length, roles] and a scale [roles]");
  TORCH_CHECK(history.scalar_type() == at::kFloat && scale.scalar_type() == at::kFloat,
              "amp: delayed scaling keeps its amax history and scale in fp32 (at::kFloat)");
  const at::Tensor step_amax = history.select(0, 0);
  const at::Tensor rolls = step_amax != 0.0;
  const at::Tensor amax = std::get<0>(at::where(at::isnan(history), at::zeros_like(history), history).max(0));
  const float scaled_max = static_cast<float>(std::ldexp(fp8_max, -static_cast<int>(margin)));
  at::Tensor sf = at::div(at::full_like(amax, scaled_max), amax);
  sf = at::where(rolls.logical_and(amax > 0.0).logical_and(at::isfinite(amax)), sf, scale);
  sf = at::where(at::isinf(sf), at::full_like(sf, std::numeric_limits<float>::max()), sf);
  at::Tensor rolled = at::roll(history, -1, 0);
  rolled.select(0, 0).zero_();
  history.copy_(at::where(rolls, rolled, history));
  return sf;
}

}  // namespace detail
}  // namespace float8
}  // namespace amp
