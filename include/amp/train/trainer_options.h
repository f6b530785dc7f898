// amp/train/trainer_options.h: TrainerOptions, the Trainer's options: its
// steps' (StepOptions) and regions' (RegionOptions), progress output, and the
// random generators in checkpoints.
//
//   amp::Trainer<P, amp::CPU> trainer(model, optimizer, amp::TrainerOptions().max_grad_norm(1.0).progress(false));
#pragma once

#include <torch/arg.h>

#include <cstdint>

#include "amp/precision/linear_routing.h"
#include "amp/precision/region.h"
#include "amp/precision/strict_casts.h"
#include "amp/train/stepper.h"

namespace amp {

struct TrainerOptions {
  // Each optimizer step: clipping, accumulation, the fused path (also spelled below).
  TORCH_ARG(StepOptions, step) = {};
  // Each region the Trainer makes (step, evaluate, capture): strict casts and
  // linear routing (also spelled below).
  TORCH_ARG(RegionOptions, region) = {};
  // A progress bar (a TTY) or periodic lines (otherwise) during fit(), and
  // in a loop that calls step() itself: every progress_every optimizer steps
  // (one host read per line; fit() uses FitOptions::log_every).
  TORCH_ARG(bool, progress) = true;
  TORCH_ARG(int64_t, progress_every) = 50;
  // Checkpoints carry the random generators' states (the default CPU
  // generator and each CUDA device's) and load() restores them, so a resumed
  // run draws the same dropout masks and random batches. false: neither.
  TORCH_ARG(bool, rng_state) = true;

  // The step's and the region's options, spelled on TrainerOptions: .max_grad_norm(1.0).
 public:  // (TORCH_ARG leaves the section private)
  TrainerOptions& max_grad_norm(double value) { return step_.max_grad_norm(value), *this; }
  double max_grad_norm() const { return step_.max_grad_norm(); }
  TrainerOptions& norm_type(double value) { return step_.norm_type(value), *this; }
  double norm_type() const { return step_.norm_type(); }
  TrainerOptions& accumulation_steps(int64_t value) { return step_.accumulation_steps(value), *this; }
  int64_t accumulation_steps() const { return step_.accumulation_steps(); }
  TrainerOptions& fused(bool value) { return step_.fused(value), *this; }
  bool fused() const { return step_.fused(); }
  TrainerOptions& strict_casts(StrictCasts value) { return region_.strict_casts(value), *this; }
  StrictCasts strict_casts() const { return region_.strict_casts(); }
  TrainerOptions& linear_routing(LinearRouting value) { return region_.linear_routing(value), *this; }
  LinearRouting linear_routing() const { return region_.linear_routing(); }
};

}  // namespace amp
