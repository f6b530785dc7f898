// amp/scaler/static_scaler.h: StaticScaler, loss scaling with a fixed scale.
//
//   amp::StaticScaler scaler(amp::StaticScalerOptions().scale(1024.0));
//   scaler.scale(loss).backward();
//   scaler.step(optimizer);  scaler.update();   // skips on inf/NaN; the scale stays 1024
//
// Apex's and DeepSpeed's "static loss scale": the same scale / unscale_ / step
// machinery as DynamicScaler (same kernels, same state checks and messages),
// but update() never changes the scale. A step whose gradients hold inf/NaN is
// still skipped: with a fixed scale the same overflow tends to repeat, so
// prefer DynamicScaler unless a fixed scale is known to be safe.
#pragma once

#include <torch/optim/optimizer.h>

#include <cmath>

#include "amp/scaler/state_dict.h"
#include "amp/scaler/loss_scaler.h"
#include "amp/scaler/options.h"
#include "amp/core/scaler_concept.h"

namespace amp {

class StaticScaler : public LossScalerBase {
 public:
  static constexpr bool kLossScaling = true;

  explicit StaticScaler(StaticScalerOptions options = {}) : LossScalerBase(options.enabled(), options.scale()) {
    if (enabled_) {
      TORCH_CHECK(std::isfinite(options.scale()) && options.scale() > 0.0,
                  "amp: StaticScalerOptions::scale must be finite and > 0, got ", options.scale());
    }
  }

  // Ends the iteration: every optimizer is READY again; the scale is left
  // alone. Checks what DynamicScaler::update() checks (a scale() and an inf
  // check this iteration), so that swapping scalers changes no valid program.
  void update() {
    if (!enabled_) {
      return;
    }
    check_scale_initialized("update");
    consume_found_infs();
    reset_optimizer_states();
  }

  // {"scale": float}; empty when disabled.
  StateDict state_dict() const {
    StateDict state = empty_state_dict();
    if (enabled_) {
      state.insert("scale", get_scale());
    }
    return state;
  }

  // Takes "scale" and ignores any other key, so a DynamicScaler checkpoint
  // loads too (its current scale becomes the fixed one). No-op when disabled.
  void load_state_dict(const StateDict& state) {
    if (!enabled_) {
      return;
    }
    load_scale(state, "StaticScaler");
  }
  // A Python-written state dict, as torch::pickle_load(bytes).toGenericDict().
  void load_state_dict(const c10::impl::GenericDict& state) { load_state_dict(detail::typed_state_dict(state)); }
};

static_assert(detail::builtin_scaler_matches_v<StaticScaler>,
              "amp: StaticScaler must match scaler_concept.h's builtin_scaler");

}  // namespace amp
