// amp/optim/fused.h: FusedStep, one step of a user's torch::optim::Adam, AdamW
// or SGD with ATen's fused kernels, GradScaler's grad_scale/found_inf inside,
// no host sync; or one of an amp::SupportsAmpScaling optimizer (the low-bit
// Adams of optim/low_bit_adam.h), through its own step_scaled().
//
//   torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
//   amp::FusedStep fused(optimizer);      // throws "amp: ..." where no fused kernel serves it
//   scaler.step(optimizer, fused);        // torch.optim.AdamW(fused=True) under GradScaler.step()
//   fused.sync_optimizer_state();            // before optimizer.save(): step counts to the host (a sync)
//   optimizer.load(archive);  fused.reload_optimizer_state();
//
// Python's recipe, argument for argument (torch/optim/adam.py _fused_adam,
// adamw.py, sgd.py _fused_sgd; grad_scaler.py step()): per (param group,
// device, dtype) _foreach_add_(steps, 1), the kernel with grad_scale and
// found_inf, _foreach_sub_(steps, found_inf); fp32 device step counters; the
// state in the optimizer's own map, as LibTorch's first step makes it.
// Requirements and sync rules: docs/fused-step.md; differences from Python:
// docs/numerics.md; the kernels: optim/detail/fused_ops.h; the state kept
// beside LibTorch's (device step counters, entries made): optim/detail/fused_state.h.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <utility>
#include <vector>

#include "amp/detail/compat.h"
#include "amp/optim/detail/fused_ops.h"
#include "amp/optim/detail/fused_state.h"

namespace amp {
namespace detail {

// Which fused kernel serves `optimizer` for parameters on `device`: kNone when
// the optimizer is another class (exactly torch::optim::Adam, AdamW or SGD,
// not a subclass), the LibTorch lacks the kernel on that device (compat.h; CPU
// and CUDA only), or a parameter on that device has a dtype the kernels do not
// take (Float, Double, Half, BFloat16) or is not dense and strided.
inline FusedKind fused_kind(const torch::optim::Optimizer& optimizer, c10::DeviceType device) {
  FusedKind kind = FusedKind::kNone;
  return fused::unsupported_reason(optimizer, device, &kind).empty() ? kind : FusedKind::kNone;
}
}  // namespace detail

class FusedStep {
 public:
  // Throws "amp: ..." saying why when no fused kernel serves the optimizer on
  // a device its parameters are on (fused_kind() == kNone). The optimizer must
  // outlive this object. Existing state (a loaded checkpoint, earlier steps of
  // the optimizer's own step()) is taken as it is.
  explicit FusedStep(torch::optim::Optimizer& optimizer) : optimizer_(&optimizer) {
    kind_ = detail::fused::kind_of_class(optimizer);
    TORCH_CHECK(kind_ != FusedKind::kNone,
                "amp: FusedStep: ", detail::fused::unsupported_reason(optimizer, c10::DeviceType::CPU, &kind_));
    own_ = dynamic_cast<SupportsAmpScaling*>(&optimizer);
    if (own_ != nullptr) return;  // kOptimizer: its step_scaled() checks its parameters
    for (const auto& group : optimizer.param_groups())
      for (const auto& p : group.params()) check_device(p.device().type());
  }

  FusedStep(const FusedStep&) = delete;
  FusedStep& operator=(const FusedStep&) = delete;
  FusedStep(FusedStep&&) = default;
  FusedStep& operator=(FusedStep&&) = default;
  ~FusedStep() = default;

  FusedKind kind() const { return kind_; }
  const SupportsAmpScaling* own_step() const { return own_; }  // kOptimizer: the optimizer's step_scaled()
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  const torch::optim::Optimizer& optimizer() const { return *optimizer_; }

  // One step of every parameter with a gradient, as the optimizer's own
  // step() but fused. grad_scale: fp32, one element; the kernels divide the
  // gradients by it (and leave them unscaled), or undefined when they are
  // unscaled already. found_inf: fp32, one element, nonzero to skip the whole
  // step (parameters, state and step counts untouched), or undefined. Either
  // may be on another device than the parameters (copied, non-blocking, once
  // per device). No host sync.
  void step(const at::Tensor& grad_scale, const at::Tensor& found_inf) {
    detail::fused::check_flag(grad_scale, "grad_scale");
    detail::fused::check_flag(found_inf, "found_inf");
    if (own_ != nullptr) {
      own_->step_scaled(grad_scale, found_inf);
      return;
    }
    at::NoGradGuard no_grad;
    // Everything is checked and gathered before the first kernel runs, so
    // that an error leaves the parameters as they were.
    std::vector<std::vector<detail::fused::Call>> calls(optimizer_->param_groups().size());
    states_.keep_made();
    try {
      for (size_t g = 0; g < calls.size(); ++g) gather(g, found_inf.defined(), calls[g]);
    } catch (...) {
      states_.take_back_made(*optimizer_);  // no kernel has run
      throw;
    }
    states_.keep_made();
    detail::fused::StepFlags flags(grad_scale, found_inf);
    for (size_t g = 0; g < calls.size(); ++g) {
      const torch::optim::OptimizerOptions& options = optimizer_->param_groups()[g].options();
      for (detail::fused::Call& call : calls[g]) {
        if (kind_ == FusedKind::kSgd) {
          run_sgd(static_cast<const torch::optim::SGDOptions&>(options), call, flags);
        } else {
          run_adam(kind_ == FusedKind::kAdam ? detail::fused::adam_hyper<torch::optim::AdamOptions>(options)
                                             : detail::fused::adam_hyper<torch::optim::AdamWOptions>(options),
                   call, flags);
        }
      }
    }
  }
  void step() { step(at::Tensor(), at::Tensor()); }

  // Writes the device step counters into the LibTorch states' step() and
  // settles pending SGD buffers: one device-to-host copy per device (a host
  // sync). Afterwards optimizer.state() is what LibTorch's own steps would
  // have made (skipped steps not counted), ready for optimizer.save().
  void sync_optimizer_state() {
    states_.drop_replaced(*optimizer_);
    // One flat fp32 tensor per device: Adam's counters, SGD's pending flags.
    std::vector<std::pair<c10::Device, std::vector<c10::TensorImpl*>>> owners;
    std::vector<std::vector<at::Tensor>> values;
    for (auto& r : states_.records()) {
      const at::Tensor& value = kind_ == FusedKind::kSgd ? r.second.pending : r.second.step;
      if (!value.defined()) continue;
      size_t d = 0;
      while (d < owners.size() && owners[d].first != value.device()) ++d;
      if (d == owners.size()) {
        owners.emplace_back(value.device(), std::vector<c10::TensorImpl*>{});
        values.emplace_back();
      }
      owners[d].second.push_back(r.first);
      values[d].push_back(value.reshape({1}));
    }
    for (size_t d = 0; d < owners.size(); ++d) {
      const at::Tensor host = at::cat(values[d]).to(at::kCPU).contiguous();  // the sync
      const float* data = host.data_ptr<float>();
      for (size_t i = 0; i < owners[d].second.size(); ++i) settle(owners[d].second[i], data[i]);
    }
  }

  // Forgets the device counters and pending buffers and reads the optimizer's
  // state anew at the next step (Adam: counters from step()). For after
  // optimizer.load(); what was not synced is lost. Ends make_static().
  void reload_optimizer_state() {
    states_.records().clear();
    static_ = false;
  }

  // Makes the state of every parameter that has a gradient now, as its first
  // step would (zero moments and counters; SGD buffers flagged "first step
  // not run" on the device), and from then on keeps every state tensor and
  // counter: later steps make, replace and drop none, and sync_optimizer_state()
  // keeps entries whose steps were all skipped (with step 0, which Adam and
  // SGD treat as a fresh state; SGD with dampening excepted, whose first step
  // after such a reload is the non-first formula). Each step then runs the
  // same kernels on the same tensors, which a CUDA graph of the step needs
  // (amp/capture/captured_step.h). Until reload_optimizer_state().
  void make_static() {
    if (own_ != nullptr) {
      own_->make_state();  // its steps update the state in place
      static_ = true;
      return;
    }
    at::NoGradGuard no_grad;
    std::vector<detail::fused::Call> calls;
    for (size_t g = 0; g < optimizer_->param_groups().size(); ++g) gather(g, /*has_found_inf=*/true, calls);
    states_.keep_made();
    if (kind_ == FusedKind::kSgd) {
      for (auto& r : states_.records())
        if (r.second.made_here && !r.second.pending.defined()) {
          const at::Tensor& buf = static_cast<torch::optim::SGDParamState*>(r.second.state)->momentum_buffer();
          r.second.pending = at::zeros({}, buf.options().dtype(at::kFloat));
        }
    }
    static_ = true;
  }
  bool is_static() const { return static_; }

  // The float32 device step counter of `param` (Adam, AdamW), undefined before
  // its first fused step or after reload_optimizer_state().
  at::Tensor step_count(const at::Tensor& param) const {
    auto it = states_.records().find(param.unsafeGetTensorImpl());
    return it == states_.records().end() ? at::Tensor() : it->second.step;
  }

 private:
  using Record = detail::fused::Record;

  void check_device(c10::DeviceType device) {
    for (c10::DeviceType d : devices_)
      if (d == device) return;
    FusedKind kind = FusedKind::kNone;
    const std::string why = detail::fused::unsupported_reason(*optimizer_, device, &kind);
    TORCH_CHECK(why.empty(), "amp: FusedStep: no fused ", detail::fused_kind_name(kind), " step for parameters on ",
                c10::DeviceTypeName(device), ": ", why);
    devices_.push_back(device);
  }

  void check_param(const at::Tensor& p, const at::Tensor& grad, size_t g, size_t i) {
    check_device(p.device().type());
    const std::string bad = detail::fused::known_bad(kind_, p);
    TORCH_CHECK(bad.empty(), "amp: FusedStep: parameter ", i, " of param group ", g, ": ", bad,
                "; step this optimizer with its own step() instead (the options' fused(false))");
    detail::fused::check_param_layout(p, grad, g, i);
  }

  // Finds or makes the state of every parameter with a gradient in group g
  // and sorts them into kernel calls.
  void gather(size_t g, bool has_found_inf, std::vector<detail::fused::Call>& calls) {
    auto& group = optimizer_->param_groups()[g];
    const auto& params = group.params();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      check_param(p, grad, g, i);
      switch (kind_) {
        case FusedKind::kAdam:
          states_.gather_adam<torch::optim::AdamParamState>(
              *optimizer_, kind_, p, grad, static_cast<const torch::optim::AdamOptions&>(group.options()).amsgrad(), g,
              i, calls);
          break;
        case FusedKind::kAdamW:
          states_.gather_adam<torch::optim::AdamWParamState>(
              *optimizer_, kind_, p, grad, static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad(), g,
              i, calls);
          break;
        case FusedKind::kSgd:
          states_.gather_sgd(*optimizer_, p, grad,
                             static_cast<const torch::optim::SGDOptions&>(group.options()).momentum() != 0.0,
                             has_found_inf, g, i, calls);
          break;
        case FusedKind::kNone:
        case FusedKind::kOptimizer:
          break;
      }
    }
  }

  void run_adam(const detail::fused::AdamHyper& h, detail::fused::Call& call, detail::fused::StepFlags& flags) {
    at::_foreach_add_(call.steps, at::Scalar(1));
    const c10::optional<at::Tensor> found = flags.found(call.device);
    detail::fused::adam_(kind_ == FusedKind::kAdamW, call.params, call.grads, call.exp_avgs, call.exp_avg_sqs,
                         call.max_exp_avg_sqs, call.steps, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, h.amsgrad,
                         /*maximize=*/false, flags.scale(call.device), found);
    if (found) {
      at::_foreach_sub_(call.steps, std::vector<at::Tensor>(call.steps.size(), *found));
    } else {
      // The step surely ran.
      for (c10::TensorImpl* impl : call.impls) states_.records()[impl].made_here = false;
    }
  }

  void run_sgd(const torch::optim::SGDOptions& o, detail::fused::Call& call, detail::fused::StepFlags& flags) {
    const c10::optional<at::Tensor> scale = flags.scale(call.device);
    const c10::optional<at::Tensor> found = flags.found(call.device);
    auto sgd = [&](const std::vector<at::Tensor>& bufs, bool is_first_step, const c10::optional<at::Tensor>& skip) {
      detail::fused::sgd_(call.params, call.grads, bufs, o.weight_decay(), o.momentum(), o.lr(), o.dampening(),
                          o.nesterov(),
                          /*maximize=*/false, is_first_step, scale, skip);
    };
    if (o.momentum() == 0.0) {
      sgd({}, false, found);
      return;
    }
    if (call.first_step == 0) {
      sgd(call.bufs, false, found);
      return;
    }
    at::Tensor ran;  // 1 where the buffers' first step has run, after this step
    if (call.first_step == 1) {
      sgd(call.bufs, true, found);
      // Its own tensor: a later step updates each call's flag in place.
      if (found) ran = flags.not_found(call.device).clone();
    } else {
      // Pending buffers: exactly one of the two calls runs (none on inf).
      const at::Tensor& done = call.pending;
      const at::Tensor not_done = at::rsub(done, 1);
      sgd(call.bufs, true, found ? at::maximum(*found, done) : done);
      sgd(call.bufs, false, found ? at::maximum(*found, not_done) : not_done);
      // In place: a replayed graph of this step rereads the same flag.
      done.copy_(found ? at::maximum(done, flags.not_found(call.device)) : at::ones_like(done));
      if (found || static_) ran = done;  // else the step surely ran: back to one kernel call
    }
    for (c10::TensorImpl* impl : call.impls) {
      Record& r = states_.records()[impl];
      r.pending = ran;  // undefined without found_inf: the first step ran
      if (!ran.defined()) r.made_here = false;
    }
  }

  // Applies one synced value (detail::fused::settle).
  void settle(c10::TensorImpl* impl, float value) {
    auto it = states_.records().find(impl);
    if (!detail::fused::settle(kind_, static_, it->second, value, optimizer_->state())) states_.records().erase(it);
  }

  torch::optim::Optimizer* optimizer_;
  FusedKind kind_ = FusedKind::kNone;
  std::vector<c10::DeviceType> devices_;  // devices checked by detail::fused_kind's rules
  SupportsAmpScaling* own_ = nullptr;     // kOptimizer: the optimizer's own step_scaled()
  detail::fused::ParamStates states_;     // the Records, the entries the step in progress made
  bool static_ = false;                   // make_static(): no state tensor is made, replaced or dropped
};

}  // namespace amp
