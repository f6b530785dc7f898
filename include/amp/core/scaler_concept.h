// amp/core/scaler_concept.h: what a scaler type must provide.
//
//   static_assert(amp::is_scaler_v<amp::DynamicScaler>);
//   static_assert(amp::uses_loss_scaling_v<amp::DynamicScaler>);
//   static_assert(!amp::uses_loss_scaling_v<amp::NoScaler>);
//
// The interface is torch.amp.GradScaler's: scale(loss), unscale_(optimizer),
// step(optimizer), update(), get_scale(), is_enabled(), state_dict(),
// load_state_dict(dict), plus `static constexpr bool kLossScaling`, which says
// whether the scaler multiplies the loss (DynamicScaler, StaticScaler) or not
// (NoScaler). A user-defined scaler that provides all of these, and a
// `static constexpr const char* kName` for its policy's precision string
// (rules.h), is accepted by Mixed<> and Trainer<>.
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
template <class S>
inline constexpr bool is_scaler_v = detail::builtin_scaler<S>::value ||
                                    (detail::has_loss_scaling_flag<S>::value && detail::has_scaler_methods<S>::value);

template <class S, bool = is_scaler_v<S>, bool = detail::builtin_scaler<S>::value>
struct uses_loss_scaling : std::false_type {};
template <class S>
struct uses_loss_scaling<S, true, false> : std::bool_constant<S::kLossScaling> {};
template <class S>
struct uses_loss_scaling<S, true, true> : std::bool_constant<detail::builtin_scaler<S>::loss_scaling> {};

namespace detail {
// For the built-in scalers' headers: the definition matches builtin_scaler.
template <class S>
inline constexpr bool builtin_scaler_matches_v =
    has_loss_scaling_flag<S>::value&& has_scaler_methods<S>::value&& S::kLossScaling == builtin_scaler<S>::loss_scaling;
}  // namespace detail

// True for scalers that multiply the loss (and so must unscale and check inf/NaN).
template <class S>
inline constexpr bool uses_loss_scaling_v = uses_loss_scaling<S>::value;

}  // namespace amp
