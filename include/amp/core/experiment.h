// amp/core/experiment.h: experiment grids as compile-time Boost.Hana lists.
//
//   amp::for_each_policy(amp::supported_policies<amp::CPU>, [](auto policy) {
//     using P = typename decltype(policy)::type;  run<P>(); });
//   amp::dispatch_precision<amp::CPU>("bf16-mixed", [](auto policy) { ... });
//
// all_policies lists every built-in policy once, a recipe family by its
// defaults (Float8<Delayed<>>: TE's; Float8<MXFP8<>>: RCEIL; Float8<NVFP4<>>:
// no stochastic rounding); supported_policies<Device> is computed from it with
// hana::filter over is_supported_v, so the per-device lists follow the
// LibTorch version instead of being written by hand. Adding a policy to
// all_policies adds it to every sweep, typed test and dispatch. Two recipe
// variants dispatch by name but are in no list a sweep or typed suite runs
// (their emulation is slow): "mxfp8-floor" (Float8<MXFP8<kFloor>>) and
// "nvfp4-sr" (Float8<NVFP4<true>>).
#pragma once

#include <boost/hana/at_key.hpp>
#include <boost/hana/concat.hpp>
#include <boost/hana/filter.hpp>
#include <boost/hana/front.hpp>
#include <boost/hana/for_each.hpp>
#include <boost/hana/length.hpp>
#include <boost/hana/tuple.hpp>
#include <boost/hana/type.hpp>
#include <boost/hana/unpack.hpp>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "amp/core/device.h"
#include "amp/core/policy.h"
#include "amp/core/rules.h"

namespace amp {

// Every valid policy, in the order tables and sweeps show them.
inline constexpr auto all_policies =
    boost::hana::tuple_t<True<fp32>, True<tf32>, Mixed<bf16, NoScaler>, Mixed<fp16, DynamicScaler>,
                         Mixed<fp16, StaticScaler>, True<bf16>, True<fp16>, True<fp64>, Float8<Tensorwise>,
                         Float8<Delayed<>>, Float8<Rowwise>, Float8<RowwiseWithGwHp>, Float8<MXFP8<>>, Float8<NVFP4<>>>;

namespace detail {
// The policies dispatch_precision knows besides all_policies: recipe
// variants other than their family's default, kept out of the sweeps.
inline constexpr auto named_variants = boost::hana::tuple_t<Float8<MXFP8<MxScaleMode::kFloor>>, Float8<NVFP4<true>>>;

template <class Device>
struct supported_on {
  template <class T>
  constexpr auto operator()(T) const {
    return boost::hana::bool_c<is_supported_v<typename T::type, Device>>;
  }
};
}  // namespace detail

// The policies this LibTorch can run on Device.
template <class Device>
inline constexpr auto supported_policies = boost::hana::filter(all_policies, detail::supported_on<Device>{});

namespace detail {
// Every policy dispatch_precision can reach on Device: supported_policies, then the supported named variants.
template <class Device>
inline constexpr auto dispatchable_policies =
    boost::hana::concat(supported_policies<Device>, boost::hana::filter(named_variants, supported_on<Device>{}));
inline constexpr auto dispatch_names = boost::hana::concat(all_policies, named_variants);
}  // namespace detail

// Calls f(hana::type_c<P>) for each policy P of the list, in order.
template <class List, class F>
constexpr void for_each_policy(List list, F&& f) {
  boost::hana::for_each(list, std::forward<F>(f));
}

// Calls f(hana::type_c<P>) for every policy in all_policies.
template <class F>
constexpr void for_each_policy(F&& f) {
  boost::hana::for_each(all_policies, std::forward<F>(f));
}

namespace detail {
// Template<P...> for a list of policy types (amp::testing::PolicyTypes is the public form).
template <template <class...> class Template, class List>
using unpack_types_t =
    typename decltype(boost::hana::unpack(std::declval<std::decay_t<List>>(), boost::hana::template_<Template>))::type;
}  // namespace detail

// A policy's precision string (Lightning's vocabulary).
template <class P>
constexpr const char* precision_name() {
  static_assert(detail::check_policy<P>());
  return policy_traits<P>::name;
}

namespace detail {
// Lightning's legacy spellings and their modern names (the "-mixed" forms for 16/bf16).
inline std::string canonical_precision(const std::string& name) {
  if (name == "64") return "64-true";
  if (name == "32") return "32-true";
  if (name == "16") return "16-mixed";
  if (name == "bf16") return "bf16-mixed";
  return name;
}
}  // namespace detail

namespace detail {
template <class List>
std::string join_names(List list) {
  std::string out;
  boost::hana::for_each(list, [&](auto t) {
    if (!out.empty()) out += ", ";
    out += policy_traits<typename decltype(t)::type>::name;
  });
  return out;
}
}  // namespace detail

// Maps a precision string onto its policy and calls f(hana::type_c<P>),
// returning f's result by value (f must return the same type for every policy).
// Knows all_policies' names and the variants "mxfp8-floor" and "nvfp4-sr".
// Throws c10::Error listing the valid strings when `name` is unknown, and the
// ones this device supports when it names a policy Device cannot run.
template <class Device, class F>
auto dispatch_precision(const std::string& name, F&& f) {
  static_assert(detail::is_device_v<Device>, "amp: Device must be a device tag; use amp::CPU or amp::CUDA");
  using Result = decltype(f(boost::hana::front(supported_policies<Device>)));
  const std::string wanted = detail::canonical_precision(name);
  bool known = false;
  boost::hana::for_each(detail::dispatch_names,
                        [&](auto t) { known = known || wanted == policy_traits<typename decltype(t)::type>::name; });
  TORCH_CHECK(known, "amp: unknown precision \"", name, "\"; valid: ", detail::join_names(detail::dispatch_names),
              " (legacy: 64, 32, 16, bf16)");

  if constexpr (std::is_void_v<Result>) {
    bool called = false;
    boost::hana::for_each(detail::dispatchable_policies<Device>, [&](auto t) {
      if (!called && wanted == policy_traits<typename decltype(t)::type>::name) {
        called = true;
        f(t);
      }
    });
    TORCH_CHECK(called, "amp: precision \"", name, "\" is not supported on ", device_traits<Device>::name,
                " with LibTorch ", TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR,
                "; supported: ", detail::join_names(detail::dispatchable_policies<Device>));
  } else {
    std::optional<std::decay_t<Result>> result;
    boost::hana::for_each(detail::dispatchable_policies<Device>, [&](auto t) {
      if (!result && wanted == policy_traits<typename decltype(t)::type>::name) result.emplace(f(t));
    });
    TORCH_CHECK(result.has_value(), "amp: precision \"", name, "\" is not supported on ", device_traits<Device>::name,
                " with LibTorch ", TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR,
                "; supported: ", detail::join_names(detail::dispatchable_policies<Device>));
    return std::move(*result);
  }
}

}  // namespace amp
