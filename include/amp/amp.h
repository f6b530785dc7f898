// amp/amp.h: the umbrella header: every public header of amp.
//
//   #include <amp/amp.h>
//   amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(model, optimizer);
//   trainer.step([&](auto& region) { return torch::mse_loss(model(x), y); });
//
// Prefer the narrow headers in code where compile time matters.
#pragma once

#include "amp/version.h"
#include "amp/dtype.h"
#include "amp/device.h"
#include "amp/scaler/scaler_traits.h"
#include "amp/scaler/no_scaler.h"
#include "amp/scaler/static_scaler.h"
#include "amp/scaler/dynamic_scaler.h"
#include "amp/policy.h"
#include "amp/traits.h"
#include "amp/experiment.h"
#include "amp/autocast.h"
#include "amp/tf32.h"
#include "amp/strict_casts.h"
#include "amp/linear_routing.h"
#include "amp/region.h"
#include "amp/optim/fused.h"
#include "amp/step.h"
#include "amp/checkpoint.h"
#include "amp/history.h"
#include "amp/capture.h"
#include "amp/trainer.h"
#include "amp/precision.h"
