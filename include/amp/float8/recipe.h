// amp/float8/recipe.h: the float8 scaling formulas, as tensors on the data's
// device (no host sync), shared by the fp8 linear and its tests.
//
//   auto amax = amp::float8::amax_of(x);                             // max|x|, 0-dim
//   auto scale = amp::float8::scale_from_amax(amax, at::kFloat8_e4m3fn);
//   auto x8 = amp::float8::to_float8(x, scale, at::kFloat8_e4m3fn);   // saturated at +-448
//
// Tensorwise current scaling is torchao.float8's default (float8_utils.py):
// scale = fp8_max / max(amax, 1e-12), computed in fp64 and stored as fp32;
// the cast is (x in fp32 * scale) clamped to +-fp8_max, then rounded to fp8.
// Delayed scaling is Transformer Engine's DelayedScaling (pytorch/fp8.py,
// amax_compute_algo "max"): the scale comes from the largest amax of a
// history, divided by 2^margin, and keeps its previous value where that amax
// is 0, inf or NaN; after each update the history rolls by one and its slot 0
// (where the next amax goes) is zeroed.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "amp/detail/compat_float8.h"

namespace amp {
namespace float8 {

// The largest finite value of each float8 format.
inline constexpr double kE4M3Max = 448.0;    // float8_e4m3fn: forward inputs and weights
inline constexpr double kE5M2Max = 57344.0;  // float8_e5m2: output gradients (backward)
// torchao's floor under amax, so that an all-zero tensor gets a finite scale.
inline constexpr double kAmaxEps = 1e-12;

#if AMP_DETAIL_HAS_FLOAT8_MATMUL
inline constexpr at::ScalarType kE4M3 = at::kFloat8_e4m3fn;
inline constexpr at::ScalarType kE5M2 = at::kFloat8_e5m2;

// The largest finite value of a float8 dtype (an amp: error for another dtype).
inline double max_of(at::ScalarType fp8) {
  TORCH_CHECK(fp8 == kE4M3 || fp8 == kE5M2, "amp: float8 formats are at::kFloat8_e4m3fn and at::kFloat8_e5m2, not ",
              c10::toString(fp8));
  return fp8 == kE4M3 ? kE4M3Max : kE5M2Max;
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
// history is [length, roles] fp32, scale is [roles] fp32. Returns the new
// scale, (fp8_max / amax) / 2^margin with amax the history's largest per role
// (the old scale where that is 0, inf or NaN); rolls history in place by one,
// with slot 0 zeroed for the next amaxes.
inline at::Tensor delayed_scale_update(at::Tensor& history, const at::Tensor& scale, double fp8_max, int64_t margin) {
  TORCH_CHECK(history.dim() == 2 && scale.dim() == 1 && history.size(1) == scale.size(0),
              "amp: delayed scaling needs an amax history [length, roles] and a scale [roles]");
  const at::Tensor amax = std::get<0>(history.max(0));
  at::Tensor sf = amax.reciprocal() * fp8_max / std::ldexp(1.0, static_cast<int>(margin));
  sf = at::where(amax > 0.0, sf, scale);
  sf = at::where(at::isfinite(amax), sf, scale);
  history.copy_(at::roll(history, -1, 0));
  history.select(0, 0).zero_();
  return sf;
}

}  // namespace float8
}  // namespace amp
