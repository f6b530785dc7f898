// tests/capture/optimizer_state.h: a parameter's entry in a LibTorch optimizer's
// state, as tensors and a step count, for tests that compare two runs.
#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "amp/detail/compat.h"
#include "amp/optim/low_bit_adam.h"

namespace amp_test {

// The state tensors of `param` (Adam: exp_avg, exp_avg_sq, max_exp_avg_sq,
// the last undefined without amsgrad; AdamW: exp_avg, exp_avg_sq; SGD: the
// momentum buffer; amp's low-bit Adams: each moment's values, or codes and
// scales) and its step count (0 for SGD); {{}, -1} without an
// entry, {{}, -2} for another optimizer's state.
inline std::pair<std::vector<at::Tensor>, int64_t> state_of(torch::optim::Optimizer& opt, const at::Tensor& param) {
  auto it = opt.state().find(amp::detail::compat::optim_state_key(param.unsafeGetTensorImpl()));
  if (it == opt.state().end()) return {{}, -1};
  if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(it->second.get()))
    return {{s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq()}, s->step()};
  if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get()))
    return {{s->exp_avg(), s->exp_avg_sq()}, s->step()};
  if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) return {{s->momentum_buffer()}, 0};
  if (auto* s = dynamic_cast<amp::detail::LowBitAdamParamState*>(it->second.get())) {
    std::vector<at::Tensor> tensors;
    for (const amp::detail::QuantizedState* q : {&s->exp_avg(), &s->exp_avg_sq(), &s->max_exp_avg_sq()}) {
      if (!q->defined()) continue;
      tensors.push_back(q->format() == amp::StateFormat::kFloat ? q->values() : q->codes());
      if (q->format() != amp::StateFormat::kFloat) tensors.push_back(q->scale());
    }
    return {tensors, static_cast<int64_t>(s->step().item<float>())};
  }
  return {{}, -2};
}

// Whether two state tensors are the same bits (both undefined counts).
inline bool same_state_tensor(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() == b.defined() && (!a.defined() || a.equal(b));
}

}  // namespace amp_test
