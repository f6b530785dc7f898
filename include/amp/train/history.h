// amp/train/history.h: fit()'s options, its per-step record, and the loaders it takes.
//
//   amp::History h = trainer.fit(loader, fn, amp::FitOptions().max_epochs(3).log_every(100));
//   for (const amp::StepMetrics& m : h.steps) std::cout << m.step << " " << m.loss << "\n";
//
// fit() keeps each step's loss, scale and skip flag on the device and reads
// them log_every steps at a time (PendingMetrics): one host sync per
// log_every steps, and still every step in the History.
#pragma once

#include <ATen/ATen.h>
#include <torch/arg.h>

#include <c10/util/TypeTraits.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "amp/train/detail/progress.h"
#include "amp/train/stepper.h"

namespace amp {

struct FitOptions {
  // Epochs in total, as Lightning's max_epochs: fit() continues from the
  // trainer's current epoch (after a load(), the checkpoint's) until this many
  // are done; a fit() with none left says so (a warning) and returns.
  TORCH_ARG(int64_t, max_epochs) = 1;
  // Stop after this many optimizer steps in total (-1: no limit).
  TORCH_ARG(int64_t, max_steps) = -1;
  // Save a checkpoint to checkpoint_path every N optimizer steps (0: never).
  TORCH_ARG(int64_t, checkpoint_every) = 0;
  TORCH_ARG(std::string, checkpoint_path) = "";
  // Plain progress lines every N steps when stderr is not a terminal.
  TORCH_ARG(int64_t, log_every) = 50;
};

// Per-optimizer-step metrics gathered by fit().
struct StepMetrics {
  int64_t step = 0;  // optimizer steps done after this one
  int64_t epoch = 0;
  double loss = 0.0;   // mean loss of the step's micro-batches
  double scale = 1.0;  // the loss scale after the scaler's update
  bool skipped = false;
  double seconds = 0.0;  // wall time of the step (forward, backward, step)
};

struct History {
  std::vector<StepMetrics> steps;
  int64_t skipped() const {
    int64_t n = 0;
    for (const auto& s : steps) n += s.skipped ? 1 : 0;
    return n;
  }
};

namespace detail {

// fit()'s metrics while they are still on the device: read in one batch.
class PendingMetrics {
 public:
  void add(const StepMetrics& m, const StepResult& r, const at::Tensor& scale) {
    metrics_.push_back(m);
    // Copies: the scale is updated in place by the next step.
    losses_.push_back(r.loss.detach().to(at::kDouble).reshape({}));
    scales_.push_back(scale.to(at::kDouble).reshape({}));
    found_.push_back(r.found_inf.defined() ? r.found_inf.to(at::kDouble).reshape({}) : at::zeros({}, at::kDouble));
  }
  size_t size() const { return metrics_.size(); }
  // One device-to-host copy per device for all pending steps.
  void flush(History& history, Progress& bar) {
    if (metrics_.empty()) return;
    const at::Tensor loss = host(losses_), scale = host(scales_), found = host(found_);
    for (size_t i = 0; i < metrics_.size(); ++i) {
      StepMetrics m = metrics_[i];
      m.loss = loss.data_ptr<double>()[i];
      m.scale = scale.data_ptr<double>()[i];
      m.skipped = found.data_ptr<double>()[i] != 0.0;
      history.steps.push_back(m);
      bar.update(m.step, m.loss, m.scale, m.skipped);
    }
    metrics_.clear();
    losses_.clear();
    scales_.clear();
    found_.clear();
  }

 private:
  // Stacked on their device first, so one copy, not one per step.
  static at::Tensor host(const std::vector<at::Tensor>& values) {
    bool same_device = true;
    for (const auto& v : values) same_device = same_device && v.device() == values.front().device();
    if (same_device) return at::stack(values).cpu().contiguous();
    std::vector<at::Tensor> on_cpu;
    for (const auto& v : values) on_cpu.push_back(v.cpu());
    return at::stack(on_cpu).contiguous();
  }

  std::vector<StepMetrics> metrics_;
  std::vector<at::Tensor> losses_, scales_, found_;
};

// Range-like: a DataLoader (unique_ptr) or any range of batches.
template <class L>
decltype(auto) as_range(L& loader) {
  if constexpr (std::is_pointer_v<std::decay_t<L>> ||
                c10::guts::is_instantiation_of<std::unique_ptr, std::decay_t<L>>::value ||
                c10::guts::is_instantiation_of<std::shared_ptr, std::decay_t<L>>::value) {
    return *loader;
  } else {
    return (loader);
  }
}

}  // namespace detail
}  // namespace amp
