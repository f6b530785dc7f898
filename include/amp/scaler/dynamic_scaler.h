// amp/scaler/dynamic_scaler.h: DynamicScaler (= GradScaler), torch.amp.GradScaler in C++.
//
//   amp::GradScaler scaler;                      // init 2**16, growth 2, backoff 0.5, interval 2000
//   scaler.scale(loss).backward();
//   scaler.step(optimizer);  scaler.update();    // skips the step on inf/NaN, adapts the scale
//
// Mirrors torch/amp/grad_scaler.py method by method, with its error messages:
// lazy fp32 0-dim scale and int32 0-dim growth tracker on the first scaled
// tensor's device; per-optimizer READY -> UNSCALED -> STEPPED states keyed by
// the optimizer's address (Python's id()); gradients grouped by (device,
// dtype); _amp_update_scale_'s rule (backoff on inf/NaN, growth at the
// growth_interval-th consecutive clean step unless the grown scale is not
// finite); state_dict with torch's five keys, so a checkpoint written here
// loads in Python's GradScaler and back.
//
// Kernels and portable paths: scaler/detail/unscale.h and update_scale.h; the
// shared scale/unscale_/step machinery: scaler/loss_scaler.h. Neither
// unscale_() nor update() syncs with the host; step() reads the found-inf flag
// once, as torch does. Extensions (off by default, options.h): min/max scale
// and DeepSpeed-style hysteresis. found_inf() gives the iteration's flag as a
// tensor, so callers can log skipped steps without a sync.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

#include "amp/scaler/state_dict.h"
#include "amp/scaler/detail/update_scale.h"
#include "amp/scaler/loss_scaler.h"
#include "amp/scaler/options.h"
#include "amp/core/scaler_concept.h"

namespace amp {

// torch.amp.GradScaler. See the file comment; the options are in options.h.
class DynamicScaler : public LossScalerBase {
 public:
  static constexpr bool kLossScaling = true;

  // Validates the options when enabled, as torch asserts growth_factor > 1 and
  // backoff_factor < 1 only when enabled; amp also rejects the values that
  // make no sense (see options.h) with an `amp:` message naming the range.
  explicit DynamicScaler(DynamicScalerOptions options = {})
      : LossScalerBase(options.enabled(), options.init_scale()), options_(options) {
    if (enabled_) {
      validate(options_);
    }
    init_hysteresis_tracker_ = options_.hysteresis();
  }

  // The automatic update: backoff if any optimizer found inf/NaN since the
  // last update, growth at the growth_interval-th consecutive clean update.
  // No host sync. Then every optimizer is READY again.
  void update() {
    if (!enabled_) {
      return;
    }
    check_scale_initialized("update");
    const at::Tensor found_inf_combined = consume_found_infs();
    at::Tensor& tracker = growth_tracker();
    detail::update_scale_(scale_, tracker, found_inf_combined, options_.growth_factor(), options_.backoff_factor(),
                          options_.growth_interval(), extensions());
    reset_optimizer_states();
  }

  // Sets the scale (rounded to fp32), as torch's update(new_scale=float). The
  // growth tracker, the min/max bounds and the found-inf flags are not used.
  void update(double new_scale) {
    if (!enabled_) {
      return;
    }
    check_scale_initialized("update");
    scale_.fill_(new_scale);
    reset_optimizer_states();
  }

  // Copies a 1-element fp32 tensor into the scale, as torch's
  // update(new_scale=tensor); later changes to new_scale do not affect it.
  void update(const at::Tensor& new_scale) {
    if (!enabled_) {
      return;
    }
    check_scale_initialized("update");
    const char* reason =
        "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor with "
        "requires_grad=False.";
    TORCH_CHECK(new_scale.defined(), reason);
    TORCH_CHECK(new_scale.device().type() == scale_.device().type(), reason);
    TORCH_CHECK(new_scale.scalar_type() == at::kFloat, reason);
    TORCH_CHECK(new_scale.numel() == 1, reason);
    TORCH_CHECK(!new_scale.requires_grad(), reason);
    // reshape: a [1] tensor into the 0-dim scale (Tensor::copy_ does not drop dims).
    scale_.copy_(new_scale.reshape({}));
    reset_optimizer_states();
  }

  double get_growth_factor() const { return options_.growth_factor(); }
  void set_growth_factor(double new_factor) { options_.growth_factor(new_factor); }
  double get_backoff_factor() const { return options_.backoff_factor(); }
  void set_backoff_factor(double new_factor) { options_.backoff_factor(new_factor); }
  int64_t get_growth_interval() const { return options_.growth_interval(); }
  void set_growth_interval(int64_t new_interval) { options_.growth_interval(new_interval); }
  // amp: torch's _init_scale (the value the lazily created scale starts at; load_state_dict sets it).
  double get_init_scale() const { return init_scale_; }
  void set_init_scale(double init_scale) { init_scale_ = init_scale; }
  // torch's _get_growth_tracker(): consecutive clean updates so far (a host sync); 0 when disabled.
  int64_t get_growth_tracker() const {
    if (!enabled_) {
      return 0;
    }
    return growth_tracker_.defined() ? static_cast<int64_t>(growth_tracker_.item<int32_t>()) : init_growth_tracker_;
  }
  // amp: overflows still absorbed before the next backoff (hysteresis extension; a host sync).
  int64_t get_hysteresis_tracker() const {
    return hysteresis_tracker_.defined() ? static_cast<int64_t>(hysteresis_tracker_.item<int32_t>())
                                         : init_hysteresis_tracker_;
  }
  // The options in effect (setters and load_state_dict included).
  DynamicScalerOptions options() const {
    DynamicScalerOptions current = options_;
    current.init_scale(init_scale_);
    return current;
  }

  // torch's five entries: "scale" (float), "growth_factor" (float),
  // "backoff_factor" (float), "growth_interval" (int), "_growth_tracker" (int).
  // Extensions add theirs only when enabled: "min_scale" when > 0,
  // "max_scale" when finite, "hysteresis" and "_hysteresis_tracker" when
  // hysteresis > 1. Empty when disabled. Reading the scale is a host sync.
  StateDict state_dict() const {
    StateDict state = empty_state_dict();
    if (!enabled_) {
      return state;
    }
    state.insert("scale", get_scale());
    state.insert("growth_factor", options_.growth_factor());
    state.insert("backoff_factor", options_.backoff_factor());
    state.insert("growth_interval", options_.growth_interval());
    state.insert("_growth_tracker", get_growth_tracker());
    if (options_.min_scale() > 0.0) {
      state.insert("min_scale", options_.min_scale());
    }
    if (!std::isinf(options_.max_scale())) {
      state.insert("max_scale", options_.max_scale());
    }
    if (options_.hysteresis() > 1) {
      state.insert("hysteresis", options_.hysteresis());
      state.insert("_hysteresis_tracker", get_hysteresis_tracker());
    }
    return state;
  }

  // As torch: a no-op when disabled; an empty dict is an error; the values are
  // taken as they are (not validated) and fill the scale and tracker if they
  // exist, else become their lazy initial values. Extension keys, when
  // present, override the options; when absent the options stay as
  // constructed and a hysteresis counter restarts full.
  void load_state_dict(const StateDict& state) {
    if (!enabled_) {
      return;
    }
    load_scale(state, "GradScaler");
    options_.growth_factor(detail::state_double(state, "growth_factor"));
    options_.backoff_factor(detail::state_double(state, "backoff_factor"));
    options_.growth_interval(detail::state_int(state, "growth_interval"));
    init_growth_tracker_ = detail::state_int(state, "_growth_tracker");
    if (growth_tracker_.defined()) {
      growth_tracker_.fill_(init_growth_tracker_);
    }
    if (state.contains("min_scale")) {
      options_.min_scale(detail::state_double(state, "min_scale"));
    }
    if (state.contains("max_scale")) {
      options_.max_scale(detail::state_double(state, "max_scale"));
    }
    if (state.contains("hysteresis")) {
      options_.hysteresis(detail::state_int(state, "hysteresis"));
    }
    init_hysteresis_tracker_ =
        state.contains("_hysteresis_tracker") ? detail::state_int(state, "_hysteresis_tracker") : options_.hysteresis();
    if (hysteresis_tracker_.defined()) {
      hysteresis_tracker_.fill_(init_hysteresis_tracker_);
    }
  }
  // A Python torch.save(scaler.state_dict()) file, as torch::pickle_load(bytes).toGenericDict().
  void load_state_dict(const c10::impl::GenericDict& state) { load_state_dict(detail::typed_state_dict(state)); }

 private:
  static void validate(const DynamicScalerOptions& o) {
    TORCH_CHECK(std::isfinite(o.init_scale()) && o.init_scale() > 0.0,
                "amp: DynamicScalerOptions::init_scale must be finite and > 0, got ", o.init_scale());
    TORCH_CHECK(o.growth_factor() > 1.0, "amp: DynamicScalerOptions::growth_factor must be > 1, got ",
                o.growth_factor());
    TORCH_CHECK(o.backoff_factor() > 0.0 && o.backoff_factor() < 1.0,
                "amp: DynamicScalerOptions::backoff_factor must be in (0, 1), got ", o.backoff_factor());
    TORCH_CHECK(o.growth_interval() >= 1, "amp: DynamicScalerOptions::growth_interval must be >= 1, got ",
                o.growth_interval());
    TORCH_CHECK(o.hysteresis() >= 1, "amp: DynamicScalerOptions::hysteresis must be >= 1 (1 = no hysteresis), got ",
                o.hysteresis());
    TORCH_CHECK(o.min_scale() >= 0.0, "amp: DynamicScalerOptions::min_scale must be >= 0 (0 = no bound), got ",
                o.min_scale());
    TORCH_CHECK(o.max_scale() > 0.0, "amp: DynamicScalerOptions::max_scale must be > 0 (+inf = no bound), got ",
                o.max_scale());
    TORCH_CHECK(o.min_scale() <= o.max_scale(), "amp: DynamicScalerOptions::min_scale must be <= max_scale, got ",
                o.min_scale(), " > ", o.max_scale());
  }

  // Lazily created next to the scale, with its value (torch creates both in
  // scale(); nothing reads the tracker before update() or state_dict()).
  at::Tensor& growth_tracker() {
    if (!growth_tracker_.defined()) {
      growth_tracker_ = at::full({}, init_growth_tracker_, scale_.options().dtype(at::kInt));
    }
    return growth_tracker_;
  }

  detail::ScaleUpdateExtensions extensions() {
    detail::ScaleUpdateExtensions ext;
    ext.min_scale = options_.min_scale();
    ext.max_scale = options_.max_scale();
    ext.hysteresis = options_.hysteresis();
    if (ext.hysteresis > 1) {
      if (!hysteresis_tracker_.defined()) {
        hysteresis_tracker_ = at::full({}, init_hysteresis_tracker_, scale_.options().dtype(at::kInt));
      }
      ext.hysteresis_tracker = &hysteresis_tracker_;
    }
    return ext;
  }

  DynamicScalerOptions options_;
  int64_t init_growth_tracker_ = 0;  // torch's _init_growth_tracker
  at::Tensor growth_tracker_;        // int32, 0-dim, on the scale's device
  int64_t init_hysteresis_tracker_ = 1;
  at::Tensor hysteresis_tracker_;  // int32, 0-dim; only with hysteresis > 1
};

using GradScaler = DynamicScaler;

static_assert(detail::builtin_scaler_matches_v<DynamicScaler>,
              "amp: DynamicScaler must match scaler_concept.h's builtin_scaler");

}  // namespace amp
