// amp/scaler/dynamic_scaler.h: StaticScaler.
// INTERFACE SKELETON: the runtime body is being written (issue 3).
#pragma once

#include <torch/optim/optimizer.h>

#include <vector>

#include "amp/scaler/scaler_traits.h"

namespace amp {

class StaticScaler {
 public:
  static constexpr bool kLossScaling = true;
  at::Tensor scale(const at::Tensor& outputs);
  void unscale_(torch::optim::Optimizer& optimizer);
  at::Tensor step(torch::optim::Optimizer& optimizer);
  void update();
  double get_scale() const;
  bool is_enabled() const;
  StateDict state_dict() const;
  void load_state_dict(const StateDict& state);
};


}  // namespace amp
