// amp/train/activation_checkpoint.h: amp::checkpoint, torch.utils.checkpoint
// for LibTorch: a forward that keeps none of its intermediates and recomputes
// them in backward, under the precision it first ran with.
//
//   auto y = amp::checkpoint([&](const std::vector<torch::Tensor>& in) { return block(in[0]); }, {x});
//   auto y = amp::checkpoint(block, x);          // a module (anything callable on one tensor)
//   auto y = amp::checkpoint(block, x, amp::CheckpointOptions().save_matmuls(true));  // selective
//
// The forward runs fn without autograd and records what it ran under: the
// autocast state (the thread's dispatch keys and autocast dtypes), amp's
// region state (strict casts, linear routing and its LinearFn, the precision
// map in force, Float8's delayed scaling, NVFP4's stochastic-rounding
// generator) and the random generators (CPU and
// every CUDA device, as preserve_rng_state=True). Backward restores all of it,
// recomputes fn with autograd, puts the forward's state back, then
// backpropagates the recomputed graph (torch.utils.checkpoint's reentrant
// variant): the inputs' gradients go on, the parameters' accumulate in place.
// Gradients and parameters are those of the same step without checkpointing,
// bit for bit, where each weight inside fn is used only inside fn (a weight
// also used outside gets its two gradient parts summed in fp32 rather than
// in the region's 16-bit dtype, as in Python). Float8: the recompute casts
// with the forward's scales; delayed scaling records the same amax again,
// which its max leaves unchanged. Selective (save_matmuls): the forward also
// keeps the matmuls' outputs, which the recompute takes instead of running
// them again (torch's create_selective_checkpoint_contexts saving mm, addmm,
// bmm, baddbmm; amp/train/detail/saved_ops.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/arg.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/detail/compat_cuda.h"
#include "amp/detail/compat_float8.h"
#include "amp/detail/compat_ops.h"
#include "amp/float8/block_scaled.h"
#include "amp/float8/delayed.h"
#include "amp/precision/autocast.h"
#include "amp/precision/linear_routing.h"
#include "amp/precision/precision_map.h"
#include "amp/precision/strict_casts.h"
#include "amp/train/detail/saved_ops.h"
#include "amp/train/rng_state.h"

namespace amp {

// How amp::checkpoint runs a function.
struct CheckpointOptions {
  // Restore the random generators for the recompute, so that dropout draws
  // the same masks (Python's preserve_rng_state=True, the default).
  TORCH_ARG(bool, preserve_rng_state) = true;
  // Selective checkpointing: keep the outputs of the matmuls (aten::mm, addmm,
  // bmm, baddbmm) from the forward and recompute only the rest, as Python's
  // context_fn=partial(create_selective_checkpoint_contexts, [aten.mm.default,
  // ...]). Costs those outputs' bytes until backward; saves the matmuls' time
  // there. Float8 linears are recomputed in full. false: save nothing (every
  // op recomputed).
  TORCH_ARG(bool, save_matmuls) = false;
};

namespace detail {

// What a forward ran under, for its recompute; apply() installs it and
// returns what it replaced.
struct ForwardState {
  c10::impl::LocalDispatchKeySet keys = c10::impl::tls_local_dispatch_key_set();  // autocast on or off, amp's keys
  c10::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
  LinearRoutingState routing;
  StrictCastsState strict;
  std::shared_ptr<const PrecisionTable> table;
#if AMP_DETAIL_HAS_FLOAT8_MATMUL
  const float8::DelayedScaling* delayed = nullptr;
#endif
  at::Generator* rounding = nullptr;  // NVFP4<true>'s generator (a Trainer's), null: the default one
  RngStates rng;

  static ForwardState now(bool with_rng) {
    ForwardState s;
    s.cpu_dtype = compat::autocast_dtype(c10::DeviceType::CPU);
    s.cuda_dtype = compat::autocast_dtype(c10::DeviceType::CUDA);
    s.routing = linear_routing_state();
    s.strict = strict_casts_state();
    s.table = precision_table();
#if AMP_DETAIL_HAS_FLOAT8_MATMUL
    s.delayed = float8::detail::current_delayed_scaling();
#endif
    s.rounding = float8::detail::stochastic_rounding_generator();
    if (with_rng) s.rng = capture_rng();
    return s;
  }
  void install() const {
    c10::impl::_force_tls_local_dispatch_key_set(keys);
    compat::set_autocast_dtype(c10::DeviceType::CPU, cpu_dtype);
    compat::set_autocast_dtype(c10::DeviceType::CUDA, cuda_dtype);
    linear_routing_state() = routing;
    strict_casts_state() = strict;
    precision_table() = table;
#if AMP_DETAIL_HAS_FLOAT8_MATMUL
    float8::detail::current_delayed_scaling() = delayed;
#endif
    float8::detail::stochastic_rounding_generator() = rounding;
    if (rng.cpu.defined()) restore_rng(rng);
  }
};

// RAII for the recompute: the forward's state in, autocast's cast cache
// scoped as torch.autocast's __enter__/__exit__ scope it, routing and the
// precision map on inside backward; the thread's own state back after.
class RecomputeScope {
 public:
  explicit RecomputeScope(const ForwardState& forward) : own_(ForwardState::now(forward.rng.cpu.defined())) {
    forward.install();
    compat::autocast_increment_nesting();
    recomputing_forward() = true;
  }
  ~RecomputeScope() {
    recomputing_forward() = false;
    if (compat::autocast_decrement_nesting() == 0) compat::clear_autocast_cache();
    own_.install();
  }
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;

 private:
  ForwardState own_;
};

using CheckpointFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

// The backward node of one amp::checkpoint call.
class CheckpointNode : public torch::autograd::Node {
 public:
  CheckpointNode(CheckpointFn fn, std::vector<at::Tensor> inputs, ForwardState state, std::unique_ptr<SavedOps> saved)
      : fn_(std::move(fn)), inputs_(std::move(inputs)), state_(std::move(state)), saved_(std::move(saved)) {
    for (const at::Tensor& t : inputs_) versions_.push_back(t._version());
  }
  std::string name() const override { return "amp::CheckpointBackward"; }
  void expect_output(const at::Tensor& y) {
    sizes_ = y.sizes().vec();
    dtype_ = y.scalar_type();
  }
  const SavedOps* saved_ops() const { return saved_.get(); }  // null: nothing saved (or used up)

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return torch::autograd::variable_list(inputs_.size());
    for (size_t i = 0; i < inputs_.size(); ++i)
      TORCH_CHECK(inputs_[i]._version() == versions_[i], "amp: checkpoint's input ", i,
                  " was modified in place after the forward; its recompute would read other values. Clone it "
                  "before changing it, or pass a copy to amp::checkpoint");
    std::vector<at::Tensor> xs;
    for (const at::Tensor& t : inputs_) xs.push_back(t.detach().requires_grad_(t.requires_grad()));
    at::Tensor y;
    {
      RecomputeScope scope(state_);
      c10::optional<SavedOpsScope> replay;
      if (saved_) replay.emplace(nullptr, saved_.get());
      at::AutoGradMode grad(true);
      y = fn_(xs);
    }
    if (saved_) saved_->expect_used_up();
    saved_.reset();
    TORCH_CHECK(y.defined() && y.sizes().vec() == sizes_ && y.scalar_type() == dtype_,
                "amp: checkpoint's recompute returned ",
                y.defined() ? y.toString() : std::string("an undefined tensor"), y.defined() ? " " : "",
                y.defined() ? c10::str(y.sizes()) : std::string(), " where the forward returned ", dtype_, " ",
                c10::IntArrayRef(sizes_),
                "; the function must compute the same thing each time (no state that changes between calls)");
    if (y.requires_grad()) torch::autograd::backward({y}, {grads[0]});
    for (size_t i = 0; i < xs.size(); ++i)
      TORCH_CHECK(!y.requires_grad() || !inputs_[i].requires_grad() || xs[i].grad().defined(),
                  "amp: checkpoint's input ", i,
                  " requires grad but the function's output does not depend on it: fn must read its inputs from "
                  "the vector it is given (in[",
                  i, "]), not a tensor it captured; pass only the tensors it reads");
    torch::autograd::variable_list out;
    for (size_t i = 0; i < xs.size(); ++i) out.push_back(inputs_[i].requires_grad() ? xs[i].grad() : at::Tensor());
    inputs_.clear();  // the graph is used once (retain_graph is not supported)
    return out;
  }

 private:
  CheckpointFn fn_;
  std::vector<at::Tensor> inputs_;
  std::vector<uint32_t> versions_;
  ForwardState state_;
  std::unique_ptr<SavedOps> saved_;
  std::vector<int64_t> sizes_;
  c10::ScalarType dtype_ = at::kFloat;
};

}  // namespace detail

// fn(inputs) with its intermediates recomputed in backward instead of kept.
// fn returns one floating-point tensor. Without autograd (no_grad), just fn(inputs).
template <class F, std::enable_if_t<!std::is_invocable_v<F&, const at::Tensor&>, int> = 0>
at::Tensor checkpoint(F&& f, const std::vector<at::Tensor>& inputs, const CheckpointOptions& options = {}) {
  detail::CheckpointFn fn(std::forward<F>(f));
  if (!at::GradMode::is_enabled()) return fn(inputs);
#if AMP_DETAIL_WITH_CUDA
  for (const at::Tensor& t : inputs)
    TORCH_CHECK(!(t.defined() && t.is_cuda() && detail::compat::cuda_stream_capturing(t.get_device())),
                "amp: checkpoint cannot run while a CUDA graph is being captured (its random-state save and restore "
                "and its recompute in backward are not capturable); call the block without amp::checkpoint in the "
                "captured step");
#endif
  for (size_t i = 0; i < inputs.size(); ++i)
    TORCH_CHECK(inputs[i].defined(), "amp: checkpoint's input ", i,
                " is undefined; pass the tensors fn reads (others it may capture, but their gradients then "
                "flow only if they are parameters)");
  detail::ForwardState state = detail::ForwardState::now(options.preserve_rng_state());
  std::unique_ptr<detail::SavedOps> saved;
  if (options.save_matmuls()) saved = std::make_unique<detail::SavedOps>();
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    // A weight cast cached now would have no history: a later use of the same
    // weight in the region, or a recompute inside it (backward in the region,
    // a nested checkpoint), would reuse it and get no gradient. Off, each use
    // is cast afresh, to the same values.
    detail::AutocastCacheOff no_cache;
    // Inside another selective checkpoint's recompute, its saved outputs still come first.
    c10::optional<detail::SavedOpsScope> saving;
    if (saved) saving.emplace(saved.get(), detail::saved_ops_state().replaying);
    y = fn(inputs);
  }
  TORCH_CHECK(y.defined() && at::isFloatingType(y.scalar_type()),
              "amp: checkpoint's function must return a defined floating-point tensor, got ",
              y.defined() ? c10::toString(y.scalar_type()) : "an undefined tensor");
  y = y.detach();  // its own TensorImpl, even where fn returned an input
  auto node = detail::compat::make_autograd_node<detail::CheckpointNode>(std::move(fn), inputs, std::move(state),
                                                                         std::move(saved));
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  node->expect_output(y);
  torch::autograd::set_history(y, node);
  return y;
}

// A module's forward (or any callable on one tensor), checkpointed. The
// module must outlive the backward pass.
template <class Module, std::enable_if_t<std::is_invocable_v<Module&, const at::Tensor&>, int> = 0>
at::Tensor checkpoint(Module& module, const at::Tensor& x, const CheckpointOptions& options = {}) {
  return checkpoint([&module](const std::vector<at::Tensor>& in) { return at::Tensor(module(in[0])); }, {x}, options);
}

}  // namespace amp
