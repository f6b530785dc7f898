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
#include "amp/capture/detail/recorder.h"
#include "amp/capture/detail/static_batch.h"
#include "amp/core/device.h"
#include "amp/train/stepper.h"
#include "amp/train/trainer.h"

namespace amp {

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
