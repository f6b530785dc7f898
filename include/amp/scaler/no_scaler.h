// amp/scaler/no_scaler.h: the scaler of policies that need no loss scaling.
//
//   amp::NoScaler s;
//   s.scale(loss).backward();   // loss unchanged
//   s.step(optimizer);          // plain optimizer.step()
//   s.update();                 // no-op
//
// Used by Mixed<bf16, NoScaler> (bf16 has fp32's exponent range) and every
// True<> policy. Behaves like a disabled torch.amp.GradScaler: scale() is the
// identity, step() always steps, state_dict() is empty.
#pragma once

#include <torch/optim/optimizer.h>

#include <vector>

#include "amp/scaler/state_dict.h"
#include "amp/core/scaler_concept.h"

namespace amp {

class NoScaler {
 public:
  static constexpr bool kLossScaling = false;

  NoScaler() = default;

  at::Tensor scale(const at::Tensor& outputs) const { return outputs; }
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs) const { return outputs; }
  void unscale_(torch::optim::Optimizer& /*optimizer*/) {}
  // As GradScaler.step when disabled: returns what optimizer.step() returns.
  at::Tensor step(torch::optim::Optimizer& optimizer) { return optimizer.step(); }
  void update() {}
  double get_scale() const { return 1.0; }
  bool is_enabled() const { return false; }
  // Undefined: no inf/NaN check is ever made without loss scaling.
  at::Tensor found_inf() const { return at::Tensor(); }
  StateDict state_dict() const { return empty_state_dict(); }
  // A NoScaler has no state; any dict (typically the empty one it saved) loads.
  void load_state_dict(const StateDict& /*state*/) {}
  void load_state_dict(const c10::impl::GenericDict& /*state*/) {}
};

static_assert(detail::builtin_scaler_matches_v<NoScaler>, "amp: NoScaler must match scaler_concept.h's builtin_scaler");

}  // namespace amp
