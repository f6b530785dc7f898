// amp/optim/detail/fused_ops.h: what optim/fused.h's FusedStep builds on:
// which optimizers and devices the fused kernels serve (fused_kind), and the
// calls of ATen's _fused_adam_ / _fused_adamw_ / _fused_sgd_, argument for
// argument as torch/optim/{adam,adamw,sgd}.py call them (see fused.h).
//
// Deliberate differences from Python, each because Python's behaviour is a bug
// or has no LibTorch counterpart:
// - found_inf is made a 0/1 flag: Python passes the sum over devices, on which
//   a CPU kernel (it skips only when *found_inf == 1.0) does not skip, and
//   _foreach_sub_ would take 2 off every step counter.
// - SGD with momentum decides the first step per parameter (LibTorch makes a
//   buffer per parameter), and a buffer whose first step may have been
//   skipped is "pending" on the device: until known, two calls run, each
//   gated by a flag so that exactly one (or none, on inf) takes effect. Python
//   keeps torch.empty_like buffers after a skipped first step.
// - sync_optimizer_state() removes state entries made by FusedStep whose first
//   step never ran, so the LibTorch state is that of a run without the
//   skipped steps.
// Requirements the CPU kernels do not check (they walk raw memory): every
// parameter dense and strided, its gradient and state of the same dtype,
// device, sizes and strides: checked before any kernel runs.
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
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "amp/detail/compat.h"
#include "amp/detail/per_device.h"
#include "amp/optim/fused_kind.h"
#include "amp/optim/supports_amp_scaling.h"

namespace amp {
namespace detail {

namespace fused {

// The optimizer's own class (exactly: a subclass may override step()), or
// kOptimizer for one that takes grad_scale/found_inf itself.
inline FusedKind kind_of_class(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const SupportsAmpScaling*>(&optimizer) != nullptr) return FusedKind::kOptimizer;
  const std::type_info& type = typeid(optimizer);
  if (type == typeid(torch::optim::Adam)) return FusedKind::kAdam;
  if (type == typeid(torch::optim::AdamW)) return FusedKind::kAdamW;
  if (type == typeid(torch::optim::SGD)) return FusedKind::kSgd;
  return FusedKind::kNone;
}

inline compat::FusedOp op_of(FusedKind kind) {
  return kind == FusedKind::kAdam    ? compat::FusedOp::kAdam
         : kind == FusedKind::kAdamW ? compat::FusedOp::kAdamW
                                     : compat::FusedOp::kSgd;
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

// A kernel known to compute wrong results for parameter p (compat.h), in
// words; "" when none is known.
inline std::string known_bad(FusedKind kind, const at::Tensor& p) {
  const bool half = p.scalar_type() == at::kHalf || p.scalar_type() == at::kBFloat16;
  if (kind == FusedKind::kSgd && p.device().is_cpu() && half && !compat::kCpuFusedSgdUpdatesHalfTypes) {
    return std::string("it is ") + c10::toString(p.scalar_type()) +
           ", and ATen's CPU fused SGD leaves fp16/bf16 parameters partly un-updated (pytorch#191763)";
  }
  return "";
}

// Why no fused kernel serves `optimizer` for its parameters on `device`, or
// "" when one does. Sets *kind to the optimizer's kind either way.
inline std::string unsupported_reason(const torch::optim::Optimizer& optimizer, c10::DeviceType device,
                                      FusedKind* kind) {
  *kind = kind_of_class(optimizer);
  if (*kind == FusedKind::kNone) {
    return "ATen has fused steps for torch::optim::Adam, AdamW and SGD only (and amp for an "
           "amp::SupportsAmpScaling optimizer); this optimizer is a " +
           c10::demangle(typeid(optimizer).name());
  }
  if (*kind == FusedKind::kOptimizer) return "";  // its own step_scaled(), on any device
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
      if (const std::string why = known_bad(*kind, p); !why.empty()) {
        return "parameter " + std::to_string(i) + " of param group " + std::to_string(g) + ": " + why;
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
    return not_founds_.get(device, [&] { return at::rsub(*found(device), 1); });
  }

 private:
  static c10::optional<at::Tensor> on(const at::Tensor& t, PerDevice& cache, const c10::Device& device) {
    if (!t.defined()) return c10::nullopt;
    return cache.copy(t, device);
  }

  at::Tensor scale_, found_;
  PerDevice scales_, founds_, not_founds_;
};

// The tensors of one kernel call: parameters of one param group on one
// device with one dtype (and, for SGD with momentum, one kind of buffer).
struct Call {
  c10::Device device;
  c10::ScalarType dtype;
  int first_step = 0;  // SGD: 0 normal call, 1 first-step call, 2 pending (both)
  at::Tensor pending;  // SGD, first_step == 2: the buffers' flag (1 once their first step ran)
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

static_assert(
    std::is_same_v<compat::OptimStateKey,
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
    at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2, weight_decay,
                     eps, amsgrad, maximize, grad_scale, found_inf);
    return;
  }
#if AMP_DETAIL_HAS_FUSED_ADAMW
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2, weight_decay,
                    eps, amsgrad, maximize, grad_scale, found_inf);
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
  return t.defined() && t.layout() == at::kStrided && t.device() == p.device() && t.scalar_type() == p.scalar_type() &&
         t.sizes() == p.sizes() && t.strides() == p.strides();
}

// Checks before any kernel runs (the CPU kernels walk raw memory).
inline void check_flag(const at::Tensor& t, const char* name) {
  if (!t.defined()) return;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, "amp: FusedStep::step: ", name,
              " must be a one-element float32 tensor, got ", t.scalar_type(), " of shape ", t.sizes());
}

inline void check_param_layout(const at::Tensor& p, const at::Tensor& grad, size_t g, size_t i) {
  TORCH_CHECK(dtype_supported(p.scalar_type()), "amp: FusedStep: parameter ", i, " of param group ", g, " has dtype ",
              p.scalar_type(), "; the fused kernels take Float, Double, Half and BFloat16");
  TORCH_CHECK(p.layout() == at::kStrided && p.is_non_overlapping_and_dense(), "amp: FusedStep: parameter ", i,
              " of param group ", g, " is not a dense strided tensor");
  TORCH_CHECK(same_layout(grad, p), "amp: FusedStep: the gradient of parameter ", i, " of param group ", g, " (",
              grad.scalar_type(), " ", grad.device(), ", sizes ", grad.sizes(), ", strides ", grad.strides(),
              ") is not laid out as the parameter (", p.scalar_type(), " ", p.device(), ", sizes ", p.sizes(),
              ", strides ", p.strides(), "); the fused kernels need the same dtype, device and memory layout");
}

inline void check_state_tensor(const at::Tensor& t, const at::Tensor& p, const char* name, size_t g, size_t i) {
  TORCH_CHECK(same_layout(t, p), "amp: FusedStep: the optimizer state's ", name, " of parameter ", i,
              " of param group ", g, " is ", (t.defined() ? "not laid out as the parameter" : "undefined"),
              "; the fused kernels need the same dtype, device, sizes and strides");
}

}  // namespace fused

}  // namespace detail
}  // namespace amp
