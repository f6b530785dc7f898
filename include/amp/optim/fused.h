// amp/optim/fused.h: one step of a user's torch::optim::Adam, AdamW or SGD with
// ATen's fused kernels, GradScaler's grad_scale/found_inf inside, no host sync.
//
//   torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
//   amp::detail::FusedStep fused(optimizer);   // throws "amp: ..." where no fused kernel serves it
//   fused.step(scale, found_inf);              // torch.optim.AdamW(fused=True).step() under GradScaler.step()
//   fused.sync_to_optimizer();                 // before optimizer.save(): step counts to the host (a sync)
//   optimizer.load(archive);  fused.reload_from_optimizer();
//
// What Python does, and what is matched here argument for argument:
// - torch/optim/adam.py _fused_adam (AdamW: adamw.py, the same with
//   torch._fused_adamw_): per (device, dtype) group of one param group,
//   torch._foreach_add_(state_steps, 1); torch._fused_adam_(params, grads,
//   exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad, lr, beta1,
//   beta2, weight_decay, eps, maximize, grad_scale, found_inf); and, when
//   found_inf is given, torch._foreach_sub_(state_steps, [found_inf] * n).
//   The step counters are float32 tensors on the parameters' device (Python's
//   state['step'] for fused); max_exp_avg_sqs is empty without amsgrad.
//   LibTorch's Adam with weight_decay is Adam's L2 (grad += wd * param), which
//   is _fused_adam_; AdamW is the decoupled one, _fused_adamw_. maximize is
//   always false (LibTorch's options have none).
// - torch/optim/sgd.py _fused_sgd: torch._fused_sgd_(params, grads,
//   [] if momentum == 0 else momentum_buffers, weight_decay, momentum, lr,
//   dampening, nesterov, maximize, is_first_step, grad_scale, found_inf), with
//   is_first_step = "every momentum buffer of the group is None" and
//   momentum != 0; the first step's buffers are new tensors that the kernel
//   sets to the gradient (buf = grad, LibTorch's clone(d_p)).
// - torch/amp/grad_scaler.py step() for an optimizer with
//   _step_supports_amp_scaling: optimizer.grad_scale = the scale (the kernels
//   divide the gradients by it, and write the unscaled gradients back), or
//   None when unscale_ already ran; optimizer.found_inf = the per-device flags
//   summed on the scale's device; the kernels then skip the whole update when
//   *found_inf == 1. No item(), no host sync anywhere in the step.
// - aten/src/ATen/native/FusedAdam.cpp, FusedSGD.cpp (CPU: `if (found_inf_ptr
//   && *found_inf_ptr == 1.0) return;` before anything) and the CUDA functors
//   (the same test in every block).
//
// Deliberate differences from Python, each because Python's behaviour is a bug
// or has no LibTorch counterpart:
// - found_inf is turned into a 0/1 flag (found_inf != 0) before use. Python
//   passes the sum over devices, which a CPU kernel does not skip on when it
//   is 2, and _foreach_sub_ then takes 2 off every step counter.
// - SGD with momentum: Python decides is_first_step per param group ("all
//   buffers None") and, when that first step is skipped (found_inf = 1), keeps
//   the buffers it made with torch.empty_like: uninitialized memory that the
//   next step multiplies by momentum. Here each parameter counts on its own
//   (LibTorch's SGD makes a buffer per parameter when it has none): parameters
//   without a buffer get a zero one and a first-step call; when found_inf was
//   given, whether that call ran is known only on the device, so the buffer is
//   "pending" with a device flag, and the next steps make two calls for it, a
//   first-step one and a normal one, each skipped by a flag that lets exactly
//   one of them run (or none, on inf). The result is exactly that of a run that
//   never saw the skipped step. sync_to_optimizer() settles pending buffers (a
//   buffer whose first step never ran is removed from the state, as if it had
//   never been made). A pending group costs one more, skipped, kernel launch
//   and a few 0-dim ops per step until then.
// - A state entry that FusedStep made and whose step never ran (Adam/AdamW:
//   device counter still 0) is removed by sync_to_optimizer(), so that the
//   LibTorch state is exactly that of a run without the skipped steps (for
//   LibTorch's Adam, step 0 with zero moments and no entry behave the same).
//
// State: FusedStep makes the state LibTorch's own first step would make, in the
// optimizer's own map, so that optimizer.state() shows it and save() writes it:
// AdamParamState / AdamWParamState with exp_avg, exp_avg_sq (and
// max_exp_avg_sq with amsgrad) = zeros_like(param, MemoryFormat::Preserve)
// (torch/csrc/api/src/optim/adam.cpp, adamw.cpp); SGDParamState with
// momentum_buffer = the first step's d_p (sgd.cpp: clone(d_p), made here as a
// zero tensor like the gradient that the kernel sets to d_p), only when
// momentum != 0. Adam's step count, a host int64_t in LibTorch, lives on the
// device between syncs:
// - sync_to_optimizer() writes the device counters into the states' step()
//   (one device-to-host copy per device, i.e. one sync) and settles pending
//   SGD buffers. Call it before optimizer.save() or before the optimizer's
//   own step(); until then the LibTorch state's step() is stale.
// - reload_from_optimizer() forgets everything kept on the device and reads the
//   states anew (counters from step()) at the next step: call it after
//   optimizer.load(). step() also notices a state object that was replaced
//   (load() makes new ones) or whose step() was changed by someone else, and
//   rereads that one, so a fused checkpoint and an unfused one load into each
//   other either way.
//
// Kernel availability per LibTorch version and device: compat.h's fused
// section; the dispatcher is also asked whether the kernel is registered.
// Requirements the CPU kernels do not check (they walk raw memory): every
// parameter strided and non-overlapping-and-dense, its gradient and state of
// the same dtype, device, sizes and strides. FusedStep checks these on every
// step and throws "amp: ..." instead.
//
// Limits, as in Python: the step counters are float32, exact up to 2**24
// steps; fp16/bf16 parameters are updated in float math inside the kernel but
// stored in their dtype (no fp32 master copy).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

#include "amp/detail/compat.h"

namespace amp {
namespace detail {

enum class FusedKind { kNone, kAdam, kAdamW, kSGD };

inline const char* fused_kind_name(FusedKind kind) {
  switch (kind) {
    case FusedKind::kAdam:
      return "Adam";
    case FusedKind::kAdamW:
      return "AdamW";
    case FusedKind::kSGD:
      return "SGD";
    case FusedKind::kNone:
      break;
  }
  return "none";
}

namespace fused {

// The optimizer's own class (exactly: a subclass may override step()).
inline FusedKind kind_of_class(const torch::optim::Optimizer& optimizer) {
  const std::type_info& type = typeid(optimizer);
  if (type == typeid(torch::optim::Adam)) return FusedKind::kAdam;
  if (type == typeid(torch::optim::AdamW)) return FusedKind::kAdamW;
  if (type == typeid(torch::optim::SGD)) return FusedKind::kSGD;
  return FusedKind::kNone;
}

inline compat::FusedOp op_of(FusedKind kind) {
  return kind == FusedKind::kAdam ? compat::FusedOp::kAdam
                                  : kind == FusedKind::kAdamW ? compat::FusedOp::kAdamW : compat::FusedOp::kSgd;
}

// Whether the dispatcher has a kernel of the op for `device` (CPU and CUDA:
// the only devices compat::has_fused_op admits).
inline bool kernel_registered(compat::FusedOp op, c10::DeviceType device) {
  const auto handle = c10::Dispatcher::singleton().findSchema(c10::OperatorName(compat::fused_op_name(op), ""));
  if (!handle) return false;
  return handle->hasKernelForDispatchKey(device == c10::DeviceType::CUDA ? c10::DispatchKey::CUDA
                                                                         : c10::DispatchKey::CPU);
}

inline bool dtype_supported(c10::ScalarType dtype) {
  // AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16, ...) in every fused kernel.
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
}

// Why no fused kernel serves `optimizer` for its parameters on `device`, or
// "" when one does. Sets *kind to the optimizer's kind either way.
inline std::string unsupported_reason(const torch::optim::Optimizer& optimizer, c10::DeviceType device,
                                      FusedKind* kind) {
  *kind = kind_of_class(optimizer);
  if (*kind == FusedKind::kNone) {
    return "ATen has fused steps for torch::optim::Adam, AdamW and SGD only; this optimizer is a " +
           c10::demangle(typeid(optimizer).name());
  }
  const compat::FusedOp op = op_of(*kind);
  const std::string where = c10::DeviceTypeName(device);
  const std::string version = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
  if (!compat::has_fused_op(op, device)) {
    const std::string since = compat::fused_op_since(op, device);
    return "LibTorch " + version + " has no " + where + " kernel of " + compat::fused_op_name(op) +
           (since.empty() ? std::string(" (amp uses the fused kernels on CPU and CUDA only)")
                          : " (it comes with LibTorch " + since + ")");
  }
  if (!kernel_registered(op, device)) {
    return std::string("this LibTorch build registers no ") + where + " kernel of " + compat::fused_op_name(op);
  }
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      if (p.device().type() != device) continue;
      if (!dtype_supported(p.scalar_type())) {
        return "parameter " + std::to_string(i) + " of param group " + std::to_string(g) + " has dtype " +
               std::string(c10::toString(p.scalar_type())) +
               "; the fused kernels take Float, Double, Half and BFloat16";
      }
      if (p.layout() != at::kStrided || !p.is_non_overlapping_and_dense()) {
        return "parameter " + std::to_string(i) + " of param group " + std::to_string(g) +
               " is not a dense strided tensor (the fused kernels walk its memory linearly)";
      }
    }
  }
  return "";
}

// A, AdamW, SGD hyperparameters of one param group, read as the LibTorch step reads them.
struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad;
};

template <class Options>
AdamHyper adam_hyper(const torch::optim::OptimizerOptions& options) {
  const auto& o = static_cast<const Options&>(options);
  return AdamHyper{o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(), o.amsgrad()};
}

// The per-device copies of grad_scale and found_inf for one step, made once
// per device as Python's grad_scale_dict / found_inf_dict.
class StepFlags {
 public:
  StepFlags(const at::Tensor& grad_scale, const at::Tensor& found_inf)
      : scale_(grad_scale), found_(found_inf.defined() ? found_inf.ne(0).to(at::kFloat) : at::Tensor()) {}

  bool has_found() const { return found_.defined(); }

  c10::optional<at::Tensor> scale(const c10::Device& device) { return on(scale_, scales_, device); }
  c10::optional<at::Tensor> found(const c10::Device& device) { return on(found_, founds_, device); }
  // 1 - found: 1 where the step runs.
  at::Tensor not_found(const c10::Device& device) {
    for (auto& e : not_founds_)
      if (e.first == device) return e.second;
    not_founds_.emplace_back(device, at::rsub(*found(device), 1));
    return not_founds_.back().second;
  }

 private:
  using PerDevice = std::vector<std::pair<c10::Device, at::Tensor>>;
  static c10::optional<at::Tensor> on(const at::Tensor& t, PerDevice& cache, const c10::Device& device) {
    if (!t.defined()) return c10::nullopt;
    for (auto& e : cache)
      if (e.first == device) return e.second;
    cache.emplace_back(device, t.to(t.options().device(device), /*non_blocking=*/true));
    return cache.back().second;
  }

  at::Tensor scale_, found_;
  PerDevice scales_, founds_, not_founds_;
};

// The tensors of one kernel call: parameters of one param group on one
// device with one dtype (and, for SGD with momentum, one kind of buffer).
struct Call {
  c10::Device device;
  c10::ScalarType dtype;
  int first_step = 0;          // SGD: 0 normal call, 1 first-step call, 2 pending (both)
  at::Tensor pending;          // SGD, first_step == 2: the buffers' flag (1 once their first step ran)
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, bufs;
  std::vector<c10::TensorImpl*> impls;  // the parameters', to update their records
};

inline Call& call_for(std::vector<Call>& calls, const at::Tensor& p, int first_step = 0,
                      const at::Tensor& pending = at::Tensor()) {
  for (auto& c : calls) {
    if (c.device == p.device() && c.dtype == p.scalar_type() && c.first_step == first_step &&
        c.pending.unsafeGetTensorImpl() == pending.unsafeGetTensorImpl()) {
      return c;
    }
  }
  calls.push_back(Call{p.device(), p.scalar_type(), first_step, pending, {}, {}, {}, {}, {}, {}, {}, {}});
  return calls.back();
}

static_assert(std::is_same_v<compat::OptimStateKey,
                             typename std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type>,
              "amp: compat.h's OptimStateKey is not the key of torch::optim::Optimizer::state()");

template <class... T>
void unused(const T&...) {}

inline compat::OptimStateKey state_key(const at::Tensor& param) {
  return compat::optim_state_key(param.unsafeGetTensorImpl());
}

// torch._fused_adam_ (adamw == false: weight decay is L2, added to the
// gradient) or torch._fused_adamw_ (decoupled: param *= 1 - lr * weight_decay).
inline void adam_(bool adamw, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr,
                  double beta1, double beta2, double weight_decay, double eps, bool amsgrad, bool maximize,
                  const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf) {
  if (!adamw) {
    at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                     weight_decay, eps, amsgrad, maximize, grad_scale, found_inf);
    return;
  }
#if AMP_DETAIL_HAS_FUSED_ADAMW
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                    weight_decay, eps, amsgrad, maximize, grad_scale, found_inf);
#else
  unused(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2, weight_decay, eps,
         amsgrad, maximize, grad_scale, found_inf);
  TORCH_CHECK(false, "amp: internal error: this LibTorch has no _fused_adamw_");
#endif
}

// torch._fused_sgd_.
inline void sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, double weight_decay,
                 double momentum, double lr, double dampening, bool nesterov, bool maximize, bool is_first_step,
                 const c10::optional<at::Tensor>& grad_scale, const c10::optional<at::Tensor>& found_inf) {
#if AMP_DETAIL_HAS_FUSED_SGD
  at::_fused_sgd_(params, grads, momentum_buffers, weight_decay, momentum, lr, dampening, nesterov, maximize,
                  is_first_step, grad_scale, found_inf);
#else
  unused(params, grads, momentum_buffers, weight_decay, momentum, lr, dampening, nesterov, maximize, is_first_step,
         grad_scale, found_inf);
  TORCH_CHECK(false, "amp: internal error: this LibTorch has no _fused_sgd_");
#endif
}

inline bool same_layout(const at::Tensor& t, const at::Tensor& p) {
  return t.defined() && t.layout() == at::kStrided && t.device() == p.device() &&
         t.scalar_type() == p.scalar_type() && t.sizes() == p.sizes() && t.strides() == p.strides();
}

}  // namespace fused

// Which fused kernel serves `optimizer` for parameters on `device`: kNone when
// the optimizer is another class (exactly torch::optim::Adam, AdamW or SGD,
// not a subclass), the LibTorch lacks the kernel on that device (compat.h; CPU
// and CUDA only), or a parameter on that device has a dtype the kernels do not
// take (Float, Double, Half, BFloat16) or is not dense and strided.
inline FusedKind fused_kind(const torch::optim::Optimizer& optimizer, c10::DeviceType device) {
  FusedKind kind = FusedKind::kNone;
  return fused::unsupported_reason(optimizer, device, &kind).empty() ? kind : FusedKind::kNone;
}

class FusedStep {
 public:
  // Throws "amp: ..." saying why when no fused kernel serves the optimizer on
  // a device its parameters are on (fused_kind() == kNone). The optimizer must
  // outlive this object. Existing state (a loaded checkpoint, earlier steps of
  // the optimizer's own step()) is taken as it is.
  explicit FusedStep(torch::optim::Optimizer& optimizer) : optimizer_(&optimizer) {
    kind_ = fused::kind_of_class(optimizer);
    TORCH_CHECK(kind_ != FusedKind::kNone, "amp: FusedStep: ",
                fused::unsupported_reason(optimizer, c10::DeviceType::CPU, &kind_));
    for (const auto& group : optimizer.param_groups())
      for (const auto& p : group.params()) check_device(p.device().type());
  }

  FusedStep(const FusedStep&) = delete;
  FusedStep& operator=(const FusedStep&) = delete;
  FusedStep(FusedStep&&) = default;
  FusedStep& operator=(FusedStep&&) = default;
  ~FusedStep() = default;

  FusedKind kind() const { return kind_; }
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
    check_flag(grad_scale, "grad_scale");
    check_flag(found_inf, "found_inf");
    at::NoGradGuard no_grad;
    // Everything is checked and gathered before the first kernel runs, so
    // that an error leaves the parameters as they were.
    std::vector<std::vector<fused::Call>> calls(optimizer_->param_groups().size());
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
    fused::StepFlags flags(grad_scale, found_inf);
    for (size_t g = 0; g < calls.size(); ++g) {
      const torch::optim::OptimizerOptions& options = optimizer_->param_groups()[g].options();
      for (fused::Call& call : calls[g]) {
        if (kind_ == FusedKind::kSGD) {
          run_sgd(static_cast<const torch::optim::SGDOptions&>(options), call, flags);
        } else {
          run_adam(kind_ == FusedKind::kAdam ? fused::adam_hyper<torch::optim::AdamOptions>(options)
                                             : fused::adam_hyper<torch::optim::AdamWOptions>(options),
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
  void sync_to_optimizer() {
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
      const at::Tensor& value = kind_ == FusedKind::kSGD ? r.second.pending : r.second.step;
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
  // optimizer.load(); what was not synced is lost.
  void reload_from_optimizer() { records_.clear(); }

  // The float32 device step counter of `param` (Adam, AdamW), undefined before
  // its first fused step or after reload_from_optimizer().
  at::Tensor step_count(const at::Tensor& param) const {
    auto it = records_.find(param.unsafeGetTensorImpl());
    return it == records_.end() ? at::Tensor() : it->second.step;
  }

 private:
  // What FusedStep keeps about one parameter's state entry.
  struct Record {
    compat::OptimStateKey key;
    torch::optim::OptimizerParamState* state = nullptr;  // the entry it was read from or made as
    int64_t host_step = 0;   // Adam: the entry's step() when `step` was read or written
    at::Tensor step;         // Adam: float32 counter on the parameter's device
    bool made_here = false;  // the entry was made by FusedStep and no step of it is known to have run
    at::Tensor pending;      // SGD: the buffer's flag while unknown whether its first step ran
  };

  static void check_flag(const at::Tensor& t, const char* name) {
    if (!t.defined()) return;
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, "amp: FusedStep::step: ", name,
                " must be a one-element float32 tensor, got ", t.scalar_type(), " of shape ", t.sizes());
  }

  void check_device(c10::DeviceType device) {
    for (c10::DeviceType d : devices_)
      if (d == device) return;
    FusedKind kind = FusedKind::kNone;
    const std::string why = fused::unsupported_reason(*optimizer_, device, &kind);
    TORCH_CHECK(why.empty(), "amp: FusedStep: no fused ", fused_kind_name(kind), " step for parameters on ",
                c10::DeviceTypeName(device), ": ", why);
    devices_.push_back(device);
  }

  void check_param(const at::Tensor& p, const at::Tensor& grad, size_t g, size_t i) {
    check_device(p.device().type());
    TORCH_CHECK(fused::dtype_supported(p.scalar_type()), "amp: FusedStep: parameter ", i, " of param group ", g,
                " has dtype ", p.scalar_type(), "; the fused kernels take Float, Double, Half and BFloat16");
    TORCH_CHECK(p.layout() == at::kStrided && p.is_non_overlapping_and_dense(), "amp: FusedStep: parameter ", i,
                " of param group ", g, " is not a dense strided tensor");
    TORCH_CHECK(fused::same_layout(grad, p), "amp: FusedStep: the gradient of parameter ", i, " of param group ", g,
                " (", grad.scalar_type(), " ", grad.device(), ", sizes ", grad.sizes(), ", strides ", grad.strides(),
                ") is not laid out as the parameter (", p.scalar_type(), " ", p.device(), ", sizes ", p.sizes(),
                ", strides ", p.strides(), "); the fused kernels need the same dtype, device and memory layout");
  }

  static void check_state_tensor(const at::Tensor& t, const at::Tensor& p, const char* name, size_t g, size_t i) {
    TORCH_CHECK(fused::same_layout(t, p), "amp: FusedStep: the optimizer state's ", name, " of parameter ", i,
                " of param group ", g, " is ", (t.defined() ? "not laid out as the parameter" : "undefined"),
                "; the fused kernels need the same dtype, device, sizes and strides");
  }

  // The record of p's state entry; `entry` is the entry now in the map.
  Record& record_for(const at::Tensor& p, torch::optim::OptimizerParamState* entry) {
    Record& r = records_[p.unsafeGetTensorImpl()];
    if (r.state != entry) {
      r = Record{};
      r.key = fused::state_key(p);
      r.state = entry;
    }
    return r;
  }

  // Finds or makes the state of every parameter with a gradient in group g
  // and sorts them into kernel calls.
  void gather(size_t g, bool has_found_inf, std::vector<fused::Call>& calls) {
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
        case FusedKind::kSGD:
          gather_sgd(p, grad, static_cast<const torch::optim::SGDOptions&>(group.options()).momentum() != 0.0,
                     has_found_inf, g, i, calls);
          break;
        case FusedKind::kNone:
          break;
      }
    }
  }

  template <class State>
  void gather_adam(const at::Tensor& p, const at::Tensor& grad, bool amsgrad, size_t g, size_t i,
                   std::vector<fused::Call>& calls) {
    auto& map = optimizer_->state();
    auto entry = map.find(fused::state_key(p));
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
      map[fused::state_key(p)] = std::move(fresh);
      made_.emplace_back(p.unsafeGetTensorImpl(), fused::state_key(p));
      made = true;
    } else {
      state = dynamic_cast<State*>(entry->second.get());
      TORCH_CHECK(state != nullptr, "amp: FusedStep: the optimizer's state of parameter ", i, " of param group ", g,
                  " is not a ", fused_kind_name(kind_), " state");
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
    check_state_tensor(state->exp_avg(), p, "exp_avg", g, i);
    check_state_tensor(state->exp_avg_sq(), p, "exp_avg_sq", g, i);
    if (amsgrad) check_state_tensor(state->max_exp_avg_sq(), p, "max_exp_avg_sq", g, i);
    fused::Call& call = fused::call_for(calls, p);
    call.params.push_back(p);
    call.grads.push_back(grad);
    call.exp_avgs.push_back(state->exp_avg());
    call.exp_avg_sqs.push_back(state->exp_avg_sq());
    if (amsgrad) call.max_exp_avg_sqs.push_back(state->max_exp_avg_sq());
    call.steps.push_back(r.step);
    call.impls.push_back(p.unsafeGetTensorImpl());
  }

  void gather_sgd(const at::Tensor& p, const at::Tensor& grad, bool momentum, bool has_found_inf, size_t g,
                  size_t i, std::vector<fused::Call>& calls) {
    if (!momentum) {
      // No state: LibTorch's SGD keeps none without momentum.
      fused::Call& call = fused::call_for(calls, p);
      call.params.push_back(p);
      call.grads.push_back(grad);
      return;
    }
    auto& map = optimizer_->state();
    auto entry = map.find(fused::state_key(p));
    torch::optim::SGDParamState* state = nullptr;
    int first_step = 0;
    at::Tensor pending;
    if (entry == map.end()) {
      // sgd.cpp: buf = clone(d_p) on the first step; the kernel writes d_p into it.
      auto fresh = std::make_unique<torch::optim::SGDParamState>();
      fresh->momentum_buffer(at::zeros_like(grad, at::MemoryFormat::Preserve));
      state = fresh.get();
      map[fused::state_key(p)] = std::move(fresh);
      made_.emplace_back(p.unsafeGetTensorImpl(), fused::state_key(p));
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
    check_state_tensor(state->momentum_buffer(), p, "momentum_buffer", g, i);
    fused::Call& call = fused::call_for(calls, p, first_step, pending);
    call.params.push_back(p);
    call.grads.push_back(grad);
    call.bufs.push_back(state->momentum_buffer());
    call.impls.push_back(p.unsafeGetTensorImpl());
  }

  void run_adam(const fused::AdamHyper& h, fused::Call& call, fused::StepFlags& flags) {
    at::_foreach_add_(call.steps, at::Scalar(1));
    const c10::optional<at::Tensor> found = flags.found(call.device);
    fused::adam_(kind_ == FusedKind::kAdamW, call.params, call.grads, call.exp_avgs, call.exp_avg_sqs,
                        call.max_exp_avg_sqs, call.steps, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, h.amsgrad,
                        /*maximize=*/false, flags.scale(call.device), found);
    if (found) {
      at::_foreach_sub_(call.steps, std::vector<at::Tensor>(call.steps.size(), *found));
    } else {
      // The step surely ran.
      for (c10::TensorImpl* impl : call.impls) records_[impl].made_here = false;
    }
  }

  void run_sgd(const torch::optim::SGDOptions& o, fused::Call& call, fused::StepFlags& flags) {
    const c10::optional<at::Tensor> scale = flags.scale(call.device);
    const c10::optional<at::Tensor> found = flags.found(call.device);
    auto sgd = [&](const std::vector<at::Tensor>& bufs, bool is_first_step, const c10::optional<at::Tensor>& skip) {
      fused::sgd_(call.params, call.grads, bufs, o.weight_decay(), o.momentum(), o.lr(), o.dampening(),
                         o.nesterov(), /*maximize=*/false, is_first_step, scale, skip);
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
      if (found) ran = flags.not_found(call.device);
    } else {
      // Pending buffers: exactly one of the two calls runs (none on inf).
      const at::Tensor& done = call.pending;
      const at::Tensor not_done = at::rsub(done, 1);
      sgd(call.bufs, true, found ? at::maximum(*found, done) : done);
      sgd(call.bufs, false, found ? at::maximum(*found, not_done) : not_done);
      if (found) ran = at::maximum(done, flags.not_found(call.device));
    }
    for (c10::TensorImpl* impl : call.impls) {
      Record& r = records_[impl];
      r.pending = ran;  // undefined without found_inf: the first step ran
      if (!ran.defined()) r.made_here = false;
    }
  }

  // Applies one synced value: Adam's counter or SGD's pending flag.
  void settle(c10::TensorImpl* impl, float value) {
    auto it = records_.find(impl);
    Record& r = it->second;
    auto& map = optimizer_->state();
    if (kind_ == FusedKind::kSGD) {
      if (value != 0.f) {
        r.pending = at::Tensor();
        r.made_here = false;
      } else {
        // The buffer's first step never ran: as if it had never been made.
        if (r.made_here) map.erase(r.key);
        records_.erase(it);
      }
      return;
    }
    const auto step = static_cast<int64_t>(value);
    if (r.made_here && step == 0) {
      map.erase(r.key);  // made by a step that was skipped
      records_.erase(it);
      return;
    }
    if (kind_ == FusedKind::kAdam) {
      static_cast<torch::optim::AdamParamState*>(r.state)->step(step);
    } else {
      static_cast<torch::optim::AdamWParamState*>(r.state)->step(step);
    }
    r.host_step = step;
    r.made_here = false;
  }

  torch::optim::Optimizer* optimizer_;
  FusedKind kind_ = FusedKind::kNone;
  std::vector<c10::DeviceType> devices_;  // devices checked by fused_kind's rules
  std::unordered_map<c10::TensorImpl*, Record> records_;
  std::vector<std::pair<c10::TensorImpl*, compat::OptimStateKey>> made_;  // entries made by the step in progress
};

}  // namespace detail

// Public: the fused step is an explicit choice for users of the hand-written
// recipe (scaler.step(optimizer, fused)); Stepper and Trainer take it by themselves.
using detail::fused_kind;
using detail::FusedKind;
using detail::FusedStep;

}  // namespace amp
