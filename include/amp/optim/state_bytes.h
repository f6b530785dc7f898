// amp/optim/state_bytes.h: optimizer_state_bytes, the bytes an optimizer's
// state tensors hold: the memory half of mixed precision, counted.
//
//   const int64_t bytes = amp::optimizer_state_bytes(optimizer);
//   double per_param = double(bytes) / amp::parameter_count(optimizer);   // AdamW: 8 (+4 per tensor); AdamW8bit: ~2
//
// LibTorch's Adam, AdamW, SGD, Adagrad and RMSprop states and amp's low-bit
// Adam states; another state type is an "amp: ..." error (nothing to guess).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <initializer_list>
#include <typeinfo>

#include "amp/optim/low_bit_adam.h"

namespace amp {
namespace detail {
inline int64_t tensor_bytes(std::initializer_list<const at::Tensor*> tensors) {
  int64_t n = 0;
  for (const at::Tensor* t : tensors)
    if (t->defined()) n += t->numel() * static_cast<int64_t>(t->element_size());
  return n;
}
}  // namespace detail

// The bytes of every state tensor of `optimizer` (LibTorch's own step
// counters are host integers and count 0; amp's low-bit step counters are
// 4-byte device tensors and count).
inline int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  int64_t total = 0;
  for (const auto& entry : optimizer.state()) {
    const torch::optim::OptimizerParamState* s = entry.second.get();
    if (const auto* low = dynamic_cast<const detail::LowBitAdamParamState*>(s)) {
      total += low->nbytes();
    } else if (const auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
      total += detail::tensor_bytes({&adam->exp_avg(), &adam->exp_avg_sq(), &adam->max_exp_avg_sq()});
    } else if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
      total += detail::tensor_bytes({&adamw->exp_avg(), &adamw->exp_avg_sq(), &adamw->max_exp_avg_sq()});
    } else if (const auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
      total += detail::tensor_bytes({&sgd->momentum_buffer()});
    } else if (const auto* adagrad = dynamic_cast<const torch::optim::AdagradParamState*>(s)) {
      total += detail::tensor_bytes({&adagrad->sum()});
    } else if (const auto* rms = dynamic_cast<const torch::optim::RMSpropParamState*>(s)) {
      total += detail::tensor_bytes({&rms->square_avg(), &rms->momentum_buffer(), &rms->grad_avg()});
    } else {
      TORCH_CHECK(false, "amp: optimizer_state_bytes does not know the state type ", c10::demangle(typeid(*s).name()),
                  "; it counts LibTorch's Adam, AdamW, SGD, Adagrad and RMSprop states and amp's low-bit Adam states");
    }
  }
  return total;
}

// The number of parameter elements `optimizer` steps (all param groups).
inline int64_t parameter_count(const torch::optim::Optimizer& optimizer) {
  int64_t n = 0;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) n += p.numel();
  return n;
}

}  // namespace amp
