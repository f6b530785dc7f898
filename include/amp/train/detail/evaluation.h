// amp/train/detail/evaluation.h: a forward and an evaluation under a policy's
// region, for Trainer and Fabric.
//
//   auto acc = amp::detail::evaluate<amp::Region<P, amp::CPU>>({model.get()}, amp::RegionOptions(), nullptr,
//                                                              [&](auto&) { return f(); });
//
// Python's `model.eval(); with torch.no_grad(), torch.autocast(...): ...;
// model.train()`, except that each submodule gets back the mode it had (a
// frozen BatchNorm left in eval stays in eval), also when fn throws.
#pragma once

#include <torch/nn/module.h>
#include <ATen/core/grad_mode.h>

#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/precision/region.h"
#include "amp/train/detail/fp16_pitfalls.h"

namespace amp {
namespace detail {

// Every given module and its submodules in eval mode while it lives; their
// own modes back afterwards.
class EvalMode {
 public:
  explicit EvalMode(const std::vector<torch::nn::Module*>& modules) {
    for (torch::nn::Module* m : modules) {
      // Pre-order (a module before its children), so restoring in this order
      // lets a child's own mode override its parent's train(). modules(false):
      // a model held without ownership (a `Net model;`) has no shared_ptr to itself.
      saved_.emplace_back(m, m->is_training());
      for (const auto& sub : m->modules(/*include_self=*/false)) saved_.emplace_back(sub.get(), sub->is_training());
    }
    for (torch::nn::Module* m : modules) m->eval();
  }
  ~EvalMode() {
    for (auto& [module, training] : saved_) module->train(training);
  }
  EvalMode(const EvalMode&) = delete;
  EvalMode& operator=(const EvalMode&) = delete;

 private:
  std::vector<std::pair<torch::nn::Module*, bool>> saved_;  // the modules outlive the evaluation
};

// fn(region) under Region (autocast for a Mixed policy), the forward of a
// Trainer's step and of Fabric::forward; returns what fn returns. An fp16
// overflow of a scalar is rethrown as amp's explanation (fp16_pitfalls.h).
template <class Region, class F>
decltype(auto) forward(const RegionOptions& options, const PrecisionMap::Resolved& table, F& fn) {
  Region region(options, table);
  return explain_fp16_errors<typename Region::policy>([&]() -> decltype(auto) { return fn(region); });
}

// forward() with the modules in eval mode and no autograd.
template <class Region, class F>
decltype(auto) evaluate(const std::vector<torch::nn::Module*>& modules, const RegionOptions& options,
                        const PrecisionMap::Resolved& table, F& fn) {
  static_assert(std::is_invocable_v<F&, Region&>,
                "amp: the evaluation function must take the region: [&](auto& region) { return metric; }");
  EvalMode eval(modules);
  at::NoGradGuard no_grad;
  return forward<Region>(options, table, fn);
}

}  // namespace detail
}  // namespace amp
