// amp/train/stepper.h: one optimizer step of a mixed-precision loop, as a component.
//
//   amp::Stepper<amp::DynamicScaler> stepper(optimizer, amp::StepOptions().max_grad_norm(1.0));
//   auto r = stepper.step(loss);     // scaled backward; at the boundary: unscale, clip, step/skip, update
//   if (r.optimizer_step && r.skipped()) { /* inf/NaN gradients: optimizer step skipped, scale backed off */ }
//
// This is the part of Trainer that does not depend on autocast: torch's AMP
// recipe (scale(loss).backward(); unscale_; clip_grad_norm_; step; update)
// with gradient accumulation. Trainer runs it after the user's forward; tests
// drive it directly with a DynamicScaler on fp32 gradients, which is how the
// loss-scaling path is covered on a CPU LibTorch without fp16 autocast.
#pragma once

#include <torch/arg.h>
#include <ATen/ATen.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/optim/optimizer_step.h"
#include "amp/core/scaler_concept.h"
#include "amp/train/gradient_sync.h"

namespace amp {

// How each optimizer step is taken: clipping, accumulation, the fused path.
// The Stepper's options, TrainerOptions::step and, per optimizer,
// Fabric::setup's.
struct StepOptions {
  // Clip the gradients' total norm to this value after unscaling (0 = off),
  // as torch's recipe: scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt).
  TORCH_ARG(double, max_grad_norm) = 0.0;
  TORCH_ARG(double, norm_type) = 2.0;
  // Micro-batches per optimizer step; each micro-batch's loss is divided by it.
  TORCH_ARG(int64_t, accumulation_steps) = 1;
  // Use ATen's fused optimizer kernels (optim/fused.h) where they serve the
  // optimizer: no host sync per step. false: the optimizer's own step().
  TORCH_ARG(bool, fused) = true;
};

namespace detail {
// T has a Stepper (a Trainer), not a GradientSync of its own (a Fabric).
template <class T, class = void>
struct has_stepper : std::false_type {};
template <class T>
struct has_stepper<T, std::void_t<decltype(std::declval<T&>().stepper().set_gradient_sync(nullptr))>> : std::true_type {
};

// The GradientSync a Trainer's Stepper or a Fabric has installed (nullptr: none).
template <class T>
GradientSync* gradient_sync_of(const T& trainer) {
  if constexpr (has_stepper<T>::value) {
    return trainer.stepper().gradient_sync();
  } else {
    return trainer.gradient_sync();
  }
}

// An optimizer that re-evaluates the loss inside step(closure).
inline bool closure_based(const torch::optim::Optimizer& opt) {
  return dynamic_cast<const torch::optim::LBFGS*>(&opt) != nullptr;
}

// A closure-based optimizer steps once per closure: no accumulation.
inline void check_accumulation(const torch::optim::Optimizer& opt, int64_t accumulation_steps) {
  TORCH_CHECK(!closure_based(opt) || accumulation_steps == 1,
              "amp: gradient accumulation does not apply to a closure-based optimizer (LBFGS); set "
              "accumulation_steps(1)");
}

// The checks on a loss before its backward, for the Stepper (who: "") and
// Fabric::backward (who: "backward(): "); hint: where to compute it.
inline void check_loss(const at::Tensor& loss, const char* who, const char* hint) {
  TORCH_CHECK(loss.defined(), "amp: ", who, "the loss is an undefined tensor; return the loss tensor");
  TORCH_CHECK(loss.numel() == 1, "amp: ", who, "the loss must have one element, got shape ", loss.sizes(),
              "; reduce it first (e.g. loss.mean())");
  TORCH_CHECK(loss.requires_grad(), "amp: ", who,
              "the loss does not require grad, so backward() cannot reach the parameters; compute it from ", hint,
              " (not under torch::NoGradGuard or evaluate())");
}

inline void validate(const StepOptions& o) {
  TORCH_CHECK(o.max_grad_norm() >= 0.0, "amp: max_grad_norm must be >= 0 (0 turns clipping off), got ",
              o.max_grad_norm());
  TORCH_CHECK(o.norm_type() > 0.0, "amp: norm_type must be > 0 (2 for the L2 norm), got ", o.norm_type());
  TORCH_CHECK(o.accumulation_steps() >= 1, "amp: accumulation_steps must be >= 1, got ", o.accumulation_steps());
}
}  // namespace detail

// What one call of step() did. Tensors, so that no host sync is forced;
// the accessors that return C++ values do sync.
struct StepResult {
  at::Tensor loss;              // detached; at an optimizer step, the mean over the accumulated micro-batches
  at::Tensor found_inf;         // 0-dim float, 1 if the step was skipped; undefined if no check was made
  bool optimizer_step = false;  // this call ended an accumulation cycle: the optimizer stepped, or skipped

  double loss_value() const { return loss.item<double>(); }
  bool skipped() const { return optimizer_step && found_inf.defined() && found_inf.item<double>() != 0.0; }
};

template <class Scaler>
class Stepper {
  static_assert(is_scaler_v<Scaler>,
                "amp: Stepper<Scaler> needs a type with the scaler interface; use amp::DynamicScaler, "
                "amp::StaticScaler or amp::NoScaler");

 public:
  using scaler_type = Scaler;

  explicit Stepper(torch::optim::Optimizer& optimizer, StepOptions options = {}, Scaler scaler = Scaler())
      : options_((detail::validate(options), std::move(options))),
        scaler_(std::move(scaler)),
        part_(optimizer, options_.fused(), options_.max_grad_norm(), options_.norm_type()) {
    detail::check_accumulation(optimizer, options_.accumulation_steps());
  }

  // One micro-batch: backward of the (scaled, accumulation-divided) loss; at
  // the accumulation boundary also unscale, clip, step or skip, update.
  // Gradients are zeroed at the start of each accumulation cycle.
  // With a fixed state (make_static()), the gradients are zeroed in place
  // rather than reset, so that every step writes the same tensors.
  StepResult step(const at::Tensor& loss) {
    detail::check_loss(loss, "", "the model's output inside the step function");
    if (micro_ == 0) zero_grad();
    return backward_and_step(loss);
  }

 private:
  void zero_grad() {
    if (!part_.is_static()) return part_.optimizer().zero_grad();
    std::vector<at::Tensor> grads = part_.parameters();
    for (at::Tensor& g : grads) g = g.grad();
    at::NoGradGuard no_grad;
    if (!grads.empty()) at::_foreach_zero_(grads);
  }

  StepResult backward_and_step(const at::Tensor& loss) {
    const int64_t n = options_.accumulation_steps();
    if (micro_ == 0) loss_sum_ = at::Tensor();
    const at::Tensor detached = loss.detach();
    loss_sum_ = loss_sum_.defined() ? loss_sum_ + detached : detached.clone();
    const bool boundary = micro_ + 1 == n;
    if (sync_ != nullptr) sync_->begin_backward(boundary);
    scaler_.scale(n > 1 ? loss / static_cast<double>(n) : loss).backward();
    if (!boundary) return ++micro_, StepResult{detached, at::Tensor(), false};
    micro_ = 0;
    if (sync_ != nullptr) sync_->finish_backward();
    return finish_step(n > 1 ? loss_sum_ / static_cast<double>(n) : loss_sum_);
  }

 public:
  // The boundary half of step(), for callers that ran backward themselves
  // (LBFGS-style closures excluded): unscale, clip, step or skip, update.
  StepResult finish_step(at::Tensor loss) {
    part_.run(scaler_);
    at::Tensor found_inf;
    if constexpr (scaler_capabilities<Scaler>::found_inf) found_inf = scaler_.found_inf();
    scaler_.update();
    ++steps_;
    return StepResult{std::move(loss), std::move(found_inf), true};
  }

  // One step of a closure-based optimizer (LBFGS), which re-evaluates the
  // loss inside optimizer.step(closure): `forward()` returns the loss; the
  // closure zeroes the gradients, runs backward and clips. No loss scaling
  // can run inside the optimizer (Trainer rejects that combination), and
  // there is no accumulation.
  template <class Forward>
  StepResult closure_step(Forward&& forward) {
    static_assert(!detail::uses_loss_scaling_v<Scaler>,
                  "amp: a closure-based optimizer (LBFGS) cannot be used with a loss-scaling scaler; use "
                  "amp::NoScaler (policies amp::Mixed<amp::bf16, amp::NoScaler> or amp::True<...>)");
    at::Tensor last;
    torch::optim::Optimizer& optimizer = part_.optimizer();
    optimizer.step([&] {
      optimizer.zero_grad();
      at::Tensor loss = forward();
      loss.backward();
      if (options_.max_grad_norm() > 0.0) part_.clip();
      last = loss.detach();
      return loss;
    });
    ++steps_;
    return StepResult{last, at::Tensor(), true};
  }

  // Whether steps take the fused, sync-free path; and which path, in words.
  bool fused() const { return part_.fused(); }
  std::string optimizer_path() const { return part_.optimizer_path(); }
  // Brings the fused path's device step counters into optimizer.state() (a
  // host sync): call before saving the optimizer. A no-op on the unfused path.
  void sync_optimizer_state() const { part_.sync_optimizer_state(); }
  // After optimizer.load(): the fused path rereads the optimizer's state.
  void reload_optimizer_state() { part_.reload_optimizer_state(); }

  // A fixed state: the fused path's state made now and kept (FusedStep::make_static),
  // gradients zeroed in place; every step then writes the same tensors, as a
  // CUDA graph of the step needs (amp::capture). Until reload_optimizer_state().
  void make_static() {
    TORCH_CHECK(part_.fused(), "amp: make_static() needs the fused step, and this Stepper takes the ",
                part_.optimizer_path(), " path");
    part_.make_static();
  }
  bool is_static() const { return part_.is_static(); }

  // Installs (or, with nullptr, removes) the hook of multi-process training;
  // not owned, it must outlive the Stepper's steps.
  void set_gradient_sync(GradientSync* sync) {
    if (options_.max_grad_norm() > 0.0)
      detail::check_not_sharded(sync, "StepOptions::max_grad_norm",
                                "clip with fsdp.clip_grad_norm(max_norm) between backward and "
                                "stepper.finish_step(loss), and leave max_grad_norm at 0");
    if constexpr (detail::uses_loss_scaling_v<Scaler>) detail::connect_found_inf(scaler_, sync);
    sync_ = sync;
  }
  GradientSync* gradient_sync() const { return sync_; }

  Scaler& scaler() { return scaler_; }
  const Scaler& scaler() const { return scaler_; }
  torch::optim::Optimizer& optimizer() { return part_.optimizer(); }
  const torch::optim::Optimizer& optimizer() const { return part_.optimizer(); }
  const StepOptions& options() const { return options_; }
  // Optimizer steps taken (skipped ones included), and micro-batches into the current one.
  int64_t steps() const { return steps_; }
  int64_t micro_step() const { return micro_; }
  void set_steps(int64_t steps) { steps_ = steps; }

  // The parameters of all param groups that have a gradient.
  std::vector<at::Tensor> parameters() const { return part_.parameters(); }

 private:
  StepOptions options_;
  Scaler scaler_;
  // The optimizer's part of the recipe (unscale, clip, fused or unfused step).
  detail::OptimizerStep<Scaler> part_;
  GradientSync* sync_ = nullptr;
  int64_t micro_ = 0;
  int64_t steps_ = 0;
  at::Tensor loss_sum_;
};

}  // namespace amp
