// amp/train/detail/model_setup.h: the checks and conversions that Trainer and
// Fabric make when they take a model and its optimizer.
//
//   auto module = amp::detail::as_module(model);                           // ModuleHolder, shared_ptr or Module&
//   amp::detail::check_optimizer<Policy>(optimizer);                       // LBFGS + loss scaling, fp16 eps
//   amp::detail::setup_model<Policy, Device>(*module, "Trainer", "before constructing the Trainer");
//
// setup_model: every parameter on Device; Mixed<> needs fp32 parameters (as
// torch.autocast does); True<D> converts the model to D (Module::to keeps the
// parameter tensors, so an optimizer's references stay valid).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <memory>
#include <type_traits>
#include <utility>

#include "amp/detail/compat_ops.h"
#include "amp/core/device.h"
#include "amp/core/dtype.h"
#include "amp/core/policy.h"
#include "amp/train/stepper.h"

namespace amp {
namespace detail {

// A model passed as a non-const Module& that no std::shared_ptr owns (the
// `Net model;` of LibTorch's examples) is held without ownership: it must
// outlive whatever holds it (the Trainer, the Fabric).
template <class M>
std::shared_ptr<torch::nn::Module> as_module(M&& model) {
  using T = std::decay_t<M>;
  if constexpr (std::is_base_of_v<torch::nn::Module, T>) {
    constexpr bool lvalue = std::is_lvalue_reference_v<M> && !std::is_const_v<std::remove_reference_t<M>>;
    static_assert(lvalue || !std::is_base_of_v<torch::nn::Module, T>,
                  "amp: pass the model as a ModuleHolder (e.g. torch::nn::Linear), a std::shared_ptr<Module>, or a "
                  "non-const Module& that outlives the trainer, not a temporary or const Module; e.g. `Net model; "
                  "amp::Trainer<P, amp::CPU> t(model, optimizer);`");
    if constexpr (lvalue) {
      std::weak_ptr<torch::nn::Module> owner = model.weak_from_this();
      if (std::shared_ptr<torch::nn::Module> shared = owner.lock()) return shared;  // kept alive with the caller
      return std::shared_ptr<torch::nn::Module>(std::shared_ptr<torch::nn::Module>(), &model);  // not owned
    }
    return nullptr;
  } else if constexpr (std::is_convertible_v<T, std::shared_ptr<torch::nn::Module>>) {
    std::shared_ptr<torch::nn::Module> m = model;
    TORCH_CHECK(m != nullptr, "amp: the model is null; construct it first");
    return m;
  } else {
    // ModuleHolder<Impl> (torch::nn::Linear, TORCH_MODULE types)
    TORCH_CHECK(!model.is_empty(), "amp: the model is an empty ModuleHolder; construct it first");
    return model.ptr();
  }
}

// The optimizer against the policy: no closure-based optimizer under loss
// scaling; under fp16 parameters, an Adam eps that fp16 can hold.
template <class Policy>
void check_optimizer(const torch::optim::Optimizer& opt) {
  using traits = policy_traits<Policy>;
  TORCH_CHECK(!(closure_based(opt) && traits::uses_loss_scaling),
              "amp: a closure-based optimizer (LBFGS) cannot be used with the loss-scaling policy \"", traits::name,
              "\": the scaler would have to unscale and check gradients inside LBFGS's closure; use "
              "amp::Mixed<amp::bf16, amp::NoScaler> or an amp::True<...> policy");
  if constexpr (std::is_same_v<typename traits::param_type, fp16>) {
    // Adam's eps is added to sqrt(exp_avg_sq) in the parameters' dtype. In
    // fp16 torch's default 1e-8 rounds to 0, so any gradient element that is
    // 0 (a dead ReLU unit) makes 0/0 = NaN: reject it, naming the fix.
    constexpr double kMinNormalFp16 = 6.103515625e-05;  // 2^-14
    for (const auto& group : opt.param_groups()) {
      double eps = -1;
      const char* name = nullptr;
      if (const auto* o = dynamic_cast<const torch::optim::AdamOptions*>(&group.options()))
        eps = o->eps(), name = "AdamOptions";
      if (const auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&group.options()))
        eps = o->eps(), name = "AdamWOptions";
      TORCH_CHECK(name == nullptr || eps >= kMinNormalFp16, "amp: ", traits::name,
                  " keeps Adam's state in fp16, where eps=", eps,
                  " rounds to 0 or a subnormal and 0/0 gives NaN (the loss becomes NaN); use torch::optim::",
                  name ? name : "AdamOptions",
                  "(lr).eps(1e-4), or a policy with fp32 optimizer state (\"16-mixed\", "
                  "\"32-true\")");
    }
  }
}

// `who`<precision, Device> can run here: the device exists, and bf16 on CUDA
// has an Ampere or newer GPU.
template <class Policy, class Device>
void check_device(const char* who) {
  using traits = policy_traits<Policy>;
  TORCH_CHECK(device_traits<Device>::available(), "amp: ", who, "<", traits::name, ", ", device_traits<Device>::tag,
              "> needs a ", device_traits<Device>::name, " device, but LibTorch sees none; use amp::", who, "<Policy, ",
              device_traits<CPU>::tag, ">");
  if constexpr (std::is_same_v<Device, CUDA> && (std::is_same_v<typename traits::compute_type, bf16> ||
                                                 std::is_same_v<typename traits::param_type, bf16>)) {
    TORCH_CHECK(compat::cuda_supports_bf16(), "amp: ", traits::name,
                " computes in bf16, which needs an Ampere or newer GPU (compute capability 8.0+); this GPU has "
                "none: use amp::Mixed<amp::fp16, amp::DynamicScaler> (\"16-mixed\") on it");
  }
}

// Checks the model's parameters against the policy and Device and, for
// True<D>, converts the model to D. `who` names the caller in errors
// ("Trainer"), `when` says when to fix the model ("before constructing the Trainer").
template <class Policy, class Device>
void setup_model(torch::nn::Module& module, const char* who, const char* when) {
  using traits = policy_traits<Policy>;
  const c10::ScalarType want = scalar_type_v<typename traits::param_type>;
  const c10::DeviceType dev = device_traits<Device>::device_type;
  auto params = module.named_parameters(/*recurse=*/true);
  TORCH_CHECK(params.size() > 0, "amp: the model has no parameters to train");
  for (const auto& p : params) {
    TORCH_CHECK(p.value().device().type() == dev, "amp: parameter '", p.key(), "' is on ", p.value().device(),
                " but the ", who, "'s device is ", device_traits<Device>::name, "; move the model first (model->to(",
                device_traits<Device>::torch_name, ")) or use the ", who, " of the parameters' device");
    if constexpr (traits::uses_autocast) {
      TORCH_CHECK(p.value().scalar_type() == want, "amp: ", traits::name, " keeps parameters in fp32, but parameter '",
                  p.key(), "' is ", p.value().scalar_type(), "; call model->to(torch::kFloat32) ", when,
                  " (autocast chooses the compute dtype per op), or use amp::True<...> to train in one dtype");
    } else {
      TORCH_CHECK(at::isFloatingType(p.value().scalar_type()), "amp: parameter '", p.key(), "' is ",
                  p.value().scalar_type(), ", not a floating-point tensor");
    }
  }
  if constexpr (!traits::uses_autocast) module.to(want);
}

}  // namespace detail
}  // namespace amp
