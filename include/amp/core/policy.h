// amp/core/policy.h: precision policies as types.
//
//   using P = amp::Mixed<amp::fp16, amp::DynamicScaler>;   // "16-mixed"
//   static_assert(amp::policy_traits<P>::uses_autocast);
//   std::cout << amp::policy_traits<amp::True<amp::fp64>>::name;   // "64-true"
//
// Mixed<Compute, Scaler>: fp32 parameters and optimizer state, eligible ops in
// Compute through LibTorch's autocast, the loss scaled by Scaler.
// True<Dtype>: the whole model in one dtype (Lightning's "-true" precisions),
// no autocast; True<tf32> is fp32 storage with TF32 matmul/conv math on CUDA.
// Which combinations are valid is decided in rules.h.
#pragma once

#include <array>
#include <cstddef>
#include <type_traits>

#include "amp/core/dtype.h"
#include "amp/core/scaler_concept.h"  // forward declarations only: no ATen here

namespace amp {

template <class Compute, class Scaler>
struct Mixed {
  using compute_type = Compute;
  using scaler_type = Scaler;
};

template <class Dtype>
struct True {
  using compute_type = Dtype;
  using scaler_type = NoScaler;
};

// True for any Mixed<...> or True<...> instantiation, valid or not.
template <class P>
struct is_policy : std::false_type {};
template <class C, class S>
struct is_policy<Mixed<C, S>> : std::true_type {};
template <class D>
struct is_policy<True<D>> : std::true_type {};
template <class P>
inline constexpr bool is_policy_v = is_policy<P>::value;

template <class P>
inline constexpr bool is_mixed_v = false;
template <class C, class S>
inline constexpr bool is_mixed_v<Mixed<C, S>> = true;

template <class P>
inline constexpr bool is_true_v = false;
template <class D>
inline constexpr bool is_true_v<True<D>> = true;

namespace detail {
constexpr std::size_t length_of(const char* s) {
  std::size_t n = 0;
  while (s[n] != '\0') ++n;
  return n;
}
// Lightning's prefix of a Mixed compute dtype: "16" (fp16), "bf16".
template <class C>
inline constexpr const char* mixed_prefix = std::is_same_v<C, fp16> ? "16" : (std::is_same_v<C, bf16> ? "bf16" : "");

// "<prefix>-mixed-<S::kName>": the name of Mixed<C, S> for a user-defined scaler S.
template <class C, class S>
struct user_scaler_policy_name {
  static constexpr auto make() {
    constexpr const char* parts[] = {mixed_prefix<C>, "-mixed-", S::kName};
    std::array<char, length_of(mixed_prefix<C>) + length_of("-mixed-") + length_of(S::kName) + 1> out{};
    std::size_t i = 0;
    for (const char* part : parts)
      for (std::size_t j = 0; part[j] != '\0'; ++j) out[i++] = part[j];
    return out;
  }
  static constexpr auto storage = make();
  static constexpr const char* value = storage.data();
};

// Lightning's precision strings; amp's own extensions for the policies
// Lightning has no name for ("16-mixed-static", "tf32-true"); a user-defined
// scaler's policy is named from its kName (null without one: rules.h rejects it).
template <class P>
struct policy_name {
  static constexpr const char* value = nullptr;
};
template <class C, class S>
struct policy_name<Mixed<C, S>> {
  static constexpr const char* value = [] {
    if constexpr (has_scaler_name<S>::value) {
      return user_scaler_policy_name<C, S>::value;
    } else {
      return static_cast<const char*>(nullptr);
    }
  }();
};
template <>
struct policy_name<Mixed<fp16, DynamicScaler>> {
  static constexpr const char* value = "16-mixed";
};
template <>
struct policy_name<Mixed<fp16, StaticScaler>> {
  static constexpr const char* value = "16-mixed-static";
};
template <>
struct policy_name<Mixed<bf16, NoScaler>> {
  static constexpr const char* value = "bf16-mixed";
};
template <>
struct policy_name<True<fp64>> {
  static constexpr const char* value = "64-true";
};
template <>
struct policy_name<True<fp32>> {
  static constexpr const char* value = "32-true";
};
template <>
struct policy_name<True<tf32>> {
  static constexpr const char* value = "tf32-true";
};
template <>
struct policy_name<True<bf16>> {
  static constexpr const char* value = "bf16-true";
};
template <>
struct policy_name<True<fp16>> {
  static constexpr const char* value = "16-true";
};
}  // namespace detail

namespace detail {
// A policy's parts, for any type (void where P is no such policy): the one
// decomposition policy_traits, the static rules and Region read.
template <class P>
struct mixed_parts {
  using compute = void;
  using scaler = void;
};
template <class C, class S>
struct mixed_parts<Mixed<C, S>> {
  using compute = C;
  using scaler = S;
};
template <class P>
struct true_part {
  using dtype = void;
};
template <class D>
struct true_part<True<D>> {
  using dtype = D;
};

template <class P>
using mixed_compute_t = typename mixed_parts<P>::compute;
template <class P>
using mixed_scaler_t = typename mixed_parts<P>::scaler;
template <class P>
using true_dtype_t = typename true_part<P>::dtype;
// The dtype a policy computes in: Mixed<C, S> -> C, True<D> -> D, else void.
template <class P>
using policy_compute_t = std::conditional_t<is_mixed_v<P>, mixed_compute_t<P>, true_dtype_t<P>>;
// The dtype parameters are kept in: fp32 for Mixed, D for True<D>, else void.
template <class P>
using policy_param_t = std::conditional_t<is_mixed_v<P>, fp32, true_dtype_t<P>>;
}  // namespace detail

// policy_traits<P>: what a policy means. Defined for every Mixed/True type; use
// is_valid_policy_v (rules.h) to know whether the combination is allowed.
template <class P>
struct policy_traits;

template <class Compute, class Scaler>
struct policy_traits<Mixed<Compute, Scaler>> {
  using policy = Mixed<Compute, Scaler>;
  using compute_type = detail::policy_compute_t<policy>;  // the dtype autocast computes eligible ops in
  using param_type = detail::policy_param_t<policy>;      // parameters and optimizer state stay fp32
  using scaler_type = Scaler;
  static constexpr bool uses_autocast = true;
  static constexpr bool uses_loss_scaling = uses_loss_scaling_v<Scaler>;
  static constexpr const char* name = detail::policy_name<policy>::value;
};

template <class Dtype>
struct policy_traits<True<Dtype>> {
  using policy = True<Dtype>;
  using compute_type = detail::policy_compute_t<policy>;
  using param_type = detail::policy_param_t<policy>;
  using scaler_type = NoScaler;
  static constexpr bool uses_autocast = false;
  static constexpr bool uses_loss_scaling = false;
  static constexpr const char* name = detail::policy_name<policy>::value;
};

}  // namespace amp
