// amp/amp.h: the umbrella header: every public header of amp.
//
//   #include <amp/amp.h>
//   amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(model, optimizer);
//   trainer.step([&](auto& region) { return torch::mse_loss(model(x), y); });
//
// Prefer the narrow headers in code where compile time matters.
#pragma once

#include "amp/version.h"
// core: tags, policies, the static rules, experiments
#include "amp/core/device.h"
#include "amp/core/dtype.h"
#include "amp/core/experiment.h"
#include "amp/core/policy.h"
#include "amp/core/rules.h"
#include "amp/core/scaler_concept.h"
// optim, scaler
#include "amp/optim/fused.h"
#include "amp/optim/low_bit_adam.h"
#include "amp/optim/quantized_state.h"
#include "amp/optim/state_bytes.h"
#include "amp/optim/supports_amp_scaling.h"
#include "amp/scaler/dynamic_scaler.h"
#include "amp/scaler/no_scaler.h"
#include "amp/scaler/state_dict.h"
#include "amp/scaler/static_scaler.h"
// precision: autocast, TF32, strict casts, linear routing, regions
#include "amp/precision/autocast.h"
#include "amp/precision/linear_routing.h"
#include "amp/precision/region.h"
#include "amp/precision/strict_casts.h"
#include "amp/precision/tf32.h"
// float8: the recipes, the float8 linear, the Float8 policy
#include "amp/float8/block_scaled.h"
#include "amp/float8/delayed.h"
#include "amp/float8/linear.h"
#include "amp/float8/mxfp8.h"
#include "amp/float8/mxfp8_linear.h"
#include "amp/float8/nvfp4.h"
#include "amp/float8/policy.h"
#include "amp/float8/recipe.h"
// train: Stepper, Trainer, Fabric, checkpoints, history
#include "amp/train/activation_checkpoint.h"
#include "amp/train/activation_meter.h"
#include "amp/train/checkpoint.h"
#include "amp/train/history.h"
#include "amp/train/fabric.h"
#include "amp/train/stepper.h"
#include "amp/train/trainer.h"
#include "amp/train/trainer_options.h"
#include "amp/train/user_state.h"
// capture: the step as a CUDA graph
#include "amp/capture/captured_step.h"
