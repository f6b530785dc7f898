// amp/core/rules.h: which policies are valid, which a device supports, and the
// static rules that reject the others with a message naming the fix.
//
//   static_assert(amp::is_valid_policy_v<amp::Mixed<amp::bf16, amp::NoScaler>>);
//   static_assert(!amp::is_valid_policy_v<amp::Mixed<amp::fp16, amp::NoScaler>>);
//   static_assert(amp::is_supported_v<amp::True<amp::fp64>, amp::CPU>);
//
// One SFINAE-friendly trait per question is the single source of truth;
// detail::check_policy / check_supported turn a `false` into one static_assert
// per rule (Trainer, Region and Autocast call them), so a user sees exactly one
// `amp:` message that ends with the fix.
#pragma once

#include <type_traits>

#include "amp/core/device.h"
#include "amp/core/dtype.h"
#include "amp/core/policy.h"
#include "amp/core/scaler_concept.h"
#include "amp/detail/compat.h"
#include "amp/detail/compat_float8.h"

namespace amp {

// ---------------------------------------------------------------------------
// The support matrix: one row per (dtype, device) that works, from the
// version facts in detail/compat.h. A new device adds its rows here.
//  * CPU: bf16 autocast since 1.10; fp16 autocast and the fp16 kernels
//    True<fp16> needs from compat::kCpuHasFp16.
//  * TF32 is a tensor-core math mode: CUDA only.
//  * CUDA: every valid policy compiles; bf16 needs an Ampere or newer GPU,
//    which the Trainer checks at run time.
//  * Float8: at::_scaled_mm, CUDA from 2.5 (compute capability 8.9+, checked
//    at run time), CPU from 2.8 (emulated: for correctness, not speed).
//  * Float8's block-scaled recipes (MXFP8, NVFP4) run emulated (dequantize,
//    then mm) wherever LibTorch has the float8 dtypes: 2.1+, CPU and CUDA.
// ---------------------------------------------------------------------------

namespace detail {

// Can autocast compute in Dtype on Device with this LibTorch?
template <class Dtype, class Device>
inline constexpr bool autocast_supported_v = false;
template <>
inline constexpr bool autocast_supported_v<bf16, CPU> = true;
template <>
inline constexpr bool autocast_supported_v<fp16, CPU> = compat::kCpuHasFp16;
template <>
inline constexpr bool autocast_supported_v<bf16, CUDA> = true;
template <>
inline constexpr bool autocast_supported_v<fp16, CUDA> = true;

// Can a whole model be trained in Dtype on Device with this LibTorch?
template <class Dtype, class Device>
inline constexpr bool true_precision_supported_v = false;
template <>
inline constexpr bool true_precision_supported_v<fp64, CPU> = true;
template <>
inline constexpr bool true_precision_supported_v<fp32, CPU> = true;
template <>
inline constexpr bool true_precision_supported_v<bf16, CPU> = true;
template <>
inline constexpr bool true_precision_supported_v<fp16, CPU> = compat::kCpuHasFp16;
template <>
inline constexpr bool true_precision_supported_v<fp64, CUDA> = true;
template <>
inline constexpr bool true_precision_supported_v<fp32, CUDA> = true;
template <>
inline constexpr bool true_precision_supported_v<tf32, CUDA> = true;
template <>
inline constexpr bool true_precision_supported_v<bf16, CUDA> = true;
template <>
inline constexpr bool true_precision_supported_v<fp16, CUDA> = true;

// Can Device run float8 linears (at::_scaled_mm) with this LibTorch? CUDA
// also needs compute capability 8.9+, which the Trainer checks at run time.
template <class Device>
inline constexpr bool float8_supported_v = false;
template <>
inline constexpr bool float8_supported_v<CPU> = compat::kCpuHasScaledMm;
template <>
inline constexpr bool float8_supported_v<CUDA> = compat::kHasFloat8Matmul;
// And with rowwise scales (Rowwise, RowwiseWithGwHp): CPU from LibTorch 2.14.
template <class Device>
inline constexpr bool float8_rowwise_supported_v = false;
template <>
inline constexpr bool float8_rowwise_supported_v<CPU> = compat::kCpuHasRowwiseScaledMm;
template <>
inline constexpr bool float8_rowwise_supported_v<CUDA> = compat::kHasFloat8Matmul;
// And the block-scaled recipes (emulated): the float8 dtypes, on either device.
template <class Device>
inline constexpr bool float8_block_scaled_supported_v = is_device_v<Device>&& compat::kHasFloat8Dtype;

// ---------------------------------------------------------------------------
// Validity: one trait per rule, then their conjunction.
// ---------------------------------------------------------------------------
// Rule: Mixed needs a 16-bit compute dtype.
template <class P>
inline constexpr bool mixed_has_half_compute_v = !is_mixed_v<P> || is_half_precision_v<mixed_compute_t<P>>;
// Rule: the Scaler of a Mixed policy has the scaler interface.
template <class P>
inline constexpr bool mixed_has_scaler_v = !is_mixed_v<P> || is_scaler_v<mixed_scaler_t<P>>;
// Rule: a user-defined Scaler names itself (kName), so the policy has a
// precision name for checkpoints and fit()'s output.
template <class P>
inline constexpr bool mixed_scaler_named_v =
    !is_mixed_v<P> || std::disjunction_v<builtin_scaler<mixed_scaler_t<P>>, has_scaler_name<mixed_scaler_t<P>>>;

// Rule: fp16 needs loss scaling.
template <class P>
inline constexpr bool fp16_is_scaled_v =
    !is_mixed_v<P> || !std::is_same_v<mixed_compute_t<P>, fp16> || uses_loss_scaling_v<mixed_scaler_t<P>>;
// Rule: bf16 must not be loss-scaled.
template <class P>
inline constexpr bool bf16_is_unscaled_v =
    !is_mixed_v<P> || !std::is_same_v<mixed_compute_t<P>, bf16> || !uses_loss_scaling_v<mixed_scaler_t<P>>;
// Rule: True<D> needs a dtype tag.
template <class P>
inline constexpr bool true_has_dtype_v = !is_true_v<P> || is_dtype_v<true_dtype_t<P>>;
// Rule: Float8<R> needs a float8 recipe (Tensorwise, Rowwise, RowwiseWithGwHp,
// Delayed<H >= 1, 0 <= M < 64>).
template <class P>
inline constexpr bool float8_has_recipe_v = !is_float8_v<P> || is_float8_recipe_v<float8_recipe_t<P>>;
// Rule: a block-scaled recipe (MXFP8, NVFP4) takes no Scaler either: each
// block carries its own scale (its own rule, for its own message).
template <class P>
inline constexpr bool block_scaled_is_unscaled_v =
    !is_float8_v<P> || !is_block_scaled_recipe_v<float8_recipe_t<P>> || std::is_same_v<float8_scaler_t<P>, NoScaler>;
// Rule: MXFP8 and NVFP4 are Float8 recipes, not the compute dtype of Mixed
// nor the dtype of True.
template <class P>
inline constexpr bool block_scaled_in_float8_v =
    !is_block_scaled_recipe_v<mixed_compute_t<P>> && !is_block_scaled_recipe_v<true_dtype_t<P>>;
// Rule: Float8 takes no Scaler: what is not float8 computes in bf16.
template <class P>
inline constexpr bool float8_is_unscaled_v = !is_float8_v<P> || std::is_same_v<float8_scaler_t<P>, NoScaler>;

}  // namespace detail

template <class P>
inline constexpr bool is_valid_policy_v =
    detail::is_policy_v<P>&& detail::mixed_has_half_compute_v<P>&& detail::mixed_has_scaler_v<P>&&
        detail::fp16_is_scaled_v<P>&& detail::bf16_is_unscaled_v<P>&& detail::true_has_dtype_v<P>&&
            detail::mixed_scaler_named_v<P>&& detail::float8_has_recipe_v<P>&& detail::float8_is_unscaled_v<P>&&
                detail::block_scaled_is_unscaled_v<P>&& detail::block_scaled_in_float8_v<P>;

namespace detail {
template <class P, class Device, bool Valid = is_valid_policy_v<P>&& is_device_v<Device>>
struct supported_impl : std::false_type {};
template <class C, class S, class Device>
struct supported_impl<Mixed<C, S>, Device, true> : std::bool_constant<autocast_supported_v<C, Device>> {};
template <class D, class Device>
struct supported_impl<True<D>, Device, true> : std::bool_constant<true_precision_supported_v<D, Device>> {};
template <class R, class S, class Device>
struct supported_impl<Float8<R, S>, Device, true>
    : std::bool_constant<is_block_scaled_recipe_v<R>
                             ? float8_block_scaled_supported_v<Device>
                             : float8_supported_v<Device> &&
                                   (!is_rowwise_recipe_v<R> || float8_rowwise_supported_v<Device>)> {};
}  // namespace detail

// A valid policy that this LibTorch can run on Device.
template <class P, class Device>
inline constexpr bool is_supported_v = detail::supported_impl<P, Device>::value;

// ---------------------------------------------------------------------------
// The static rules. Each branch is reached only when the earlier rules hold,
// so exactly one message is printed.
// ---------------------------------------------------------------------------
namespace detail {

template <class>
inline constexpr bool dependent_false_v = false;

template <class P>
constexpr bool check_policy() {
  if constexpr (!is_policy_v<P>) {
    static_assert(
        is_policy_v<P>,
        "amp: expected a precision policy (amp::Mixed<Compute, Scaler>, amp::True<Dtype> or amp::Float8<Recipe>) "
        "but got another type; use e.g. amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> or "
        "amp::Trainer<amp::True<amp::fp32>, amp::CUDA>");
    return false;
  } else if constexpr (!block_scaled_in_float8_v<P>) {
    static_assert(block_scaled_in_float8_v<P>,
                  "amp: MXFP8 and NVFP4 are Float8 recipes (they scale the linears' GEMM operands per block), not "
                  "dtypes of Mixed or True; use amp::Float8<amp::MXFP8<>> or amp::Float8<amp::NVFP4<>>");
    return false;
  } else if constexpr (!float8_has_recipe_v<P>) {
    static_assert(float8_has_recipe_v<P>,
                  "amp: Float8<Recipe> needs a float8 recipe; use amp::Float8<amp::Tensorwise> (current scaling), "
                  "amp::Float8<amp::Rowwise> or amp::Float8<amp::RowwiseWithGwHp> (torchao's rowwise recipes), "
                  "amp::Float8<amp::Delayed<History, Margin>> with History >= 1 and 0 <= Margin < 64 (e.g. "
                  "amp::Delayed<>, Transformer Engine's 1024 and 0), or a block-scaled recipe: "
                  "amp::Float8<amp::MXFP8<amp::MxScaleMode::kRceil>> (or kFloor), amp::Float8<amp::NVFP4<>>");
    return false;
  } else if constexpr (!block_scaled_is_unscaled_v<P>) {
    static_assert(block_scaled_is_unscaled_v<P>,
                  "amp: Float8<MXFP8<...> or NVFP4<...>, Scaler> takes no loss scaler: every block of a GEMM operand "
                  "gets its own scale from its own amax, gradients included, and the rest computes in bf16; use "
                  "amp::Float8<amp::MXFP8<>> or amp::Float8<amp::NVFP4<>>");
    return false;
  } else if constexpr (!float8_is_unscaled_v<P>) {
    static_assert(float8_is_unscaled_v<P>,
                  "amp: Float8<Recipe, Scaler> takes no loss scaler: the float8 casts carry their own scales and the "
                  "rest computes in bf16, which has fp32's exponent range; use amp::Float8<Recipe>");
    return false;
  } else if constexpr (!true_has_dtype_v<P>) {
    static_assert(
        true_has_dtype_v<P>,
        "amp: True<Dtype> needs a dtype tag; use amp::True<amp::fp32> (or amp::fp64, amp::bf16, amp::fp16, amp::tf32)");
    return false;
  } else if constexpr (!mixed_has_half_compute_v<P>) {
    static_assert(mixed_has_half_compute_v<P>,
                  "amp: Mixed<Compute, Scaler> needs a 16-bit compute dtype (fp16 or bf16); for training fully in "
                  "fp32/fp64/tf32 use amp::True<amp::fp32> (or amp::True<amp::fp64>, amp::True<amp::tf32>)");
    return false;
  } else if constexpr (!mixed_has_scaler_v<P>) {
    static_assert(
        mixed_has_scaler_v<P>,
        "amp: the Scaler of Mixed<Compute, Scaler> lacks the scaler interface (kLossScaling, scale, unscale_, "
        "step, update, get_scale, is_enabled, state_dict, load_state_dict); use amp::DynamicScaler, "
        "amp::StaticScaler or amp::NoScaler");
    return false;
  } else if constexpr (!mixed_scaler_named_v<P>) {
    static_assert(mixed_scaler_named_v<P>,
                  "amp: a user-defined Scaler needs a name for the policy's precision string (checkpoints, fit()); add "
                  "`static constexpr const char* kName = \"myscaler\";` to the scaler (the policy is then named "
                  "\"16-mixed-myscaler\")");
    return false;
  } else if constexpr (!fp16_is_scaled_v<P>) {
    static_assert(fp16_is_scaled_v<P>,
                  "amp: Mixed<fp16, NoScaler> would let fp16 gradients underflow; use "
                  "amp::Mixed<amp::fp16, amp::DynamicScaler> or amp::Mixed<amp::bf16, amp::NoScaler>");
    return false;
  } else if constexpr (!bf16_is_unscaled_v<P>) {
    static_assert(bf16_is_unscaled_v<P>,
                  "amp: Mixed<bf16, Scaler> with a loss-scaling Scaler is rejected: bf16 has fp32's exponent range and "
                  "needs no loss scaling; use amp::Mixed<amp::bf16, amp::NoScaler>");
    return false;
  } else {
    return true;
  }
}

template <class P, class Device>
constexpr bool check_supported() {
  if constexpr (!check_policy<P>()) {
    return false;
  } else if constexpr (!is_device_v<Device>) {
    static_assert(is_device_v<Device>, "amp: Device must be a device tag; use amp::CPU or amp::CUDA");
    return false;
  } else if constexpr (std::is_same_v<P, True<tf32>> && std::is_same_v<Device, CPU>) {
    static_assert(dependent_false_v<P>,
                  "amp: True<tf32> is a tensor-core math mode that CPUs do not have; on CPU use amp::True<amp::fp32>");
    return false;
  } else if constexpr (is_float8_v<P> && is_block_scaled_recipe_v<float8_recipe_t<P>> &&
                       !float8_block_scaled_supported_v<Device>) {
    static_assert(dependent_false_v<P>,
                  "amp: Float8's block-scaled recipes (MXFP8, NVFP4) need LibTorch 2.1 or newer (the float8 dtypes "
                  "their elements and scales are cast through); on this LibTorch use "
                  "amp::Mixed<amp::bf16, amp::NoScaler>");
    return false;
  } else if constexpr (is_float8_v<P> && is_rowwise_recipe_v<float8_recipe_t<P>> && std::is_same_v<Device, CPU> &&
                       !float8_rowwise_supported_v<CPU>) {
    static_assert(dependent_false_v<P>,
                  "amp: Float8's rowwise recipes on CPU need LibTorch 2.14 or newer (a CPU at::_scaled_mm that takes "
                  "rowwise scales); on this LibTorch use amp::Float8<amp::Tensorwise> (LibTorch 2.8+) or "
                  "amp::Mixed<amp::bf16, amp::NoScaler> on amp::CPU");
    return false;
  } else if constexpr (is_float8_v<P> && !is_block_scaled_recipe_v<float8_recipe_t<P>> && !float8_supported_v<Device> &&
                       std::is_same_v<Device, CPU>) {
    static_assert(dependent_false_v<P>,
                  "amp: Float8 on CPU needs LibTorch 2.8 or newer (the CPU at::_scaled_mm); on this LibTorch use "
                  "amp::Mixed<amp::bf16, amp::NoScaler> on amp::CPU");
    return false;
  } else if constexpr (is_float8_v<P> && !is_block_scaled_recipe_v<float8_recipe_t<P>> && !float8_supported_v<Device>) {
    static_assert(dependent_false_v<P>,
                  "amp: Float8 needs LibTorch 2.5 or newer (at::_scaled_mm with out_dtype); on this LibTorch use "
                  "amp::Mixed<amp::bf16, amp::NoScaler>");
    return false;
  } else if constexpr (!is_supported_v<P, Device> && std::is_same_v<Device, CPU>) {
    static_assert(dependent_false_v<P>,
                  "amp: fp16 on CPU (autocast and kernels) needs LibTorch 2.3 or newer; on this LibTorch use "
                  "amp::Mixed<amp::bf16, amp::NoScaler> (or amp::True<amp::bf16>) on amp::CPU");
    return false;
  } else {
    static_assert(is_supported_v<P, Device>,
                  "amp: this policy is not supported on this device; see amp::supported_policies<Device>");
    return true;
  }
}

template <class Dtype, class Device>
constexpr bool check_autocast() {
  if constexpr (!is_half_precision_v<Dtype>) {
    static_assert(is_half_precision_v<Dtype>,
                  "amp: Autocast<Dtype, Device> computes in a 16-bit dtype; use amp::Autocast<amp::bf16, Device> or "
                  "amp::Autocast<amp::fp16, Device>");
    return false;
  } else if constexpr (!is_device_v<Device>) {
    static_assert(is_device_v<Device>, "amp: Device must be a device tag; use amp::CPU or amp::CUDA");
    return false;
  } else if constexpr (!autocast_supported_v<Dtype, Device>) {
    static_assert(autocast_supported_v<Dtype, Device>,
                  "amp: Autocast<fp16, CPU> needs LibTorch 2.3 or newer (CPU fp16 autocast); use "
                  "amp::Autocast<amp::bf16, amp::CPU>");
    return false;
  } else {
    return true;
  }
}
}  // namespace detail

}  // namespace amp
