// amp/scaler/options.h: the options of DynamicScaler (= GradScaler) and StaticScaler.
//
//   amp::DynamicScaler scaler(amp::DynamicScalerOptions().init_scale(1024.0).growth_interval(1000));
//   amp::DynamicScaler guarded(amp::DynamicScalerOptions().min_scale(1.0).hysteresis(2));
//   amp::StaticScaler fixed(amp::StaticScalerOptions().scale(128.0));
//
// Setters chain and getters share the name, as LibTorch's optimizer options
// (TORCH_ARG). The values are checked when a scaler is constructed, not here.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <limits>

namespace amp {

// The options of DynamicScaler. The first five are torch.amp.GradScaler's
// constructor arguments with its defaults. The extensions after them are off by
// default, and then the scaler is torch's bit for bit (same scale trajectory,
// same state_dict keys).
struct DynamicScalerOptions {
  // --- torch.amp.GradScaler's arguments and defaults ---
  TORCH_ARG(double, init_scale) = 65536.0;     // 2**16; must be finite and > 0
  TORCH_ARG(double, growth_factor) = 2.0;      // must be > 1 (torch asserts it)
  TORCH_ARG(double, backoff_factor) = 0.5;     // must be in (0, 1) (torch asserts < 1)
  TORCH_ARG(int64_t, growth_interval) = 2000;  // must be >= 1
  // When false every method is a no-op or the identity, as torch's `enabled=False`.
  TORCH_ARG(bool, enabled) = true;

  // --- extensions (amp only) ---
  // Lower bound of the scale after each automatic update(); 0 means unbounded
  // (a scale is never negative). DeepSpeed's `min_scale`.
  TORCH_ARG(double, min_scale) = 0.0;
  // Upper bound of the scale after each automatic update(); +inf means
  // unbounded. Bounds are applied in fp32, the scale's dtype.
  TORCH_ARG(double, max_scale) = std::numeric_limits<double>::infinity();
  // Number of consecutive overflowing steps before the scale backs off.
  // DeepSpeed's `delayed_shift` with `consecutive_hysteresis=True`: every
  // overflow decrements a counter (it never goes below 1), the scale backs off
  // only when the counter is 1, and every clean step refills it. The step is
  // skipped on every overflow either way. 1 is torch's behaviour.
  TORCH_ARG(int64_t, hysteresis) = 1;
};

// The options of StaticScaler: a fixed loss scale that never changes.
struct StaticScalerOptions {
  // 2**16, GradScaler's initial scale, so that swapping scalers does not change
  // the first iteration. A fixed scale cannot recover from overflow: if steps
  // keep being skipped, pick a smaller one (or use DynamicScaler). Must be
  // finite and > 0.
  TORCH_ARG(double, scale) = 65536.0;
  TORCH_ARG(bool, enabled) = true;
};

}  // namespace amp
