// amp/optim/supports_amp_scaling.h: SupportsAmpScaling, the interface of an
// optimizer whose step takes GradScaler's grad_scale and found_inf itself, on
// the device (Python's `_step_supports_amp_scaling`, as torch's fused Adam has).
//
//   class MyOptimizer : public torch::optim::Optimizer, public amp::SupportsAmpScaling { ... };
//   amp::FusedStep fused(my_optimizer);      // FusedKind::kOptimizer: step_scaled() is the fused step
//   scaler.step(my_optimizer, fused);        // no host sync; a skip decided on the device
//
// amp's low-bit optimizers (optim/low_bit_adam.h) implement it; FusedStep,
// and so Trainer, Stepper and Fabric, take it as their sync-free path.
#pragma once

#include <string>

#include <ATen/core/Tensor.h>

namespace amp {

class SupportsAmpScaling {
 public:
  virtual ~SupportsAmpScaling() = default;

  // One step of every parameter with a gradient. grad_scale: undefined, or a
  // one-element fp32 tensor that the gradients are divided by (as torch's
  // unscale_: multiplied by its reciprocal), in place, before use. found_inf:
  // undefined, or a one-element fp32 tensor; nonzero skips the whole step
  // (parameters, state and step counts untouched). Either may live on another
  // device than the parameters. No host sync.
  virtual void step_scaled(const at::Tensor& grad_scale, const at::Tensor& found_inf) = 0;

  // Makes the state of every parameter that has a gradient now, so that later
  // steps make and replace no state tensor (a captured step needs that).
  virtual void make_state() = 0;

  // What step_scaled() runs, in words, for the Trainer's "optimizer path" line.
  virtual std::string step_path() const { return "the optimizer's own step_scaled()"; }
};

}  // namespace amp
