// amp/train/trainer_options.h: TrainerOptions, the Trainer's options: its
// steps' (StepOptions) and regions' (RegionOptions), progress output, and the
// random generators in checkpoints.
//
//   auto options = amp::TrainerOptions().step(amp::StepOptions().max_grad_norm(1.0)).progress(false);
//   amp::Trainer<P, amp::CPU> trainer(model, optimizer, options);
#pragma once

#include <torch/arg.h>

#include <cstdint>

#include "amp/precision/region.h"
#include "amp/train/stepper.h"

namespace amp {

struct TrainerOptions {
  // Each optimizer step: clipping, accumulation, the fused path.
  TORCH_ARG(StepOptions, step) = {};
  // Each region the Trainer makes (step, evaluate, capture): strict casts,
  // linear routing, the precision map.
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
};

}  // namespace amp
