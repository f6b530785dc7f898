// amp/core/scaler_concept.h: what a scaler type must provide, and what it may.
//
//   static_assert(amp::is_scaler_v<amp::DynamicScaler>);
//   static_assert(amp::DynamicScaler::kLossScaling && !amp::NoScaler::kLossScaling);
//   static_assert(amp::scaler_capabilities<amp::DynamicScaler>::fused_step);
//
// The interface is torch.amp.GradScaler's: scale(loss), unscale_(optimizer),
// step(optimizer), update(), get_scale(), is_enabled(), state_dict(),
// load_state_dict(dict), plus `static constexpr bool kLossScaling`, which says
// whether the scaler multiplies the loss (DynamicScaler, StaticScaler) or not
// (NoScaler). A user-defined scaler that provides all of these, and a
// `static constexpr const char* kName` for its policy's precision string
// (rules.h), is accepted by Mixed<> and Trainer<>.
//
// Optional, each detected by scaler_capabilities and used where present:
// found_inf(), get_scale_async(), step(optimizer, FusedStep&) and
// discard_iteration() (see there for what each buys). LossScalerBase
// (scaler/loss_scaler.h) provides all four.
//
// Only forward declarations here: the compile-time layer (policy.h,
// rules.h) reads these traits without parsing ATen. The built-in scalers are
// known by name (builtin_scaler); their headers check that they match.
#pragma once

#include <string>
#include <type_traits>
#include <utility>

namespace at {
class Tensor;
}  // namespace at
namespace c10 {
struct IValue;
template <class Key, class Value>
class Dict;
}  // namespace c10
namespace torch {
namespace optim {
class Optimizer;
}  // namespace optim
}  // namespace torch

namespace amp {

class NoScaler;
class FusedStep;
class StaticScaler;
class DynamicScaler;

// The type of a scaler's state_dict: torch's own keys, loadable by Python's
// torch.load after torch::pickle_save.
using StateDict = c10::Dict<std::string, c10::IValue>;

namespace detail {

// The built-in scalers, known without their definitions.
template <class S>
struct builtin_scaler : std::false_type {};
template <>
struct builtin_scaler<NoScaler> : std::true_type {
  static constexpr bool loss_scaling = false;
  static constexpr const char* name = "NoScaler";
};
template <>
struct builtin_scaler<StaticScaler> : std::true_type {
  static constexpr bool loss_scaling = true;
  static constexpr const char* name = "StaticScaler";
};
template <>
struct builtin_scaler<DynamicScaler> : std::true_type {
  static constexpr bool loss_scaling = true;
  static constexpr const char* name = "DynamicScaler";
};

template <class S, class = void>
struct has_scaler_name : std::false_type {};
template <class S>
struct has_scaler_name<S, std::void_t<decltype(S::kName)>> : std::is_convertible<decltype(S::kName), const char*> {};

template <class S, class = void>
struct has_loss_scaling_flag : std::false_type {};
template <class S>
struct has_loss_scaling_flag<S, std::enable_if_t<std::is_same_v<std::decay_t<decltype(S::kLossScaling)>, bool>>>
    : std::true_type {};

template <class S, class = void>
struct has_scaler_methods : std::false_type {};
template <class S>
struct has_scaler_methods<
    S, std::void_t<decltype(std::declval<S&>().scale(std::declval<const at::Tensor&>())),
                   decltype(std::declval<S&>().unscale_(std::declval<torch::optim::Optimizer&>())),
                   decltype(std::declval<S&>().step(std::declval<torch::optim::Optimizer&>())),
                   decltype(std::declval<S&>().update()), decltype(std::declval<const S&>().get_scale()),
                   decltype(std::declval<const S&>().is_enabled()), decltype(std::declval<const S&>().state_dict()),
                   decltype(std::declval<S&>().load_state_dict(std::declval<const StateDict&>()))>> : std::true_type {};

}  // namespace detail

// True when S provides the whole scaler interface (see the file comment).
// std::disjunction: a built-in scaler's members are never asked for, so
// naming one whose header is not included yet (incomplete) caches nothing.
template <class S>
inline constexpr bool is_scaler_v =
    std::disjunction_v<detail::builtin_scaler<S>,
                       std::conjunction<detail::has_loss_scaling_flag<S>, detail::has_scaler_methods<S>>>;

namespace detail {
template <class S, bool = is_scaler_v<S>, bool = builtin_scaler<S>::value>
struct uses_loss_scaling : std::false_type {};
template <class S>
struct uses_loss_scaling<S, true, false> : std::bool_constant<S::kLossScaling> {};
template <class S>
struct uses_loss_scaling<S, true, true> : std::bool_constant<builtin_scaler<S>::loss_scaling> {};

// For the built-in scalers' headers: the definition matches builtin_scaler.
template <class S>
inline constexpr bool builtin_scaler_matches_v =
    has_loss_scaling_flag<S>::value&& has_scaler_methods<S>::value&& S::kLossScaling == builtin_scaler<S>::loss_scaling;

// True for scalers that multiply the loss (and so must unscale and check inf/NaN).
template <class S>
inline constexpr bool uses_loss_scaling_v = uses_loss_scaling<S>::value;

template <class S, class = void>
struct has_found_inf : std::false_type {};
template <class S>
struct has_found_inf<S, std::void_t<decltype(std::declval<const S&>().found_inf())>> : std::true_type {};
template <class S, class = void>
struct has_scale_async : std::false_type {};
template <class S>
struct has_scale_async<S, std::void_t<decltype(std::declval<const S&>().get_scale_async())>> : std::true_type {};
template <class S, class = void>
struct has_fused_step : std::false_type {};
template <class S>
struct has_fused_step<S, std::void_t<decltype(std::declval<S&>().step(std::declval<torch::optim::Optimizer&>(),
                                                                      std::declval<FusedStep&>()))>> : std::true_type {
};
template <class S, class = void>
struct has_discard_iteration : std::false_type {};
template <class S>
struct has_discard_iteration<S, std::void_t<decltype(std::declval<S&>().discard_iteration())>> : std::true_type {};
}  // namespace detail

// The optional methods a scaler S has: what each buys where it is present.
template <class S>
struct scaler_capabilities {
  // at::Tensor found_inf() const: the last step's inf/NaN flag on the device;
  // Stepper and Fabric report skips without a host sync.
  static constexpr bool found_inf = detail::has_found_inf<S>::value;
  // at::Tensor get_scale_async() const: the scale on the device (torch's
  // _get_scale_async); fit() records it without a host sync.
  static constexpr bool scale_async = detail::has_scale_async<S>::value;
  // void step(Optimizer&, FusedStep&): the fused, sync-free optimizer path
  // (without it a loss-scaling scaler takes the unfused one).
  static constexpr bool fused_step = detail::has_fused_step<S>::value;
  // void discard_iteration(): forget the current iteration's per-optimizer
  // stages; capture() undoes its warm-up steps with it.
  static constexpr bool discard_iteration = detail::has_discard_iteration<S>::value;
};

}  // namespace amp
