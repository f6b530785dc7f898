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
// Kernels: where ATen has them (CUDA; CPU from LibTorch 2.3) unscale_ and
// update() call _amp_foreach_non_finite_check_and_unscale_ and
// _amp_update_scale_. Elsewhere (Debian's LibTorch 1.13 on CPU) a portable path
// built from ordinary ATen ops gives bitwise the same gradients, scale and
// tracker. Neither path syncs with the host in unscale_() or update(): the
// found-inf flag stays a tensor. step() reads it once (found_inf.item(), one
// sync, as torch does) to decide whether to call optimizer.step().
//
// Extensions (off by default, see options.h): min_scale/max_scale bounds and
// DeepSpeed-style hysteresis; with any of them on, update() takes the portable
// path on every device. found_inf() returns the iteration's combined flag as a
// tensor so that callers can log skipped steps without a sync.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Optional.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "amp/detail/compat.h"
#include "amp/scaler/options.h"
#include "amp/scaler/scaler_traits.h"

namespace amp {
namespace detail {

// --- portable kernels --------------------------------------------------------

// The portable unscale reads each gradient twice (check, then multiply), as
// 1.13 has no fused op. To keep that near one pass over memory, a big
// contiguous gradient is processed in chunks of this many bytes: the check
// (aminmax) brings a chunk into L2 and the multiply finds it there.
inline constexpr int64_t kUnscaleChunkBytes = int64_t{512} * 1024;
// Gradients up to this size are checked in batches (one cat, one aminmax)
// instead of one aminmax each: for them the per-op overhead (~1 us), not the
// bytes, is the cost. See bench/scaler_bench.cc for the measurements.
inline constexpr int64_t kUnscaleSmallBytes = int64_t{32} * 1024;

// Appends t's minimum and maximum. Both are NaN when t holds a NaN (aminmax
// propagates NaN), and one of them is +-inf when t holds an infinity, so they
// are all finite exactly when every element of t is. Unlike a sum, this cannot
// overflow into a false positive, and it reads t once without a temporary.
inline void append_extrema(const at::Tensor& t, std::vector<at::Tensor>& extrema) {
  auto min_max = at::aminmax(t);
  extrema.push_back(std::move(std::get<0>(min_max)));
  extrema.push_back(std::move(std::get<1>(min_max)));
}

// The state of one portable unscale: extrema to reduce at the end (per dtype:
// stack needs one dtype) and a batch of small gradients not yet checked.
class PortableUnscale {
 public:
  explicit PortableUnscale(const at::Tensor& inv_scale) : inv_scale_(inv_scale) {}

  // Checks t (values before the multiply, as the kernels do) and multiplies it
  // in place, now or when its batch is flushed.
  void add(const at::Tensor& t) {
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (bytes <= kUnscaleSmallBytes) {
      if (!pending_.empty() && (pending_.front().scalar_type() != t.scalar_type() ||
                                pending_bytes_ + bytes > kUnscaleChunkBytes)) {
        flush();
      }
      pending_.push_back(t);
      pending_bytes_ += bytes;
      return;
    }
    const int64_t chunk = kUnscaleChunkBytes / static_cast<int64_t>(t.element_size());
    if (!t.is_contiguous() || t.numel() <= 2 * chunk) {
      append_extrema(t, group_of(t.scalar_type()));
      t.mul_(inv_scale_);
      return;
    }
    const at::Tensor flat = t.view({-1});
    for (int64_t begin = 0; begin < flat.numel(); begin += chunk) {
      const at::Tensor part = flat.narrow(0, begin, std::min(chunk, flat.numel() - begin));
      append_extrema(part, group_of(t.scalar_type()));
      part.mul_(inv_scale_);
    }
  }

  // Checks and multiplies the pending small gradients.
  void flush() {
    if (pending_.empty()) {
      return;
    }
    std::vector<at::Tensor>& extrema = group_of(pending_.front().scalar_type());
    if (pending_.size() == 1) {
      append_extrema(pending_.front(), extrema);
    } else {
      std::vector<at::Tensor> flat;
      flat.reserve(pending_.size());
      for (const at::Tensor& t : pending_) {
        // cat needs one rank; making a view costs as much as the multiply
        // of a small tensor, so 1-D ones (biases, norms) are taken as they are.
        flat.push_back(t.dim() == 1 ? t : (t.is_contiguous() ? t.view({-1}) : t.reshape({-1})));
      }
      append_extrema(at::cat(flat), extrema);
    }
    for (const at::Tensor& t : pending_) {
      t.mul_(inv_scale_);
    }
    pending_.clear();
    pending_bytes_ = 0;
  }

  // Flushes, then sets found_inf to 1 if any extremum is not finite.
  void finish(at::Tensor& found_inf) {
    flush();
    for (const auto& group : extrema_) {
      const at::Tensor all_finite = at::isfinite(at::stack(group.second)).all();
      found_inf.masked_fill_(all_finite.logical_not(), 1.0);
    }
  }

 private:
  std::vector<at::Tensor>& group_of(at::ScalarType dtype) {
    for (auto& group : extrema_) {
      if (group.first == dtype) {
        return group.second;
      }
    }
    extrema_.emplace_back(dtype, std::vector<at::Tensor>{});
    return extrema_.back().second;
  }

  const at::Tensor& inv_scale_;
  std::vector<std::pair<at::ScalarType, std::vector<at::Tensor>>> extrema_;
  std::vector<at::Tensor> pending_;
  int64_t pending_bytes_ = 0;
};

// The CPU form of the kernel for one small contiguous gradient, over its
// memory. For small gradients the per-call cost of ATen ops, not the bytes, is
// what an unscale pays (1000 gradients of 1000 floats: 0.85 ms as cat +
// aminmax + mul_, 0.55 ms here, 0.47 ms for a plain copy of the same bytes;
// bench/scaler_bench.cc). Larger ones stay on the ATen path, whose kernels are
// vectorized and multi-threaded where this scalar loop is not.
// Element for element what LibTorch 2.3's CPU kernel (and the CUDA one)
// computes: val in opmath (float; double for fp64), found if !isfinite(val),
// result static_cast<scalar_t>(inv == 1.f ? val : val * inv). Returns found.
template <class T>
bool cpu_check_and_unscale(T* data, int64_t n, float inv) {
  using opmath = std::conditional_t<std::is_same_v<T, double>, double, float>;
  bool found = false;
  if (inv == 1.f && std::is_same_v<T, opmath>) {
    // The kernel writes val back unchanged: only check. (For fp16/bf16 it
    // writes static_cast<T>(float(val)), which can canonicalize a NaN.)
    for (int64_t i = 0; i < n; ++i) found |= !std::isfinite(static_cast<opmath>(data[i]));
    return found;
  }
  const opmath s = static_cast<opmath>(inv);
  const bool identity = inv == 1.f;
  for (int64_t i = 0; i < n; ++i) {
    const opmath v = static_cast<opmath>(data[i]);
    found |= !std::isfinite(v);
    data[i] = static_cast<T>(identity ? v : v * s);
  }
  return found;
}

// Runs cpu_check_and_unscale on `grad` if it is a small contiguous CPU tensor
// of a dtype the kernels take; false if it left `grad` to the ATen-op path.
inline bool try_cpu_check_and_unscale(const at::Tensor& grad, float inv, bool& found) {
  if (!grad.device().is_cpu() || !grad.is_contiguous() ||
      grad.numel() * static_cast<int64_t>(grad.element_size()) > kUnscaleSmallBytes) {
    return false;
  }
  const int64_t n = grad.numel();
  switch (grad.scalar_type()) {
    case at::kFloat:
      found |= cpu_check_and_unscale(grad.data_ptr<float>(), n, inv);
      return true;
    case at::kDouble:
      found |= cpu_check_and_unscale(grad.data_ptr<double>(), n, inv);
      return true;
    case at::kBFloat16:
      found |= cpu_check_and_unscale(grad.data_ptr<at::BFloat16>(), n, inv);
      return true;
    case at::kHalf:
      found |= cpu_check_and_unscale(grad.data_ptr<at::Half>(), n, inv);
      return true;
    default:
      return false;
  }
}

// The portable _amp_foreach_non_finite_check_and_unscale_: multiplies every
// gradient in place by inv_scale (a 0-dim fp32 tensor) and sets found_inf (a
// 0-dim fp32 tensor, pre-zeroed by the caller) to 1 if any element was inf or
// NaN before the multiply. No host sync.
//
// Bitwise equal to the CPU and CUDA kernels, which compute
// `inv_scale == 1.f ? val : val * inv_scale` in float (opmath) for fp32,
// fp16 and bf16 and in double for fp64, and round back to the gradient's dtype:
// - fp32: Tensor::mul_ with a 0-dim fp32 tensor is the same IEEE product;
//   x * 1.f == x bit for bit except that a signalling NaN comes out quiet.
// - fp16/bf16: mul_ would round inv_scale to the gradient's dtype first, so the
//   product is taken in fp32 and copied back (round to nearest even, like
//   static_cast<scalar_t>(float)).
// - fp64: the fp32 inv_scale widens exactly, as in the kernel.
// A finite value whose product overflows (inv_scale > 1) does not count as
// found, as in the kernels: the check reads the values before the multiply.
inline void portable_non_finite_check_and_unscale_(at::TensorList scaled_grads, at::Tensor& found_inf,
                                                   const at::Tensor& inv_scale) {
  if (scaled_grads.empty()) {
    return;
  }
  TORCH_CHECK(inv_scale.numel() == 1, "inv_scale must be a 1-element tensor.");
  TORCH_CHECK(found_inf.numel() == 1, "found_inf must be a 1-element tensor.");
  TORCH_CHECK(inv_scale.scalar_type() == at::kFloat, "inv_scale must be a float tensor.");
  TORCH_CHECK(found_inf.scalar_type() == at::kFloat, "found_inf must be a float tensor.");
  // Past the autograd kernels: for a small gradient the VariableType wrapper of
  // mul_ costs more than the multiply (1000 gradients of 1000 floats: 1.0 ms of
  // mul_ calls under NoGradGuard, 0.38 ms here, measured on 1.13). Unlike
  // AutoDispatchBelowADInplaceOrView, InferenceMode still bumps the version
  // counters of the (normal) gradients it writes; the temporaries made here
  // (extrema, fp32 copies) are inference tensors that never leave this function.
  c10::InferenceMode inference_mode;
  PortableUnscale unscale(inv_scale);
  // On the CPU, inv_scale and found_inf are host memory: reading and writing
  // them directly is no device sync.
  const bool on_cpu = inv_scale.device().is_cpu() && found_inf.device().is_cpu();
  const float inv = on_cpu ? inv_scale.item<float>() : 0.f;
  bool found = false;
  for (const at::Tensor& grad : scaled_grads) {
    TORCH_CHECK(grad.layout() == at::kStrided, "one of scaled_grads was not a strided tensor.");
    if (grad.numel() == 0) {
      continue;
    }
    if (on_cpu && try_cpu_check_and_unscale(grad, inv, found)) {
      continue;
    }
    if (grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16) {
      at::Tensor wide = grad.to(at::kFloat);
      unscale.add(wide);
      unscale.flush();  // wide must be multiplied before it is copied back
      grad.copy_(wide);
    } else {
      unscale.add(grad);
    }
  }
  unscale.finish(found_inf);
  if (found) found_inf.fill_(1.0);
}

// amp's extensions of the scale update; the defaults leave torch's rule alone.
struct ScaleUpdateExtensions {
  double min_scale = 0.0;
  double max_scale = std::numeric_limits<double>::infinity();
  int64_t hysteresis = 1;
  at::Tensor* hysteresis_tracker = nullptr;  // int32 0-dim; required when hysteresis > 1

  bool any() const { return min_scale > 0.0 || !std::isinf(max_scale) || hysteresis > 1; }
};

// The portable _amp_update_scale_ (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp,
// cuda/AmpKernels.cu), as tensor ops without a host sync:
//   if (found_inf)  scale = float(double(scale) * backoff), tracker = 0
//   else if (tracker + 1 == growth_interval)
//                   g = float(double(scale) * growth); if (isfinite(g)) scale = g; tracker = 0
//   else            tracker += 1
// The products are taken in double and rounded once to float, as the kernels'
// `float * double` is, so the trajectory is bitwise the same. `found_inf`
// counts when nonzero, NaN included, as the kernels' `if (*found_inf)`.
inline void portable_update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, const at::Tensor& found_inf,
                                   double growth_factor, double backoff_factor, int64_t growth_interval,
                                   const ScaleUpdateExtensions& ext = {}) {
  TORCH_CHECK(growth_tracker.numel() == 1, "growth_tracker must be a 1-element tensor.");
  TORCH_CHECK(scale.numel() == 1, "current_scale must be a 1-element tensor.");
  TORCH_CHECK(found_inf.numel() == 1, "found_inf must be a 1-element tensor.");
  TORCH_CHECK(growth_tracker.scalar_type() == at::kInt, "growth_tracker must be an int tensor.");
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "current_scale must be a float tensor.");
  TORCH_CHECK(found_inf.scalar_type() == at::kFloat, "found_inf must be a float tensor.");

  const at::Tensor found = found_inf.ne(0);
  const at::Tensor wide = scale.to(at::kDouble);
  const at::Tensor backed_off = wide.mul(backoff_factor).to(at::kFloat);
  const at::Tensor grown = wide.mul(growth_factor).to(at::kFloat);
  const at::Tensor successful = growth_tracker.add(1);
  // Compared in int64, as the kernels compare int with int64_t growth_interval.
  const at::Tensor at_interval = successful.to(at::kLong).eq(growth_interval);
  const at::Tensor grow = at_interval.logical_and(at::isfinite(grown)).logical_and(found.logical_not());

  at::Tensor back_off = found;
  if (ext.hysteresis > 1) {
    TORCH_CHECK(ext.hysteresis_tracker != nullptr && ext.hysteresis_tracker->defined(),
                "amp: internal error: hysteresis > 1 without a hysteresis tracker");
    at::Tensor& remaining = *ext.hysteresis_tracker;
    // DeepSpeed (consecutive_hysteresis=True): back off only when the counter
    // is down to 1; an absorbed overflow decrements it (never below 1); a
    // clean step refills it.
    back_off = found.logical_and(remaining.le(1));
    const at::Tensor next_remaining =
        at::where(found, remaining.sub(1).clamp_min(1), at::full_like(remaining, ext.hysteresis));
    remaining.copy_(next_remaining);
  }

  at::Tensor new_scale = at::where(back_off, backed_off, at::where(grow, grown, scale));
  if (ext.min_scale > 0.0 || !std::isinf(ext.max_scale)) {
    const c10::optional<at::Scalar> lo = ext.min_scale > 0.0 ? c10::optional<at::Scalar>(ext.min_scale) : c10::nullopt;
    const c10::optional<at::Scalar> hi =
        std::isinf(ext.max_scale) ? c10::nullopt : c10::optional<at::Scalar>(ext.max_scale);
    new_scale = new_scale.clamp(lo, hi);
  }
  const at::Tensor new_tracker =
      at::where(found.logical_or(at_interval), at::zeros_like(growth_tracker), successful);
  scale.copy_(new_scale);
  growth_tracker.copy_(new_tracker);
}

// Unscales with the fused kernel where the device has one, else portably.
inline void non_finite_check_and_unscale_(const std::vector<at::Tensor>& scaled_grads, at::Tensor& found_inf,
                                          const at::Tensor& inv_scale) {
  if (scaled_grads.empty()) {
    return;
  }
  if (compat::has_amp_kernels(scaled_grads.front().device().type())) {
    at::_amp_foreach_non_finite_check_and_unscale_(scaled_grads, found_inf, inv_scale);
  } else {
    portable_non_finite_check_and_unscale_(scaled_grads, found_inf, inv_scale);
  }
}

// --- what DynamicScaler and StaticScaler share --------------------------------

// torch.amp.GradScaler's per-optimizer stages (OptState).
enum class OptState { kReady, kUnscaled, kStepped };

struct PerOptimizerState {
  OptState stage = OptState::kReady;
  // One found-inf flag per device that held gradients, in first-seen order.
  std::vector<std::pair<c10::Device, at::Tensor>> found_inf_per_device;
};

// Reads a number from a scaler state dict; Python writes floats and ints.
inline double state_double(const StateDict& state, const char* key) {
  TORCH_CHECK(state.contains(key), "amp: the scaler state dict has no key '", key, "'");
  const c10::IValue value = state.at(key);
  if (value.isInt()) {
    return static_cast<double>(value.toInt());
  }
  TORCH_CHECK(value.isDouble(), "amp: the scaler state dict's '", key, "' must be a float, got ", value.tagKind());
  return value.toDouble();
}

inline int64_t state_int(const StateDict& state, const char* key) {
  TORCH_CHECK(state.contains(key), "amp: the scaler state dict has no key '", key, "'");
  const c10::IValue value = state.at(key);
  TORCH_CHECK(value.isInt(), "amp: the scaler state dict's '", key, "' must be an int, got ", value.tagKind());
  return value.toInt();
}

inline StateDict empty_state_dict() {
  return c10::impl::toTypedDict<std::string, c10::IValue>(
      c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
}

// scale / unscale_ / step and their bookkeeping, exactly as torch.amp.GradScaler.
// The scale-update rule is the derived class's.
class LossScalerBase {
 public:
  static constexpr bool kLossScaling = true;

  LossScalerBase(const LossScalerBase&) = delete;
  LossScalerBase& operator=(const LossScalerBase&) = delete;
  LossScalerBase(LossScalerBase&&) = default;
  LossScalerBase& operator=(LossScalerBase&&) = default;
  ~LossScalerBase() = default;

  // Multiplies by the scale. The first call creates the scale (fp32, 0-dim) on
  // the tensor's device. Identity when disabled.
  at::Tensor scale(const at::Tensor& outputs) {
    if (!enabled_) {
      return outputs;
    }
    if (!scale_.defined()) {
      lazy_init_scale(outputs.device());
    }
    return outputs * scale_.to(outputs.device(), /*non_blocking=*/true);
  }

  // As torch for an iterable: the scale is created on the first tensor's
  // device and copied once per other device.
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs) {
    if (!enabled_ || outputs.empty()) {
      return outputs;
    }
    if (!scale_.defined()) {
      lazy_init_scale(outputs.front().device());
    }
    std::vector<std::pair<c10::Device, at::Tensor>> per_device;
    std::vector<at::Tensor> scaled;
    scaled.reserve(outputs.size());
    for (const at::Tensor& output : outputs) {
      scaled.push_back(output * replica(per_device, scale_, output.device()));
    }
    return scaled;
  }

  // Divides the optimizer's gradients by the scale in place and records
  // whether any was inf/NaN, without a host sync. At most once per optimizer
  // between update()s, and not after step() (torch's RuntimeErrors).
  void unscale_(torch::optim::Optimizer& optimizer) {
    if (!enabled_) {
      return;
    }
    check_scale_initialized("unscale_");
    PerOptimizerState& state = states_[&optimizer];
    TORCH_CHECK(state.stage != OptState::kUnscaled,
                "unscale_() has already been called on this optimizer since the last update().");
    TORCH_CHECK(state.stage != OptState::kStepped, "unscale_() is being called after step().");
    // As torch: "FP32 division can be imprecise for certain compile options, so
    // we carry out the reciprocal in FP64."
    const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
    state.found_inf_per_device = unscale_grads(optimizer, inv_scale);
    state.stage = OptState::kUnscaled;
  }

  // Unscales (unless unscale_ was called) and calls optimizer.step() unless a
  // gradient was inf/NaN. Returns what optimizer.step() returned, or an
  // undefined tensor when the step was skipped. Reads the found-inf flags on
  // the host: the one sync of an iteration, as in torch.
  at::Tensor step(torch::optim::Optimizer& optimizer) {
    if (!enabled_) {
      return optimizer.step();
    }
    check_scale_initialized("step");
    PerOptimizerState& state = states_[&optimizer];  // std::map: stays valid across unscale_
    TORCH_CHECK(state.stage != OptState::kStepped, "step() has already been called since the last update().");
    if (state.stage == OptState::kReady) {
      unscale_(optimizer);
    }
    TORCH_CHECK(!state.found_inf_per_device.empty(), "No inf checks were recorded for this optimizer.");
    // Python's any(v.item() for v in ...): NaN is truthy, as != 0 is here.
    bool found_inf = false;
    for (const auto& device_and_flag : state.found_inf_per_device) {
      if (device_and_flag.second.item<float>() != 0.0f) {
        found_inf = true;
        break;
      }
    }
    at::Tensor result;
    if (!found_inf) {
      result = optimizer.step();
    }
    state.stage = OptState::kStepped;
    return result;
  }

  // The current scale (a host sync), init_scale before the first scale(), 1.0 when disabled.
  double get_scale() const {
    if (!enabled_) {
      return 1.0;
    }
    return scale_.defined() ? static_cast<double>(scale_.item<float>()) : init_scale_;
  }

  bool is_enabled() const { return enabled_; }

  // amp extension: the iteration's combined found-inf flag, a 0-dim fp32
  // tensor on the scale's device (nonzero: some optimizer saw inf/NaN), read
  // without a sync. Between unscale_/step and update() it sums the flags
  // recorded so far; after update() it is the flag that update() consumed,
  // until the next unscale_. Undefined before the first unscale_ and when
  // disabled.
  at::Tensor found_inf() const {
    if (!enabled_) {
      return at::Tensor();
    }
    std::vector<at::Tensor> flags = recorded_found_infs();
    return flags.empty() ? last_found_inf_ : sum(flags);
  }

 protected:
  LossScalerBase(bool enabled, double init_scale) : enabled_(enabled), init_scale_(init_scale) {}

  // torch's _check_scale_growth_tracker message.
  void check_scale_initialized(const char* funcname) const {
    TORCH_CHECK(scale_.defined(), "Attempted ", funcname,
                " but _scale is None.  This may indicate your script did not use scaler.scale(loss or outputs) "
                "earlier in the iteration.");
  }

  // Every optimizer's per-device flags, moved to the scale's device.
  std::vector<at::Tensor> recorded_found_infs() const {
    std::vector<at::Tensor> flags;
    for (const auto& optimizer_and_state : states_) {
      for (const auto& device_and_flag : optimizer_and_state.second.found_inf_per_device) {
        flags.push_back(device_and_flag.second.to(scale_.device(), /*non_blocking=*/true));
      }
    }
    return flags;
  }

  static at::Tensor sum(const std::vector<at::Tensor>& flags) {
    at::Tensor total = flags.front();
    for (size_t i = 1; i < flags.size(); ++i) {
      total = total + flags[i];
    }
    return total;
  }

  // update()'s common part: the combined flag ("No inf checks were recorded
  // prior to update." when there is none), remembered for found_inf().
  at::Tensor consume_found_infs() {
    std::vector<at::Tensor> flags = recorded_found_infs();
    TORCH_CHECK(!flags.empty(), "No inf checks were recorded prior to update.");
    last_found_inf_ = sum(flags);
    return last_found_inf_;
  }

  // "To prepare for next iteration, clear the data collected from optimizers this iteration."
  void reset_optimizer_states() { states_.clear(); }

  // load_state_dict's common part (call it only when enabled): torch's error
  // for an empty dict, with the scaler's class name, then the "scale" entry,
  // which fills the scale if it exists, else becomes its lazy initial value.
  void load_scale(const StateDict& state, const char* class_name) {
    TORCH_CHECK(state.size() != 0, "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of ", class_name, ".");
    init_scale_ = state_double(state, "scale");
    if (scale_.defined()) {
      scale_.fill_(init_scale_);
    }
  }

  bool enabled_;
  double init_scale_;  // torch's _init_scale: the lazy scale's value, set by load_state_dict
  at::Tensor scale_;   // fp32, 0-dim; undefined until the first scale()

 private:
  void lazy_init_scale(const c10::Device& device) {
    scale_ = at::full({}, init_scale_, at::TensorOptions().dtype(at::kFloat).device(device));
  }

  // torch's _MultiDeviceReplicator: one copy of `master` per device, made once.
  static const at::Tensor& replica(std::vector<std::pair<c10::Device, at::Tensor>>& cache, const at::Tensor& master,
                                   const c10::Device& device) {
    for (const auto& entry : cache) {
      if (entry.first == device) {
        return entry.second;
      }
    }
    cache.emplace_back(device, master.to(device, /*non_blocking=*/true));
    return cache.back().second;
  }

  // torch's _unscale_grads_ with allow_fp16=False: grads of all param groups,
  // split by device and dtype, each group unscaled with one call.
  std::vector<std::pair<c10::Device, at::Tensor>> unscale_grads(torch::optim::Optimizer& optimizer,
                                                                const at::Tensor& inv_scale) {
    using DtypeGroups = std::vector<std::pair<at::ScalarType, std::vector<at::Tensor>>>;
    std::vector<std::pair<c10::Device, DtypeGroups>> per_device_and_dtype;
    at::NoGradGuard no_grad;
    for (auto& group : optimizer.param_groups()) {
      for (auto& param : group.params()) {
        const at::Tensor& grad = param.grad();
        if (!grad.defined()) {
          continue;
        }
        TORCH_CHECK_VALUE(grad.scalar_type() != at::kHalf, "Attempting to unscale FP16 gradients.");
        // Sparse (COO) gradients: their values are unscaled in place. torch
        // coalesces only fp16 sparse grads, which are rejected just above.
        at::Tensor to_unscale = grad.is_sparse() ? grad._values() : grad;
        DtypeGroups* dtypes = nullptr;
        for (auto& entry : per_device_and_dtype) {
          if (entry.first == to_unscale.device()) {
            dtypes = &entry.second;
          }
        }
        if (dtypes == nullptr) {
          per_device_and_dtype.emplace_back(to_unscale.device(), DtypeGroups{});
          dtypes = &per_device_and_dtype.back().second;
        }
        std::vector<at::Tensor>* grads = nullptr;
        for (auto& entry : *dtypes) {
          if (entry.first == to_unscale.scalar_type()) {
            grads = &entry.second;
          }
        }
        if (grads == nullptr) {
          dtypes->emplace_back(to_unscale.scalar_type(), std::vector<at::Tensor>{});
          grads = &dtypes->back().second;
        }
        grads->push_back(std::move(to_unscale));
      }
    }
    std::vector<std::pair<c10::Device, at::Tensor>> found_inf_per_device;
    std::vector<std::pair<c10::Device, at::Tensor>> inv_scales;
    for (auto& device_and_dtypes : per_device_and_dtype) {
      const c10::Device& device = device_and_dtypes.first;
      // A zeroed flag per device, as torch's replicas of its zeroed found_inf.
      at::Tensor found_inf = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
      const at::Tensor& device_inv_scale = replica(inv_scales, inv_scale, device);
      for (auto& dtype_and_grads : device_and_dtypes.second) {
        non_finite_check_and_unscale_(dtype_and_grads.second, found_inf, device_inv_scale);
      }
      found_inf_per_device.emplace_back(device, std::move(found_inf));
    }
    return found_inf_per_device;
  }

  std::map<const torch::optim::Optimizer*, PerOptimizerState> states_;
  at::Tensor last_found_inf_;
};

}  // namespace detail

// torch.amp.GradScaler. See the file comment; the options are in options.h.
class DynamicScaler : public detail::LossScalerBase {
 public:
  static constexpr bool kLossScaling = true;

  // Validates the options when enabled, as torch asserts growth_factor > 1 and
  // backoff_factor < 1 only when enabled; amp also rejects the values that
  // make no sense (see options.h) with an `amp:` message naming the range.
  explicit DynamicScaler(DynamicScalerOptions options = {})
      : detail::LossScalerBase(options.enabled(), options.init_scale()), options_(options) {
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
    const detail::ScaleUpdateExtensions ext = extensions();
    if (!ext.any() && detail::compat::has_amp_kernels(scale_.device().type())) {
      at::_amp_update_scale_(scale_, tracker, found_inf_combined, options_.growth_factor(),
                             options_.backoff_factor(), options_.growth_interval());
    } else {
      detail::portable_update_scale_(scale_, tracker, found_inf_combined, options_.growth_factor(),
                                     options_.backoff_factor(), options_.growth_interval(), ext);
    }
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
    StateDict state = detail::empty_state_dict();
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
    init_hysteresis_tracker_ = state.contains("_hysteresis_tracker")
                                   ? detail::state_int(state, "_hysteresis_tracker")
                                   : options_.hysteresis();
    if (hysteresis_tracker_.defined()) {
      hysteresis_tracker_.fill_(init_hysteresis_tracker_);
    }
  }

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
  at::Tensor hysteresis_tracker_;    // int32, 0-dim; only with hysteresis > 1
};

using GradScaler = DynamicScaler;

}  // namespace amp
