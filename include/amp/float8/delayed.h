// amp/float8/delayed.h: float8 linears with delayed scaling (Transformer
// Engine's DelayedScaling recipe, HYBRID formats): each linear's scales come
// from the amaxes of earlier steps, so a cast needs no reduction of its own
// tensor first.
//
//   amp::float8::DelayedScaling fp8(amp::float8::DelayedOptions().history_length(16));
//   fp8.track(*model);                          // a state per nn::Linear whose weight fits
//   for (...) {
//     { amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> region;
//       amp::float8::DelayedLinearGuard guard(fp8);
//       loss = loss_fn(model->forward(x)); }
//     loss.backward(); opt.step(); fp8.update();   // the scales for the next step, the histories rolled
//   }
//
// Per tracked linear (TE's layout): the forward group (input, weight; e4m3)
// and the backward group (output gradient; e5m2), each an amax history
// [length, roles] and a scale [roles], starting at 0 and 1. A call casts with
// the group's current scale (saturating) and keeps its tensor's amax in the
// history's slot 0 (the largest of the step's calls); update() computes every
// scale with float8::delayed_scale_update and rolls the histories. All on the
// weight's device, without a host sync. state_dict()/load_state_dict() carry
// them in checkpoints.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/arg.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "amp/detail/compat_float8.h"
#include "amp/float8/linear.h"
#include "amp/float8/recipe.h"
#include "amp/precision/linear_routing.h"

namespace amp {
namespace float8 {

// Delayed scaling's options, LibTorch style (TORCH_ARG); DelayedScaling checks
// them. Transformer Engine's defaults: 1024 steps of history, margin 0.
struct DelayedOptions {
  TORCH_ARG(int64_t, history_length) = 1024;
  TORCH_ARG(int64_t, margin) = 0;
};

#if AMP_DETAIL_HAS_FLOAT8_MATMUL

class DelayedScaling {
 public:
  explicit DelayedScaling(DelayedOptions options = DelayedOptions()) : options_(checked(options)) {}
  DelayedScaling(const DelayedScaling&) = delete;
  DelayedScaling& operator=(const DelayedScaling&) = delete;

  // A state for every torch::nn::Linear in `model` whose weight fits
  // (float8::fits), named by `prefix` and the module's path ("0",
  // "encoder.fc1", ...; "linear" for a model that is one); returns how many.
  // A weight or name tracked already is an amp: error that adds nothing.
  int64_t track(torch::nn::Module& model, const std::string& prefix = "") {
    std::vector<std::pair<std::string, at::Tensor>> found;
    std::map<std::string, int> names;
    for (const auto& [path, linear] : detail::linears_of(model)) {
      if (!detail::fits(linear->weight)) continue;
      found.emplace_back(prefix + path, linear->weight);
      check_new(found.back().first, found.back().second);
      TORCH_CHECK(names[found.back().first]++ == 0, "amp: two linears named ", found.back().first);
    }
    for (const auto& [name, weight] : found) track(name, weight);
    return static_cast<int64_t>(found.size());
  }

  // A state for one weight [out, in] under `name`.
  void track(const std::string& name, const at::Tensor& weight) {
    check_new(name, weight);
    const auto f32 = weight.options().dtype(at::kFloat).requires_grad(false);
    detail::DelayedSlots slots{at::zeros({options_.history_length(), 2}, f32), at::ones({2}, f32),
                               at::zeros({options_.history_length(), 1}, f32), at::ones({1}, f32)};
    by_weight_[weight.unsafeGetTensorImpl()] = names_.size();
    by_name_[name] = names_.size();
    names_.push_back(name);
    slots_.push_back(std::move(slots));
  }

  // The state of `weight`'s linear, or null when it is not tracked.
  const detail::DelayedSlots* slots_of(const at::Tensor& weight) const {
    const auto it = by_weight_.find(weight.unsafeGetTensorImpl());
    return it == by_weight_.end() ? nullptr : &slots_[it->second];
  }

  // After each optimizer step: every scale from its history, and the
  // histories rolled (slot 0 zeroed for the next step's amaxes).
  void update() {
    update([](at::Tensor&) {});
  }
  // The same, the step's amaxes (every history's slot 0, as one tensor)
  // first passed to reduce_max(at::Tensor&), which replaces them in place by
  // their largest over the processes (TE's reduce_amax): one collective per step.
  template <class ReduceMax>
  void update(ReduceMax&& reduce_max) {
    at::NoGradGuard no_grad;
    if (!slots_.empty()) {
      std::vector<at::Tensor> rows;
      for (const detail::DelayedSlots& s : slots_) {
        rows.push_back(s.fwd_history.select(0, 0));
        rows.push_back(s.bwd_history.select(0, 0));
      }
      at::Tensor amaxes = at::cat(rows);
      reduce_max(amaxes);
      int64_t offset = 0;
      for (at::Tensor& row : rows) {
        row.copy_(amaxes.narrow(0, offset, row.numel()));
        offset += row.numel();
      }
    }
    for (detail::DelayedSlots& s : slots_) {
      s.fwd_scale.copy_(
          detail::delayed_scale_update(s.fwd_history, s.fwd_scale, amp::detail::kFloat8E4M3Max, options_.margin()));
      s.bwd_scale.copy_(
          detail::delayed_scale_update(s.bwd_history, s.bwd_scale, amp::detail::kFloat8E5M2Max, options_.margin()));
    }
  }

  // "<name>.fwd_amax_history", "<name>.fwd_scale", "<name>.bwd_amax_history",
  // "<name>.bwd_scale" for every tracked weight, in tracking order.
  torch::OrderedDict<std::string, at::Tensor> state_dict() const {
    torch::OrderedDict<std::string, at::Tensor> out;
    for (size_t i = 0; i < names_.size(); ++i) {
      out.insert(names_[i] + ".fwd_amax_history", slots_[i].fwd_history);
      out.insert(names_[i] + ".fwd_scale", slots_[i].fwd_scale);
      out.insert(names_[i] + ".bwd_amax_history", slots_[i].bwd_history);
      out.insert(names_[i] + ".bwd_scale", slots_[i].bwd_scale);
    }
    return out;
  }

  // Copies a state_dict() in; every key and shape is checked before anything
  // changes, so a state that does not fit leaves this one as it was.
  void load_state_dict(const torch::OrderedDict<std::string, at::Tensor>& state) {
    const auto mine = state_dict();
    TORCH_CHECK(state.size() == mine.size(), "amp: the float8 state has ", state.size(), " tensors, this one ",
                mine.size(), "; track the same linears before loading");
    for (const auto& item : mine) {
      const at::Tensor* t = state.find(item.key());
      TORCH_CHECK(t != nullptr, "amp: the float8 state lacks ", item.key(), "; track the same linears before loading");
      TORCH_CHECK(t->sizes() == item.value().sizes(), "amp: the float8 state's ", item.key(), " is ", t->sizes(),
                  ", this one's ", item.value().sizes(), " (another history length?)");
      // What delayed_scale_update can leave: scales finite and > 0; an amax is never
      // negative (a recorded inf or NaN is kept: the update skips it).
      const bool scale = item.key().size() >= 6 && item.key().compare(item.key().size() - 6, 6, "_scale") == 0;
      const at::Tensor v = t->detach().to(at::kDouble);
      TORCH_CHECK(
          scale ? at::isfinite(v).all().item<bool>() && (v > 0.0).all().item<bool>() : !(v < 0.0).any().item<bool>(),
          "amp: the float8 state's ", item.key(),
          scale ? " holds a scale that is not finite and > 0" : " holds a negative amax", ": the state is damaged");
    }
    at::NoGradGuard no_grad;
    for (const auto& item : mine) item.value().copy_(*state.find(item.key()));
  }

  const std::vector<std::string>& tracked() const { return names_; }
  const DelayedOptions& options() const { return options_; }

 private:
  static DelayedOptions checked(const DelayedOptions& o) {
    TORCH_CHECK(o.history_length() >= 1, "amp: DelayedOptions::history_length must be at least 1, got ",
                o.history_length());
    TORCH_CHECK(o.margin() >= 0 && o.margin() < 64, "amp: DelayedOptions::margin is a power of 2 in [0, 64), got ",
                o.margin());
    return o;
  }

  void check_new(const std::string& name, const at::Tensor& weight) const {
    TORCH_CHECK(detail::fits(weight),
                "amp: float8 delayed scaling tracks weights whose dimensions are multiples of 16; ", name, " is ",
                weight.sizes());
    TORCH_CHECK(by_weight_.count(weight.unsafeGetTensorImpl()) == 0, "amp: the weight ", name,
                " is already tracked by this DelayedScaling");
    TORCH_CHECK(by_name_.count(name) == 0, "amp: DelayedScaling already tracks a weight named ", name);
  }

  DelayedOptions options_;
  std::vector<std::string> names_;
  std::vector<detail::DelayedSlots> slots_;
  std::map<const void*, size_t> by_weight_;
  std::map<std::string, size_t> by_name_;
};

namespace detail {

inline const DelayedScaling*& current_delayed_scaling() {
  static thread_local const DelayedScaling* current = nullptr;
  return current;
}

// The LinearFn of a DelayedLinearGuard: tracked weights in float8 with
// delayed scaling; a weight that fits but is not tracked is an amp: error
// (its state would be missing from checkpoints); the others run at::linear.
inline at::Tensor delayed_linear(const at::Tensor& input, const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& bias) {
  if (!fits(weight)) return at::linear(input, weight, bias);
  const DelayedScaling* scaling = current_delayed_scaling();
  TORCH_CHECK(scaling != nullptr,
              "amp: a float8 linear with delayed scaling ran, but no DelayedScaling is bound on this thread; "
              "amp::Trainer and amp::Fabric bind theirs, and with a Region of your own bind one with "
              "amp::float8::DelayedLinearGuard guard(scaling)");
  const DelayedSlots* slots = scaling->slots_of(weight);
  TORCH_CHECK(slots != nullptr, "amp: a linear's weight ", weight.sizes(),
              " fits float8 but this DelayedScaling does not track it; call track(model) for the module that owns it");
  return float8_linear(input, weight, bias, slots);
}

}  // namespace detail

// RAII: while it lives, the linears a routing region routes on this thread
// run in float8 with `scaling`'s delayed scales (see LinearGuard for the
// tensorwise recipe). The previous LinearFn comes back after. Inside a
// block-scaled region (Float8<MXFP8<...>> or <NVFP4<...>>): an amp: error.
class DelayedLinearGuard {
 public:
  explicit DelayedLinearGuard(const DelayedScaling& scaling)
      : fn_((detail::check_no_block_scaled_region("amp::float8::DelayedLinearGuard", "amp::Delayed<...>"),
             &detail::delayed_linear)),
        prev_(detail::current_delayed_scaling()) {
    detail::current_delayed_scaling() = &scaling;
  }
  ~DelayedLinearGuard() { detail::current_delayed_scaling() = prev_; }
  DelayedLinearGuard(const DelayedLinearGuard&) = delete;
  DelayedLinearGuard& operator=(const DelayedLinearGuard&) = delete;

 private:
  amp::detail::LinearFnGuard fn_;
  const DelayedScaling* prev_;
};

#endif  // AMP_DETAIL_HAS_FLOAT8_MATMUL

}  // namespace float8
}  // namespace amp
