// amp/scaler/loss_scaler.h: LossScalerBase, what DynamicScaler and StaticScaler share.
//
//   class MyScaler : public amp::LossScalerBase { ... update() ... };
//
// torch.amp.GradScaler's scale / unscale_ / step and their bookkeeping (per
// optimizer READY -> UNSCALED -> STEPPED stages keyed by the optimizer's
// address, gradients grouped by device and dtype, torch's error messages).
// The scale-update rule is the derived class's.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/detail/per_device.h"
#include "amp/scaler/state_dict.h"
#include "amp/scaler/detail/unscale.h"
#include "amp/core/scaler_concept.h"

namespace amp {
namespace detail {

// torch.amp.GradScaler's per-optimizer stages (OptState).
enum class OptState { kReady, kUnscaled, kStepped };

struct PerOptimizerState {
  OptState stage = OptState::kReady;
  // One found-inf flag per device that held gradients, in first-seen order.
  std::vector<std::pair<c10::Device, at::Tensor>> found_inf_per_device;
};

}  // namespace detail

// scale / unscale_ / step and their bookkeeping, exactly as torch.amp.GradScaler.
// The scale-update rule is the derived class's.
class LossScalerBase {
  using OptState = detail::OptState;
  using PerOptimizerState = detail::PerOptimizerState;

 public:
  static constexpr bool kLossScaling = true;

  LossScalerBase(const LossScalerBase&) = delete;
  LossScalerBase& operator=(const LossScalerBase&) = delete;
  LossScalerBase(LossScalerBase&&) = default;
  LossScalerBase& operator=(LossScalerBase&&) = default;
  ~LossScalerBase() = default;

  // Multiplies by the scale. The first call creates the scale (fp32, 0-dim) on
  // the tensor's device. Identity when disabled.
  at::Tensor scale(const at::Tensor& outputs) {
    if (!enabled_) {
      return outputs;
    }
    if (!scale_.defined()) {
      lazy_init_scale(outputs.device());
    }
    return outputs * scale_.to(outputs.device(), /*non_blocking=*/true);
  }

  // As torch for an iterable: the scale is created on the first tensor's
  // device and copied once per other device.
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs) {
    if (!enabled_ || outputs.empty()) {
      return outputs;
    }
    if (!scale_.defined()) {
      lazy_init_scale(outputs.front().device());
    }
    detail::PerDevice scales;  // torch's _MultiDeviceReplicator
    std::vector<at::Tensor> scaled;
    scaled.reserve(outputs.size());
    for (const at::Tensor& output : outputs) {
      scaled.push_back(output * scales.copy(scale_, output.device()));
    }
    return scaled;
  }

  // Divides the optimizer's gradients by the scale in place and records
  // whether any was inf/NaN, without a host sync. At most once per optimizer
  // between update()s, and not after step() (torch's RuntimeErrors).
  void unscale_(torch::optim::Optimizer& optimizer) {
    if (!enabled_) {
      return;
    }
    check_scale_initialized("unscale_");
    PerOptimizerState& state = states_[&optimizer];
    TORCH_CHECK(state.stage != OptState::kUnscaled,
                "unscale_() has already been called on this optimizer since the last update().");
    TORCH_CHECK(state.stage != OptState::kStepped, "unscale_() is being called after step().");
    // As torch: "FP32 division can be imprecise for certain compile options, so
    // we carry out the reciprocal in FP64."
    const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
    state.found_inf_per_device = unscale_grads(optimizer, inv_scale);
    sync_found_infs(state);
    state.stage = OptState::kUnscaled;
  }

  // Unscales (unless unscale_ was called) and calls optimizer.step() unless a
  // gradient was inf/NaN. Returns what optimizer.step() returned, or an
  // undefined tensor when the step was skipped. Reads the found-inf flags on
  // the host: the one sync of an iteration, as in torch.
  at::Tensor step(torch::optim::Optimizer& optimizer) {
    if (!enabled_) {
      return optimizer.step();
    }
    check_scale_initialized("step");
    PerOptimizerState& state = states_[&optimizer];  // std::map: stays valid across unscale_
    TORCH_CHECK(state.stage != OptState::kStepped, "step() has already been called since the last update().");
    if (state.stage == OptState::kReady) {
      unscale_(optimizer);
    }
    TORCH_CHECK(!state.found_inf_per_device.empty(), "No inf checks were recorded for this optimizer.");
    // Python's any(v.item() for v in ...): NaN is truthy, as != 0 is here.
    bool found_inf = false;
    for (const auto& device_and_flag : state.found_inf_per_device) {
      if (device_and_flag.second.item<float>() != 0.0f) {
        found_inf = true;
        break;
      }
    }
    at::Tensor result;
    if (!found_inf) {
      result = optimizer.step();
    }
    state.stage = OptState::kStepped;
    return result;
  }

  // The fused step, an explicit choice (never what step(optimizer) does):
  // torch's GradScaler.step for an optimizer with _step_supports_amp_scaling
  // (Adam/AdamW/SGD with fused=True). Without unscale_ the gradients are only
  // checked (torch's _check_inf_per_device) and the kernel divides them by the
  // scale; after unscale_ they are taken as they are. The kernel skips the
  // update when a gradient was inf/NaN. No host sync at all. (A template on
  // FusedStep only: the optim layer, above this one, defines it.)
  template <class Fused, std::enable_if_t<std::is_same_v<Fused, FusedStep>, int> = 0>
  void step(torch::optim::Optimizer& optimizer, Fused& fused) {
    TORCH_CHECK(&fused.optimizer() == &optimizer,
                "amp: step(optimizer, fused): `fused` was made for another optimizer; use FusedStep(optimizer)");
    if (!enabled_) {
      fused.step();
      return;
    }
    check_scale_initialized("step");
    PerOptimizerState& state = states_[&optimizer];
    TORCH_CHECK(state.stage != OptState::kStepped, "step() has already been called since the last update().");
    at::Tensor grad_scale;
    if (state.stage == OptState::kReady) {
      state.found_inf_per_device = unscale_grads(optimizer, at::ones({}, scale_.options()));
      sync_found_infs(state);
      grad_scale = scale_;
    }
    TORCH_CHECK(!state.found_inf_per_device.empty(), "No inf checks were recorded for this optimizer.");
    std::vector<at::Tensor> flags;
    append_flags(state, flags);
    fused.step(grad_scale, sum(flags));
    state.stage = OptState::kStepped;
  }

  // torch's _get_scale_async: the scale tensor itself (fp32, 0-dim, updated
  // in place by update()), no sync; undefined before the first scale() and
  // when disabled.
  at::Tensor get_scale_async() const { return enabled_ ? scale_ : at::Tensor(); }

  // The current scale (a host sync), init_scale before the first scale(), 1.0 when disabled.
  double get_scale() const {
    if (!enabled_) {
      return 1.0;
    }
    return scale_.defined() ? static_cast<double>(scale_.item<float>()) : init_scale_;
  }

  bool is_enabled() const { return enabled_; }

  // amp extension: the iteration's combined found-inf flag, a 0-dim fp32
  // tensor on the scale's device (nonzero: some optimizer saw inf/NaN), read
  // without a sync. Between unscale_/step and update() it sums the flags
  // recorded so far; after update() it is the flag that update() consumed,
  // until the next unscale_. Undefined before the first unscale_ and when
  // disabled.
  at::Tensor found_inf() const {
    if (!enabled_) {
      return at::Tensor();
    }
    std::vector<at::Tensor> flags = recorded_found_infs();
    return flags.empty() ? last_found_inf_ : sum(flags);
  }

  // amp extension: forgets this iteration's unscale_/step records without
  // touching the scale, as after an aborted step (a failed capture).
  void discard_iteration() { reset_optimizer_states(); }

  // amp extension: a function that sums each optimizer's found-inf flags
  // over the processes in place (an all-reduce), run after every check of
  // its gradients (unscale_, and the fused step's check), as torch's
  // ShardedGradScaler does in unscale_: processes that hold shards of the
  // gradients then make one skip decision and keep one scale. An optimizer
  // without gradients on this process still takes part, with a zero flag on
  // the scale's device. nullptr (the default): no such step. The Stepper and
  // Fabric install it under a GradientSync that shards parameters (FullyShard).
  void set_found_inf_sync(std::function<void(at::Tensor&)> sync) { found_inf_sync_ = std::move(sync); }

 protected:
  LossScalerBase(bool enabled, double init_scale) : enabled_(enabled), init_scale_(init_scale) {}

  // torch's _check_scale_growth_tracker message.
  void check_scale_initialized(const char* funcname) const {
    TORCH_CHECK(scale_.defined(), "Attempted ", funcname,
                " but _scale is None.  This may indicate your script did not use scaler.scale(loss or outputs) "
                "earlier in the iteration.");
  }

  // Every optimizer's per-device flags, moved to the scale's device.
  std::vector<at::Tensor> recorded_found_infs() const {
    std::vector<at::Tensor> flags;
    for (const auto& optimizer_and_state : states_) append_flags(optimizer_and_state.second, flags);
    return flags;
  }

  // One optimizer's per-device flags, moved to the scale's device.
  void append_flags(const PerOptimizerState& state, std::vector<at::Tensor>& flags) const {
    for (const auto& device_and_flag : state.found_inf_per_device)
      flags.push_back(device_and_flag.second.to(scale_.device(), /*non_blocking=*/true));
  }

  static at::Tensor sum(const std::vector<at::Tensor>& flags) {
    at::Tensor total = flags.front();
    for (size_t i = 1; i < flags.size(); ++i) {
      total = total + flags[i];
    }
    return total;
  }

  // update()'s common part: the combined flag ("No inf checks were recorded
  // prior to update." when there is none), remembered for found_inf().
  at::Tensor consume_found_infs() {
    std::vector<at::Tensor> flags = recorded_found_infs();
    TORCH_CHECK(!flags.empty(), "No inf checks were recorded prior to update.");
    last_found_inf_ = sum(flags);
    return last_found_inf_;
  }

  // "To prepare for next iteration, clear the data collected from optimizers this iteration."
  void reset_optimizer_states() { states_.clear(); }

  // load_state_dict's common part (call it only when enabled): torch's error
  // for an empty dict, with the scaler's class name, then the "scale" entry,
  // which fills the scale if it exists, else becomes its lazy initial value.
  void load_scale(const StateDict& state, const char* class_name) {
    TORCH_CHECK(state.size() != 0,
                "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of ",
                class_name, ".");
    init_scale_ = detail::state_double(state, "scale");
    if (scale_.defined()) {
      scale_.fill_(init_scale_);
    }
  }

  bool enabled_;
  double init_scale_;  // torch's _init_scale: the lazy scale's value, set by load_state_dict
  at::Tensor scale_;   // fp32, 0-dim; undefined until the first scale()

 private:
  void lazy_init_scale(const c10::Device& device) {
    scale_ = at::full({}, init_scale_, at::TensorOptions().dtype(at::kFloat).device(device));
  }

  // torch's _unscale_grads_ with allow_fp16=False: grads of all param groups,
  // split by device and dtype, each group unscaled with one call.
  std::vector<std::pair<c10::Device, at::Tensor>> unscale_grads(torch::optim::Optimizer& optimizer,
                                                                const at::Tensor& inv_scale) {
    using DtypeGroups = std::vector<std::pair<at::ScalarType, std::vector<at::Tensor>>>;
    std::vector<std::pair<c10::Device, DtypeGroups>> per_device_and_dtype;
    at::NoGradGuard no_grad;
    for (auto& group : optimizer.param_groups()) {
      for (auto& param : group.params()) {
        const at::Tensor& grad = param.grad();
        if (!grad.defined()) {
          continue;
        }
        TORCH_CHECK_VALUE(grad.scalar_type() != at::kHalf, "Attempting to unscale FP16 gradients.");
        // Sparse (COO) gradients: their values are unscaled in place. torch
        // coalesces only fp16 sparse grads, which are rejected just above.
        at::Tensor to_unscale = grad.is_sparse() ? grad._values() : grad;
        DtypeGroups* dtypes = nullptr;
        for (auto& entry : per_device_and_dtype) {
          if (entry.first == to_unscale.device()) {
            dtypes = &entry.second;
          }
        }
        if (dtypes == nullptr) {
          per_device_and_dtype.emplace_back(to_unscale.device(), DtypeGroups{});
          dtypes = &per_device_and_dtype.back().second;
        }
        std::vector<at::Tensor>* grads = nullptr;
        for (auto& entry : *dtypes) {
          if (entry.first == to_unscale.scalar_type()) {
            grads = &entry.second;
          }
        }
        if (grads == nullptr) {
          dtypes->emplace_back(to_unscale.scalar_type(), std::vector<at::Tensor>{});
          grads = &dtypes->back().second;
        }
        grads->push_back(std::move(to_unscale));
      }
    }
    std::vector<std::pair<c10::Device, at::Tensor>> found_inf_per_device;
    detail::PerDevice inv_scales;
    for (auto& device_and_dtypes : per_device_and_dtype) {
      const c10::Device& device = device_and_dtypes.first;
      // A zeroed flag per device, as torch's replicas of its zeroed found_inf.
      at::Tensor found_inf = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
      const at::Tensor& device_inv_scale = inv_scales.copy(inv_scale, device);
      for (auto& dtype_and_grads : device_and_dtypes.second) {
        detail::non_finite_check_and_unscale_(dtype_and_grads.second, found_inf, device_inv_scale);
      }
      found_inf_per_device.emplace_back(device, std::move(found_inf));
    }
    return found_inf_per_device;
  }

  // After a check of one optimizer's gradients: each flag all-reduced (the
  // zero flag of an optimizer with no gradient here first), when a sync is set.
  void sync_found_infs(PerOptimizerState& state) {
    if (!found_inf_sync_) return;
    if (state.found_inf_per_device.empty())
      state.found_inf_per_device.emplace_back(scale_.device(), at::zeros({}, scale_.options()));
    for (auto& device_and_flag : state.found_inf_per_device) found_inf_sync_(device_and_flag.second);
  }

  std::map<const torch::optim::Optimizer*, PerOptimizerState> states_;
  at::Tensor last_found_inf_;
  std::function<void(at::Tensor&)> found_inf_sync_;
};

}  // namespace amp
