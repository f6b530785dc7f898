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
// docs/numerics.md; the kernels: optim/detail/fused_ops.h.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "amp/detail/compat.h"
#include "amp/optim/detail/fused_ops.h"

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
    made_.clear();
    try {
      for (size_t g = 0; g < calls.size(); ++g) gather(g, found_inf.defined(), calls[g]);
    } catch (...) {
      // No kernel has run: take back the state entries made for this step.
      for (const auto& made : made_) {
        optimizer_->state().erase(made.second);
        records_.erase(made.first);
      }
      made_.clear();
      throw;
    }
    made_.clear();
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
    auto& state = optimizer_->state();
    // Drop records whose state entry is gone or was replaced: the entry is
    // authoritative then.
    for (auto it = records_.begin(); it != records_.end();) {
      auto entry = state.find(it->second.key);
      if (entry == state.end() || entry->second.get() != it->second.state) {
        it = records_.erase(it);
      } else {
        ++it;
      }
    }
    // One flat fp32 tensor per device: Adam's counters, SGD's pending flags.
    std::vector<std::pair<c10::Device, std::vector<c10::TensorImpl*>>> owners;
    std::vector<std::vector<at::Tensor>> values;
    for (auto& r : records_) {
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
    records_.clear();
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
    made_.clear();
    if (kind_ == FusedKind::kSgd) {
      for (auto& r : records_)
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
    auto it = records_.find(param.unsafeGetTensorImpl());
    return it == records_.end() ? at::Tensor() : it->second.step;
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

  // The record of p's state entry; `entry` is the entry now in the map.
  Record& record_for(const at::Tensor& p, torch::optim::OptimizerParamState* entry) {
    Record& r = records_[p.unsafeGetTensorImpl()];
    if (r.state != entry) {
      r = Record{};
      r.key = detail::fused::state_key(p);
      r.state = entry;
    }
    return r;
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
          gather_adam<torch::optim::AdamParamState>(
              p, grad, static_cast<const torch::optim::AdamOptions&>(group.options()).amsgrad(), g, i, calls);
          break;
        case FusedKind::kAdamW:
          gather_adam<torch::optim::AdamWParamState>(
              p, grad, static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad(), g, i, calls);
          break;
        case FusedKind::kSgd:
          gather_sgd(p, grad, static_cast<const torch::optim::SGDOptions&>(group.options()).momentum() != 0.0,
                     has_found_inf, g, i, calls);
          break;
        case FusedKind::kNone:
        case FusedKind::kOptimizer:
          break;
      }
    }
  }

  template <class State>
  void gather_adam(const at::Tensor& p, const at::Tensor& grad, bool amsgrad, size_t g, size_t i,
                   std::vector<detail::fused::Call>& calls) {
    auto& map = optimizer_->state();
    auto entry = map.find(detail::fused::state_key(p));
    State* state = nullptr;
    bool made = false;
    if (entry == map.end()) {
      // adam.cpp / adamw.cpp's state initialization.
      auto fresh = std::make_unique<State>();
      fresh->step(0);
      fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
      fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      if (amsgrad) fresh->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      state = fresh.get();
      map[detail::fused::state_key(p)] = std::move(fresh);
      made_.emplace_back(p.unsafeGetTensorImpl(), detail::fused::state_key(p));
      made = true;
    } else {
      state = dynamic_cast<State*>(entry->second.get());
      TORCH_CHECK(state != nullptr, "amp: FusedStep: the optimizer's state of parameter ", i, " of param group ", g,
                  " is not a ", detail::fused_kind_name(kind_), " state");
    }
    Record& r = record_for(p, state);
    if (made) {
      r.made_here = true;
      r.host_step = 0;
      r.step = at::scalar_tensor(0.0, p.options().dtype(at::kFloat));
    } else if (!r.step.defined() || r.host_step != state->step()) {
      // New to FusedStep, loaded, or stepped by someone else: the entry's step() counts.
      r.host_step = state->step();
      r.step = at::scalar_tensor(static_cast<double>(state->step()), p.options().dtype(at::kFloat));
    }
    detail::fused::check_state_tensor(state->exp_avg(), p, "exp_avg", g, i);
    detail::fused::check_state_tensor(state->exp_avg_sq(), p, "exp_avg_sq", g, i);
    if (amsgrad) detail::fused::check_state_tensor(state->max_exp_avg_sq(), p, "max_exp_avg_sq", g, i);
    detail::fused::Call& call = detail::fused::call_for(calls, p);
    call.params.push_back(p);
    call.grads.push_back(grad);
    call.exp_avgs.push_back(state->exp_avg());
    call.exp_avg_sqs.push_back(state->exp_avg_sq());
    if (amsgrad) call.max_exp_avg_sqs.push_back(state->max_exp_avg_sq());
    call.steps.push_back(r.step);
    call.impls.push_back(p.unsafeGetTensorImpl());
  }

  void gather_sgd(const at::Tensor& p, const at::Tensor& grad, bool momentum, bool has_found_inf, size_t g, size_t i,
                  std::vector<detail::fused::Call>& calls) {
    if (!momentum) {
      // No state: LibTorch's SGD keeps none without momentum.
      detail::fused::Call& call = detail::fused::call_for(calls, p);
      call.params.push_back(p);
      call.grads.push_back(grad);
      return;
    }
    auto& map = optimizer_->state();
    auto entry = map.find(detail::fused::state_key(p));
    torch::optim::SGDParamState* state = nullptr;
    int first_step = 0;
    at::Tensor pending;
    if (entry == map.end()) {
      // sgd.cpp: buf = clone(d_p) on the first step; the kernel writes d_p into it.
      auto fresh = std::make_unique<torch::optim::SGDParamState>();
      fresh->momentum_buffer(at::zeros_like(grad, at::MemoryFormat::Preserve));
      state = fresh.get();
      map[detail::fused::state_key(p)] = std::move(fresh);
      made_.emplace_back(p.unsafeGetTensorImpl(), detail::fused::state_key(p));
      Record& r = record_for(p, state);
      r.made_here = has_found_inf;  // without found_inf the first step surely runs
      first_step = 1;
    } else {
      state = dynamic_cast<torch::optim::SGDParamState*>(entry->second.get());
      TORCH_CHECK(state != nullptr, "amp: FusedStep: the optimizer's state of parameter ", i, " of param group ", g,
                  " is not an SGD state");
      Record& r = record_for(p, state);
      if (r.pending.defined()) {
        first_step = 2;
        pending = r.pending;
      }
    }
    detail::fused::check_state_tensor(state->momentum_buffer(), p, "momentum_buffer", g, i);
    detail::fused::Call& call = detail::fused::call_for(calls, p, first_step, pending);
    call.params.push_back(p);
    call.grads.push_back(grad);
    call.bufs.push_back(state->momentum_buffer());
    call.impls.push_back(p.unsafeGetTensorImpl());
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
      for (c10::TensorImpl* impl : call.impls) records_[impl].made_here = false;
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
      Record& r = records_[impl];
      r.pending = ran;  // undefined without found_inf: the first step ran
      if (!ran.defined()) r.made_here = false;
    }
  }

  // Applies one synced value (detail::fused::settle).
  void settle(c10::TensorImpl* impl, float value) {
    auto it = records_.find(impl);
    if (!detail::fused::settle(kind_, static_, it->second, value, optimizer_->state())) records_.erase(it);
  }

  torch::optim::Optimizer* optimizer_;
  FusedKind kind_ = FusedKind::kNone;
  std::vector<c10::DeviceType> devices_;  // devices checked by detail::fused_kind's rules
  SupportsAmpScaling* own_ = nullptr;     // kOptimizer: the optimizer's own step_scaled()
  std::unordered_map<c10::TensorImpl*, Record> records_;
  std::vector<std::pair<c10::TensorImpl*, detail::compat::OptimStateKey>>
      made_;             // entries made by the step in progress
  bool static_ = false;  // make_static(): no state tensor is made, replaced or dropped
};

}  // namespace amp
