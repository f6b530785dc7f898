// amp/scaler/detail/update_scale.h: the loss-scale update after each iteration.
//
//   amp::detail::update_scale_(scale, tracker, found_inf, growth, backoff, interval, ext);  // no host sync
//
// ATen's _amp_update_scale_ where the device has it and no extension is on,
// else a portable path with the same trajectory bit for bit, plus amp's
// extensions (min/max scale, hysteresis).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "amp/core/device.h"

namespace amp {
namespace detail {

// amp's extensions of the scale update; the defaults leave torch's rule alone.
struct ScaleUpdateExtensions {
  double min_scale = 0.0;
  double max_scale = std::numeric_limits<double>::infinity();
  int64_t hysteresis = 1;
  at::Tensor* hysteresis_tracker = nullptr;  // int32 0-dim; required when hysteresis > 1

  bool any() const { return min_scale > 0.0 || !std::isinf(max_scale) || hysteresis > 1; }
};

// The portable _amp_update_scale_ (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp,
// cuda/AmpKernels.cu), as tensor ops without a host sync:
//   if (found_inf)  scale = float(double(scale) * backoff), tracker = 0
//   else if (tracker + 1 == growth_interval)
//                   g = float(double(scale) * growth); if (isfinite(g)) scale = g; tracker = 0
//   else            tracker += 1
// The products are taken in double and rounded once to float, as the kernels'
// `float * double` is, so the trajectory is bitwise the same. `found_inf`
// counts when nonzero, NaN included, as the kernels' `if (*found_inf)`.
inline void portable_update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, const at::Tensor& found_inf,
                                   double growth_factor, double backoff_factor, int64_t growth_interval,
                                   const ScaleUpdateExtensions& ext = {}) {
  TORCH_CHECK(growth_tracker.numel() == 1, "growth_tracker must be a 1-element tensor.");
  TORCH_CHECK(scale.numel() == 1, "current_scale must be a 1-element tensor.");
  TORCH_CHECK(found_inf.numel() == 1, "found_inf must be a 1-element tensor.");
  TORCH_CHECK(growth_tracker.scalar_type() == at::kInt, "growth_tracker must be an int tensor.");
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "current_scale must be a float tensor.");
  TORCH_CHECK(found_inf.scalar_type() == at::kFloat, "found_inf must be a float tensor.");

  const at::Tensor found = found_inf.ne(0);
  const at::Tensor wide = scale.to(at::kDouble);
  const at::Tensor backed_off = wide.mul(backoff_factor).to(at::kFloat);
  const at::Tensor grown = wide.mul(growth_factor).to(at::kFloat);
  const at::Tensor successful = growth_tracker.add(1);
  // Compared in int64, as the kernels compare int with int64_t growth_interval.
  const at::Tensor at_interval = successful.to(at::kLong).eq(growth_interval);
  const at::Tensor grow = at_interval.logical_and(at::isfinite(grown)).logical_and(found.logical_not());

  at::Tensor back_off = found;
  if (ext.hysteresis > 1) {
    TORCH_CHECK(ext.hysteresis_tracker != nullptr && ext.hysteresis_tracker->defined(),
                "amp: internal error: hysteresis > 1 without a hysteresis tracker");
    at::Tensor& remaining = *ext.hysteresis_tracker;
    // DeepSpeed (consecutive_hysteresis=True): back off only when the counter
    // is down to 1; an absorbed overflow decrements it (never below 1); a
    // clean step refills it.
    back_off = found.logical_and(remaining.le(1));
    const at::Tensor next_remaining =
        at::where(found, remaining.sub(1).clamp_min(1), at::full_like(remaining, ext.hysteresis));
    remaining.copy_(next_remaining);
  }

  at::Tensor new_scale = at::where(back_off, backed_off, at::where(grow, grown, scale));
  if (ext.min_scale > 0.0 || !std::isinf(ext.max_scale)) {
    const c10::optional<at::Scalar> lo = ext.min_scale > 0.0 ? c10::optional<at::Scalar>(ext.min_scale) : c10::nullopt;
    const c10::optional<at::Scalar> hi =
        std::isinf(ext.max_scale) ? c10::nullopt : c10::optional<at::Scalar>(ext.max_scale);
    new_scale = new_scale.clamp(lo, hi);
  }
  const at::Tensor new_tracker = at::where(found.logical_or(at_interval), at::zeros_like(growth_tracker), successful);
  scale.copy_(new_scale);
  growth_tracker.copy_(new_tracker);
}

// torch's update rule with the fused kernel where the device has one and no
// extension is on; else the portable path.
inline void update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, const at::Tensor& found_inf,
                          double growth_factor, double backoff_factor, int64_t growth_interval,
                          const ScaleUpdateExtensions& ext = {}) {
  if (!ext.any() && has_amp_kernels(scale.device().type())) {
    at::_amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval);
  } else {
    portable_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, ext);
  }
}

}  // namespace detail
}  // namespace amp
