// amp/capture/detail/recorder.h: what CapturedStep (amp/capture/captured_step.h)
// records with: the CUDA graph recorder (or, without CUDA, one that says so),
// the snapshot of the optimizer options a graph replays, autocast's cache
// switched off while recording, and what keeps a Stepper from being captured.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/detail/compat_cuda.h"
#include "amp/detail/compat_ops.h"
#include "amp/core/device.h"
#include "amp/precision/autocast.h"
#include "amp/train/stepper.h"

namespace amp {
namespace detail {

// A copy of each param group's options: a CUDA graph replays the learning
// rate and the other hyperparameters it was captured with, so a change
// between replays must be caught, not silently ignored.
class OptimizerOptionsSnapshot {
 public:
  OptimizerOptionsSnapshot() = default;
  explicit OptimizerOptionsSnapshot(const torch::optim::Optimizer& optimizer) {
    for (const auto& group : optimizer.param_groups()) {
      options_.push_back(group.options().clone());
      sizes_.push_back(group.params().size());
    }
  }

  // "" when the optimizer's groups and options are as captured, else what changed.
  std::string changed(const torch::optim::Optimizer& optimizer) const {
    const auto& groups = optimizer.param_groups();
    if (groups.size() != options_.size())
      return "the optimizer has " + std::to_string(groups.size()) + " param groups, the step was captured with " +
             std::to_string(options_.size());
    for (size_t g = 0; g < groups.size(); ++g) {
      if (groups[g].params().size() != sizes_[g])
        return "param group " + std::to_string(g) + " has " + std::to_string(groups[g].params().size()) +
               " parameters, the step was captured with " + std::to_string(sizes_[g]);
      if (!same(*options_[g], groups[g].options()))
        return "the options of param group " + std::to_string(g) + " changed (lr " +
               std::to_string(options_[g]->get_lr()) + " at capture, now " +
               std::to_string(groups[g].options().get_lr()) + ", or another hyperparameter)";
    }
    return "";
  }

 private:
  // Whether a and b are equal options of kind O; nullopt when a is not an O.
  template <class O>
  static std::optional<bool> equal_as(const torch::optim::OptimizerOptions& a,
                                      const torch::optim::OptimizerOptions& b) {
    const auto* x = dynamic_cast<const O*>(&a);
    if (x == nullptr) return std::nullopt;
    const auto* y = dynamic_cast<const O*>(&b);
    return y != nullptr && *x == *y;
  }
  static bool same(const torch::optim::OptimizerOptions& a, const torch::optim::OptimizerOptions& b) {
    if (const auto r = equal_as<torch::optim::AdamOptions>(a, b)) return *r;
    if (const auto r = equal_as<torch::optim::AdamWOptions>(a, b)) return *r;
    if (const auto r = equal_as<torch::optim::SGDOptions>(a, b)) return *r;
    return a.get_lr() == b.get_lr();  // not reached: capture needs a fused kind
  }

  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options_;
  std::vector<size_t> sizes_;
};

// Why a Stepper's step cannot be captured, in words that say what to change;
// "" when it can: the fused path, one micro-batch per step, no multi-process hook.
template <class Scaler>
std::string capture_blocker(const Stepper<Scaler>& stepper) {
  if (!stepper.fused())
    return "capture() needs the fused, sync-free optimizer step, and this one takes the " + stepper.optimizer_path() +
           " path: use torch::optim::Adam, AdamW or SGD with TrainerOptions().step(StepOptions().fused(true)) (the "
           "default), on a "
           "LibTorch and device with their fused kernels";
  if (stepper.options().accumulation_steps() != 1)
    return "capture() records one whole optimizer step, but accumulation_steps is " +
           std::to_string(stepper.options().accumulation_steps()) +
           ": set accumulation_steps(1) and capture the larger batch, or train with eager steps";
  if (stepper.gradient_sync() != nullptr)
    return "capture() does not record the all-reduces of multi-process training (a GradientSync is installed): "
           "train DataParallel with eager steps";
  return "";
}

#if AMP_DETAIL_WITH_CUDA
// How CapturedStep records and replays on CUDA: warm-up and capture on a side
// stream, a CUDA graph with its private memory pool, the default generator's
// state saved and restored around the warm-up. (CapturedStep's Recorder
// parameter: tests substitute one that replays by running the step eagerly,
// to check everything but the graph on CPU.)
class CudaGraphRecorder {
 public:
  explicit CudaGraphRecorder(c10::Device device) : device_(device), stream_(compat::side_stream(device.index())) {}

  void synchronize() const { compat::cuda_synchronize(); }
  // Warm-up and capture run on the same side stream (its cuBLAS handle and
  // workspace are made by the warm-up, not inside the capture).
  template <class G>
  void on_side_stream(G&& g) const {
    c10::cuda::CUDAGuard device_guard(device_);
    c10::cuda::CUDAStreamGuard stream_guard(stream_);
    g();
  }
  at::Tensor rng_state() const { return compat::cuda_rng_state(device_.index()); }
  void set_rng_state(const at::Tensor& state) const { compat::set_cuda_rng_state(device_.index(), state); }

  // Records body() into a new graph (it is captured, not run) and returns
  // its outputs: the graph's static output tensors.
  template <class Body>
  StepResult record(Body&& body) {
    graph_.reset();
    auto graph = std::make_unique<compat::CudaGraph>();
    const int64_t reserved = compat::cuda_reserved_bytes(device_.index());
    StepResult outputs;
    on_side_stream([&] {
      AutocastCacheOff cache_off;
      graph->capture_begin();
      try {
        outputs = body();
      } catch (...) {
        try {
          graph->capture_end();
        } catch (...) {
        }
        throw;
      }
      graph->capture_end();
    });
    synchronize();
    pool_bytes_ = compat::cuda_reserved_bytes(device_.index()) - reserved;
    graph_ = std::move(graph);
    return outputs;
  }

  // One replay of the graph on the current stream: `body` is not called, the
  // returned `outputs` (record()'s) hold the new values.
  template <class Body>
  StepResult replay(Body&&, const StepResult& outputs) {
    c10::cuda::CUDAGuard device_guard(device_);
    graph_->replay();
    return outputs;
  }

  void reset() { graph_.reset(); }
  int64_t pool_bytes() const { return pool_bytes_; }

 private:
  c10::Device device_;
  c10::cuda::CUDAStream stream_;
  std::unique_ptr<compat::CudaGraph> graph_;
  int64_t pool_bytes_ = 0;
};
using DefaultRecorder = CudaGraphRecorder;
#else
// Without CUDA: capture() compiles (for amp::CUDA) and throws.
class NoCudaRecorder {
 public:
  explicit NoCudaRecorder(c10::Device) {}
  void synchronize() const {}
  template <class G>
  void on_side_stream(G&&) const {
    fail();
  }
  at::Tensor rng_state() const { return at::Tensor(); }
  void set_rng_state(const at::Tensor&) const {}
  template <class Body>
  StepResult record(Body&&) {
    fail();
    return {};
  }
  template <class Body>
  StepResult replay(Body&&, const StepResult& outputs) {
    fail();
    return outputs;
  }
  void reset() {}
  int64_t pool_bytes() const { return 0; }

 private:
  [[noreturn]] static void fail() {
    TORCH_CHECK(false,
                "amp: capture() needs a LibTorch built with CUDA (this one has no CUDA graphs) and amp built "
                "with AMP_DETAIL_WITH_CUDA=1; train with trainer.step(fn)");
  }
};
using DefaultRecorder = NoCudaRecorder;
#endif

}  // namespace detail
}  // namespace amp
