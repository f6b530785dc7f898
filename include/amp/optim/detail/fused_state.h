// amp/optim/detail/fused_state.h: the optimizer state optim/fused.h's
// FusedStep keeps beside LibTorch's: per parameter a Record (Adam's float32
// device step counter, SGD's "first step ran" flag while unknown, whether the
// entry was made by FusedStep), the state entries found or made as LibTorch's
// first step makes them (adam.cpp, adamw.cpp, sgd.cpp), taken back when a step
// fails before its first kernel, and settled from synced values.
//
//   detail::fused::ParamStates states;
//   states.gather_adam<torch::optim::AdamParamState>(optimizer, kind, p, grad, amsgrad, g, i, calls);
//   states.take_back_made(optimizer);  // on error, before any kernel ran; else keep_made()
#pragma once

#include <ATen/ATen.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "amp/detail/compat.h"
#include "amp/optim/detail/fused_ops.h"
#include "amp/optim/fused_kind.h"

namespace amp {
namespace detail {

namespace fused {

// What FusedStep keeps about one parameter's state entry.
struct Record {
  compat::OptimStateKey key;
  torch::optim::OptimizerParamState* state = nullptr;  // the entry it was read from or made as
  int64_t host_step = 0;                               // Adam: the entry's step() when `step` was read or written
  at::Tensor step;                                     // Adam: float32 counter on the parameter's device
  bool made_here = false;  // the entry was made by FusedStep and no step of it is known to have run
  at::Tensor pending;      // SGD: the buffer's flag while unknown whether its first step ran
};

// Applies one synced value, Adam's step counter or SGD's "first step ran"
// flag, to record `r` and its entry in the optimizer's `state` map. Returns
// false when the record is to be dropped: its entry was made by steps that
// were all skipped, so it is erased, as if never made (kept when `is_static`:
// a graph may still write it).
template <class StateMap>
bool settle(FusedKind kind, bool is_static, Record& r, float value, StateMap& state) {
  if (kind == FusedKind::kSgd) {
    if (value != 0.f) {
      r.made_here = false;
      if (!is_static) r.pending = at::Tensor();  // static: the flag tensor stays, a graph rereads it
      return true;
    }
    if (is_static) return true;
    if (r.made_here) state.erase(r.key);
    return false;
  }
  const auto step = static_cast<int64_t>(value);
  if (r.made_here && step == 0 && !is_static) {
    state.erase(r.key);
    return false;
  }
  if (kind == FusedKind::kAdam) {
    static_cast<torch::optim::AdamParamState*>(r.state)->step(step);
  } else {
    static_cast<torch::optim::AdamWParamState*>(r.state)->step(step);
  }
  r.host_step = step;
  r.made_here = r.made_here && step == 0;
  return true;
}

// The Records of one FusedStep, by parameter, and the state entries the step
// in progress made. gather_adam / gather_sgd find or make a parameter's entry
// in the optimizer's map, check its tensors and add them to the kernel call of
// the parameter's device and dtype.
class ParamStates {
 public:
  using Records = std::unordered_map<c10::TensorImpl*, Record>;

  Records& records() { return records_; }
  const Records& records() const { return records_; }

  // The record of p's state entry; `entry` is the entry now in the map.
  Record& record_for(const at::Tensor& p, torch::optim::OptimizerParamState* entry) {
    Record& r = records_[p.unsafeGetTensorImpl()];
    if (r.state != entry) {
      r = Record{};
      r.key = state_key(p);
      r.state = entry;
    }
    return r;
  }

  // Drops the records whose state entry is gone or was replaced: the entry
  // is authoritative then.
  void drop_replaced(torch::optim::Optimizer& optimizer) {
    auto& state = optimizer.state();
    for (auto it = records_.begin(); it != records_.end();) {
      auto entry = state.find(it->second.key);
      if (entry == state.end() || entry->second.get() != it->second.state) {
        it = records_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // No kernel has run: erases the state entries made since keep_made().
  void take_back_made(torch::optim::Optimizer& optimizer) {
    for (const auto& made : made_) {
      optimizer.state().erase(made.second);
      records_.erase(made.first);
    }
    made_.clear();
  }
  // The entries made so far stay (their step is about to run).
  void keep_made() { made_.clear(); }

  template <class State>
  void gather_adam(torch::optim::Optimizer& optimizer, FusedKind kind, const at::Tensor& p, const at::Tensor& grad,
                   bool amsgrad, size_t g, size_t i, std::vector<Call>& calls) {
    auto& map = optimizer.state();
    auto entry = map.find(state_key(p));
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
      map[state_key(p)] = std::move(fresh);
      made_.emplace_back(p.unsafeGetTensorImpl(), state_key(p));
      made = true;
    } else {
      state = dynamic_cast<State*>(entry->second.get());
      TORCH_CHECK(state != nullptr, "amp: FusedStep: the optimizer's state of parameter ", i, " of param group ", g,
                  " is not a ", fused_kind_name(kind), " state");
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
    Call& call = call_for(calls, p);
    call.params.push_back(p);
    call.grads.push_back(grad);
    call.exp_avgs.push_back(state->exp_avg());
    call.exp_avg_sqs.push_back(state->exp_avg_sq());
    if (amsgrad) call.max_exp_avg_sqs.push_back(state->max_exp_avg_sq());
    call.steps.push_back(r.step);
    call.impls.push_back(p.unsafeGetTensorImpl());
  }

  void gather_sgd(torch::optim::Optimizer& optimizer, const at::Tensor& p, const at::Tensor& grad, bool momentum,
                  bool has_found_inf, size_t g, size_t i, std::vector<Call>& calls) {
    if (!momentum) {
      // No state: LibTorch's SGD keeps none without momentum.
      Call& call = call_for(calls, p);
      call.params.push_back(p);
      call.grads.push_back(grad);
      return;
    }
    auto& map = optimizer.state();
    auto entry = map.find(state_key(p));
    torch::optim::SGDParamState* state = nullptr;
    int first_step = 0;
    at::Tensor pending;
    if (entry == map.end()) {
      // sgd.cpp: buf = clone(d_p) on the first step; the kernel writes d_p into it.
      auto fresh = std::make_unique<torch::optim::SGDParamState>();
      fresh->momentum_buffer(at::zeros_like(grad, at::MemoryFormat::Preserve));
      state = fresh.get();
      map[state_key(p)] = std::move(fresh);
      made_.emplace_back(p.unsafeGetTensorImpl(), state_key(p));
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
    Call& call = call_for(calls, p, first_step, pending);
    call.params.push_back(p);
    call.grads.push_back(grad);
    call.bufs.push_back(state->momentum_buffer());
    call.impls.push_back(p.unsafeGetTensorImpl());
  }

 private:
  Records records_;
  std::vector<std::pair<c10::TensorImpl*, compat::OptimStateKey>> made_;  // entries made by the step in progress
};

}  // namespace fused

}  // namespace detail
}  // namespace amp
