// amp/capture/captured_step.h: CapturedStep, a Trainer's whole training step recorded once
// in a CUDA graph and replayed: forward under the policy's autocast, scaled
// backward, inf/NaN check, clipping, the fused optimizer step and the scale
// update, one graph launch per step instead of hundreds of kernel launches.
//
//   amp::Trainer<amp::Mixed<amp::fp16, amp::DynamicScaler>, amp::CUDA> trainer(model, optimizer);
//   auto step = amp::capture(trainer, [&](auto& region, const Batch& b) { return loss_of(model, b); }, example);
//   for (const Batch& b : batches) {
//     amp::StepResult r = step(b);   // copies b into the graph's inputs, replays; no host sync
//   }
//   step.recapture(other_batch);     // other shapes; after trainer.load() or an optimizer option change
//
// Capture: a few eager warm-up steps on a side stream (cuBLAS workspaces,
// allocator, optimizer state), all undone from an in-memory snapshot of the
// trainer, then one trainer.step() recorded, with the Stepper's state fixed
// (Stepper::make_static), into a private memory pool with autocast's
// weight-cast cache off. Every tensor the step changes is updated in place
// (parameters, optimizer state, step counters, scale), so N replays equal N
// eager fused steps bit for bit, skips and scale changes included.
// Requirements and limits: docs/fused-step.md, "Captured steps (CUDA graphs)".
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
#include "amp/capture/detail/static_batch.h"
#include "amp/core/device.h"
#include "amp/train/stepper.h"
#include "amp/train/trainer.h"

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

// Autocast's weight-cast cache off for the scope: a cached cast would be
// recorded once and never redone, replaying stale weights.
class AutocastCacheOff {
 public:
  AutocastCacheOff() : was_(compat::autocast_cache_enabled()) { compat::set_autocast_cache_enabled(false); }
  ~AutocastCacheOff() { compat::set_autocast_cache_enabled(was_); }
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool was_;
};

// Why a Stepper's step cannot be captured, in words that say what to change;
// "" when it can: the fused path, one micro-batch per step, no multi-process hook.
template <class Scaler>
std::string capture_blocker(const Stepper<Scaler>& stepper) {
  if (!stepper.fused())
    return "capture() needs the fused, sync-free optimizer step, and this one takes the " + stepper.optimizer_path() +
           " path: use torch::optim::Adam, AdamW or SGD with TrainerOptions().fused(true) (the default), on a "
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

#if AMP_WITH_CUDA
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
                "with AMP_WITH_CUDA=1; train with trainer.step(fn)");
  }
};
using DefaultRecorder = NoCudaRecorder;
#endif

}  // namespace detail

// The captured step of a Trainer (amp::capture). Move-only; the Trainer
// must outlive it. Not thread-safe, as the Trainer. It drives the Trainer
// through its public interface only: step(), stepper(), save_state() and
// load_state(), parameter_device().
template <class TrainerT, class F, class Batch, class Recorder = detail::DefaultRecorder>
class CapturedStep {
  static_assert(std::is_same_v<typename TrainerT::device, CUDA> || !std::is_same_v<Recorder, detail::DefaultRecorder>,
                "amp: capture() records the training step in a CUDA graph, which exists only on amp::CUDA; on amp::CPU "
                "call trainer.step(fn) (eager steps have no per-launch cost to save there)");

 public:
  // Eager warm-up steps before the capture, all undone afterwards.
  static constexpr int kWarmupSteps = 3;

  CapturedStep(TrainerT& trainer, F fn, const Batch& example)
      : trainer_(&trainer),
        fn_(std::move(fn)),
        inputs_(example, trainer.parameter_device()),
        recorder_(trainer.parameter_device()) {
    record();
  }
  CapturedStep(CapturedStep&&) = default;
  CapturedStep& operator=(CapturedStep&&) = default;
  CapturedStep(const CapturedStep&) = delete;
  CapturedStep& operator=(const CapturedStep&) = delete;
  ~CapturedStep() = default;

  // One training step on `batch`: checks it against the captured batch
  // (shape, dtype, device of every tensor; "amp: ..." naming the first that
  // differs), copies it into the graph's inputs and replays. The result's
  // tensors are the graph's outputs: valid until the next replay (clone them
  // to keep them). No host sync.
  StepResult operator()(const Batch& batch) {
    check_replayable();
    inputs_.copy_from(batch);
    const int64_t steps = trainer_->stepper().steps();
    StepResult r = recorder_.replay([&] { return run_step(); }, result_);
    trainer_->stepper().set_steps(steps + 1);  // the replayed step counts as an eager one
    ++replays_;
    return r;
  }

  // Captures again: with the same batch shapes, or for `example`'s. Needed
  // after trainer.load() or another capture() on the trainer, after a change
  // of the optimizer's options (lr included), and for other batch shapes.
  void recapture() { record(); }
  void recapture(const Batch& example) {
    inputs_ = detail::StaticBatch<Batch>(example, trainer_->parameter_device());
    record();
  }

  // Bytes of device memory the graph's private pool holds (the activations
  // and temporaries of one step), measured at capture.
  int64_t pool_bytes() const { return recorder_.pool_bytes(); }
  int64_t replays() const { return replays_; }
  // The tensors the graph reads its batch from.
  const Batch& static_inputs() const { return inputs_.buffers(); }

 private:
  void check_replayable() const {
    TORCH_CHECK(captured_, "amp: this step has no graph (its capture failed); call recapture()");
    TORCH_CHECK(tensors_ == graph_tensors(),
                "amp: the tensors this step was captured with were replaced (by trainer.load(), or by another "
                "capture() on this trainer, which undoes its warm-up from a snapshot); call recapture() before "
                "replaying it");
    const std::string changed = options_.changed(trainer_->stepper().optimizer());
    TORCH_CHECK(changed.empty(), "amp: ", changed,
                " since the step was captured, and a CUDA graph replays the values it was captured with; call "
                "recapture() after changing the optimizer");
  }

  // One step on the static inputs: the Trainer's own step (with a fixed
  // state: gradients zeroed in place, the fused step on the same tensors).
  StepResult run_step() {
    return trainer_->step([&](typename TrainerT::region_type& region) { return fn_(region, inputs_.buffers()); });
  }

  // What the graph reads and writes, by identity: the parameters' storage
  // and the optimizer's state entries, which a load() or another capture
  // replaces (host reads only, no sync).
  std::vector<const void*> graph_tensors() const {
    std::vector<const void*> ids;
    const torch::optim::Optimizer& optimizer = trainer_->stepper().optimizer();
    for (const auto& group : optimizer.param_groups())
      for (const auto& p : group.params()) {
        ids.push_back(p.data_ptr());
        auto it = optimizer.state().find(detail::compat::optim_state_key(p.unsafeGetTensorImpl()));
        ids.push_back(it == optimizer.state().end() ? nullptr : it->second.get());
      }
    return ids;
  }

  // The optimizer's parameters' gradients (those that have one).
  std::vector<at::Tensor> current_grads() const {
    std::vector<at::Tensor> grads = trainer_->stepper().parameters();
    for (at::Tensor& g : grads) g = g.grad();
    return grads;
  }

  void record() {
    captured_ = false;
    const std::string why = detail::capture_blocker(trainer_->stepper());
    TORCH_CHECK(why.empty(), "amp: ", why);
    recorder_.reset();
    keep_.clear();
    // The trainer as it is now: the warm-up's steps are undone from it, and a
    // failed capture leaves the trainer as it was.
    std::stringstream before;
    trainer_->save_state(before);
    const at::Tensor rng = recorder_.rng_state();
    const int64_t steps = trainer_->stepper().steps();
    auto undo = [&] {
      before.clear();
      before.seekg(0);
      trainer_->load_state(before);
      if (rng.defined()) recorder_.set_rng_state(rng);
      trainer_->stepper().set_steps(steps);
      if constexpr (scaler_capabilities<typename TrainerT::scaler_type>::discard_iteration)
        trainer_->stepper().scaler().discard_iteration();
    };
    try {
      recorder_.synchronize();
      recorder_.on_side_stream([&] {
        for (int i = 0; i < kWarmupSteps; ++i) run_step();
      });
      recorder_.synchronize();
      undo();
      trainer_->stepper().make_static();  // state made now, kept fixed: the graph's tensors
      keep_ = current_grads();            // the graph zeroes them in place: kept alive
      options_ = detail::OptimizerOptionsSnapshot(trainer_->stepper().optimizer());
      result_ = recorder_.record([&] { return run_step(); });
      for (at::Tensor& g : current_grads()) keep_.push_back(g);  // the graph's own (its pool)
      trainer_->stepper().set_steps(steps);                      // recording ran no step
      tensors_ = graph_tensors();
      captured_ = true;
    } catch (const std::exception& e) {
      const auto* error = dynamic_cast<const c10::Error*>(&e);
      const std::string what = error != nullptr ? error->what_without_backtrace() : e.what();
      recorder_.reset();
      keep_.clear();
      try {
        recorder_.synchronize();
        undo();
      } catch (...) {
      }
      TORCH_CHECK(false, "amp: capturing the step failed (the trainer is left as it was): ", what,
                  "\nA captured step may not read device values on the host (.item(), printing a tensor, a branch "
                  "on a tensor's value), synchronize, or use CPU tensors in the forward; train such a step eagerly");
    }
  }

  TrainerT* trainer_;
  F fn_;
  detail::StaticBatch<Batch> inputs_;
  Recorder recorder_;
  StepResult result_;
  detail::OptimizerOptionsSnapshot options_;
  std::vector<at::Tensor> keep_;      // tensors the graph writes that nothing else may own
  std::vector<const void*> tensors_;  // graph_tensors() at capture
  int64_t replays_ = 0;
  bool captured_ = false;
};

// The whole training step of `trainer` recorded once in a CUDA graph and
// replayed per batch: fn(region, batch) returns the loss, as for fit();
// `example` is a batch of the shapes to record. (trainer.capture(fn, example) calls this.)
template <class TrainerT, class F, class Batch>
CapturedStep<TrainerT, std::decay_t<F>, Batch> capture(TrainerT& trainer, F&& fn, const Batch& example) {
  return CapturedStep<TrainerT, std::decay_t<F>, Batch>(trainer, std::forward<F>(fn), example);
}

namespace detail {
// Marks amp::capture as defined, for trainer.capture() (amp/train/trainer.h).
template <class TrainerT>
struct StepCapturer<TrainerT, void> {
  template <class F, class Batch>
  static auto make(TrainerT& trainer, F&& fn, const Batch& example) {
    return amp::capture(trainer, std::forward<F>(fn), example);
  }
};
}  // namespace detail

}  // namespace amp
