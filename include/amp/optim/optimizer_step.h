// amp/optim/optimizer_step.h: one optimizer's part of torch's AMP recipe after
// backward, shared by Stepper (one optimizer) and Fabric (several under one scaler).
//
//   amp::detail::OptimizerStep<amp::DynamicScaler> part(optimizer, /*fused=*/true, /*max_grad_norm=*/1.0, 2.0);
//   part.run(scaler);     // scaler.unscale_(opt); clip; scaler.step(opt) (fused where eligible)
//   scaler.update();      // the caller's, once per iteration
//
// torch's recipe per optimizer: `scaler.unscale_(opt); clip_grad_norm_(...);
// scaler.step(opt)`. The fused path (optim/fused.h) is taken where a fused
// kernel serves the optimizer on its parameters' device and the scaler can
// drive it (or does not scale): no host sync. Clipping keeps the norm on the
// device (clip_grad_norm_no_sync).
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/optim/fused.h"
#include "amp/core/scaler_concept.h"

namespace amp {
namespace detail {

// torch's clip_grad_norm_ (LibTorch's C++ one, op for op, so the gradients
// are bitwise the same) without its final item(): the total norm stays a
// tensor and nothing waits for the device.
inline at::Tensor clip_grad_norm_no_sync(const std::vector<at::Tensor>& params, double max_norm, double norm_type) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return at::Tensor();
  at::NoGradGuard no_grad;
  at::Tensor total;
  std::vector<at::Tensor> norms;
  norms.reserve(grads.size());
  if (std::isinf(norm_type)) {
    for (const auto& g : grads) norms.push_back(g.abs().max());
    total = norms.size() == 1 ? norms[0] : at::max(at::stack(norms));
  } else if (norm_type == 0) {
    total = at::full({}, static_cast<double>(grads.size()));
  } else {
    for (const auto& g : grads) norms.push_back(g.norm(norm_type));
    total = norms.size() == 1 ? norms[0] : at::stack(norms).norm(norm_type);
  }
  const at::Tensor coef = at::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
  for (auto& g : grads) g.mul_(coef);
  return total;
}

template <class Scaler>
class OptimizerStep {
 public:
  // fused: take the fused path where it serves the optimizer (else its own
  // step()). max_grad_norm 0: no clipping.
  OptimizerStep(torch::optim::Optimizer& optimizer, bool fused, double max_grad_norm, double norm_type)
      : optimizer_(&optimizer), max_grad_norm_(max_grad_norm), norm_type_(norm_type) {
    if (fused && (!uses_loss_scaling_v<Scaler> || scaler_capabilities<Scaler>::fused_step)) {
      const auto& groups = optimizer.param_groups();
      if (!groups.empty() && !groups.front().params().empty() &&
          fused_kind(optimizer, groups.front().params().front().device().type()) != FusedKind::kNone) {
        fused_.emplace(optimizer);
      }
    }
  }

  // unscale_ and clip (when clipping), then the scaler's step: skipped on
  // inf/NaN in this optimizer's gradients. The scaler's update() is the caller's.
  void run(Scaler& scaler) {
    if (max_grad_norm_ > 0.0) {
      scaler.unscale_(*optimizer_);  // clip the true gradients, not the scaled ones
      clip();
    }
    if (fused_) {
      if constexpr (scaler_capabilities<Scaler>::fused_step) {
        scaler.step(*optimizer_, *fused_);
      } else {
        fused_->step();
      }
    } else {
      scaler.step(*optimizer_);
    }
  }

  // Clips the gradients of all param groups to max_grad_norm (no sync).
  void clip() { clip_grad_norm_no_sync(parameters(), max_grad_norm_, norm_type_); }

  bool fused() const { return fused_.has_value(); }
  double max_grad_norm() const { return max_grad_norm_; }
  std::string optimizer_path() const {
    if (!fused_)
      return "unfused (the optimizer's own step()" +
             std::string(uses_loss_scaling_v<Scaler> ? "; one host sync per step to decide a skip)" : ")");
    if (fused_->kind() == FusedKind::kOptimizer)
      return "sync-free (" + fused_->own_step()->step_path() + ", no host sync)";
    return std::string("fused (") + fused_kind_name(fused_->kind()) + " kernel, no host sync)";
  }
  // The fused path's device step counters into optimizer.state() (a host
  // sync), before saving the optimizer; a no-op on the unfused path.
  void sync_optimizer_state() const {
    if (fused_) fused_->sync_optimizer_state();
  }
  // After optimizer.load(): the fused path rereads the optimizer's state.
  void reload_optimizer_state() {
    if (fused_) fused_->reload_optimizer_state();
  }
  // FusedStep::make_static (callers check fused() first).
  void make_static() { fused_->make_static(); }
  bool is_static() const { return fused_ && fused_->is_static(); }

  // The parameters of all param groups that have a gradient.
  std::vector<at::Tensor> parameters() const {
    std::vector<at::Tensor> params;
    for (const auto& group : optimizer_->param_groups())
      for (const auto& p : group.params())
        if (p.grad().defined()) params.push_back(p);
    return params;
  }

  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  const torch::optim::Optimizer& optimizer() const { return *optimizer_; }

 private:
  torch::optim::Optimizer* optimizer_;
  double max_grad_norm_;
  double norm_type_;
  // mutable: sync_optimizer_state() const (for a const save()) writes the
  // device counters into the optimizer's state, which is not ours.
  mutable std::optional<FusedStep> fused_;
};

}  // namespace detail
}  // namespace amp
