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
// Float8<Recipe>: a region's linear layers in float8 (amp/float8/policy.h),
// everything else as Mixed<bf16, NoScaler>; Recipe is Tensorwise, Delayed<...>,
// Rowwise, RowwiseWithGwHp, or a block-scaled recipe: MXFP8<...> or NVFP4<...>.
// Which combinations are valid is decided in rules.h.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
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

// Float8 recipes: where each float8 cast's scale comes from.
// Tensorwise: the tensor's own amax, at the cast (current scaling; torchao's
// default, Transformer Engine's Float8CurrentScaling).
struct Tensorwise {};
// Delayed<HistoryLength, Margin>: the largest amax of the last HistoryLength
// steps, divided by 2^Margin (Transformer Engine's DelayedScaling; its defaults).
template <int HistoryLength = 1024, int Margin = 0>
struct Delayed {
  static constexpr int history_length = HistoryLength;
  static constexpr int margin = Margin;
};
// Rowwise: torchao's ROWWISE, current scaling with a scale per row (per
// column where the matmul needs it), rounded down to a power of 2, e4m3 in
// forward and backward.
struct Rowwise {};
// RowwiseWithGwHp: torchao's ROWWISE_WITH_GW_HP, Rowwise whose weight
// gradient is a bf16 matmul (and dX's weight cast tensorwise).
struct RowwiseWithGwHp {};

// Block-scaled recipes: a scale per block of elements, from the block's own
// amax at the cast (amp/float8/block_scaled.h runs them, emulated:
// dequantize, then mm).
// MxScaleMode: how an MXFP8 block's power-of-2 scale comes from its amax
// (torchao's ScaleCalculationMode): kRceil rounds amax / max_elem up to a
// power of 2 (MXFP8Linear's default; cuBLAS's and Transformer Engine's),
// kFloor takes floor(log2 amax) - emax_elem (the OCP spec's, to_mx's default).
enum class MxScaleMode : std::uint8_t { kRceil, kFloor };
// MXFP8<Mode>: torchao's MXFP8Linear (e4m3 elements, blocks of 32 along each
// GEMM's reduction dimension, E8M0 scales) for forward, dgrad and wgrad.
template <MxScaleMode Mode = MxScaleMode::kRceil>
struct MXFP8 {
  static constexpr MxScaleMode scale_mode = Mode;
};
// NVFP4<StochasticRounding>: Transformer Engine's NVFP4BlockScaling (E2M1
// elements in blocks of 16 with E4M3 scales and an fp32 tensor scale; weights
// in 16x16 tiles; wgrad's operands through the random Hadamard transform);
// with StochasticRounding, the gradients' casts round stochastically (TE's
// default; off here so that runs are bitwise with the reference).
template <bool StochasticRounding = false>
struct NVFP4 {
  static constexpr bool stochastic_rounding = StochasticRounding;
};

// The linears of a region in float8 (e4m3 forward, e5m2 output gradients),
// the rest in bf16 autocast, fp32 parameters. Scaler is there so that the
// rules can reject one: bf16's range needs no loss scaling.
template <class Recipe, class Scaler = NoScaler>
struct Float8 {
  using compute_type = bf16;
  using scaler_type = Scaler;
  using recipe_type = Recipe;
};

namespace detail {
// True for any Mixed<...> or True<...> instantiation, valid or not.
template <class P>
struct is_policy : std::false_type {};
template <class C, class S>
struct is_policy<Mixed<C, S>> : std::true_type {};
template <class D>
struct is_policy<True<D>> : std::true_type {};
template <class R, class S>
struct is_policy<Float8<R, S>> : std::true_type {};
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

template <class P>
inline constexpr bool is_float8_v = false;
template <class R, class S>
inline constexpr bool is_float8_v<Float8<R, S>> = true;

// torchao's rowwise recipes (their own CPU threshold in rules.h).
template <class R>
inline constexpr bool is_rowwise_recipe_v = std::is_same_v<R, Rowwise> || std::is_same_v<R, RowwiseWithGwHp>;

// The block-scaled recipes, MXFP8<Mode> (a valid Mode or not) and NVFP4<SR>.
template <class R>
inline constexpr bool is_block_scaled_recipe_v = false;
template <MxScaleMode Mode>
inline constexpr bool is_block_scaled_recipe_v<MXFP8<Mode>> = true;
template <bool SR>
inline constexpr bool is_block_scaled_recipe_v<NVFP4<SR>> = true;

// A float8 recipe: Tensorwise, Rowwise, RowwiseWithGwHp, Delayed<H, M>
// with H >= 1 and 0 <= M < 64, MXFP8<kRceil or kFloor>, or NVFP4<SR>.
template <class R>
inline constexpr bool is_float8_recipe_v = std::is_same_v<R, Tensorwise> || is_rowwise_recipe_v<R>;
template <MxScaleMode Mode>
inline constexpr bool is_float8_recipe_v<MXFP8<Mode>> = Mode == MxScaleMode::kRceil || Mode == MxScaleMode::kFloor;
template <bool SR>
inline constexpr bool is_float8_recipe_v<NVFP4<SR>> = true;
template <int H, int M>
inline constexpr bool is_float8_recipe_v<Delayed<H, M>> = H >= 1 && M >= 0 && M < 64;

// Whether a policy's region autocasts (Mixed and Float8; True does not).
template <class P>
inline constexpr bool uses_autocast_v = is_mixed_v<P> || is_float8_v<P>;

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
// amp's names (Lightning's "transformer-engine" names a library, not a recipe).
// Every Delayed<H, M> is "fp8-delayed": H and M shape the checkpointed state.
template <class S>
struct policy_name<Float8<Tensorwise, S>> {
  static constexpr const char* value = "fp8-tensorwise";
};
template <int H, int M, class S>
struct policy_name<Float8<Delayed<H, M>, S>> {
  static constexpr const char* value = "fp8-delayed";
};
template <class S>
struct policy_name<Float8<Rowwise, S>> {
  static constexpr const char* value = "fp8-rowwise";
};
template <class S>
struct policy_name<Float8<RowwiseWithGwHp, S>> {
  static constexpr const char* value = "fp8-rowwise-gw-hp";
};
template <MxScaleMode Mode, class S>
struct policy_name<Float8<MXFP8<Mode>, S>> {
  static constexpr const char* value = Mode == MxScaleMode::kFloor ? "mxfp8-floor" : "mxfp8-rceil";
};
template <bool SR, class S>
struct policy_name<Float8<NVFP4<SR>, S>> {
  static constexpr const char* value = SR ? "nvfp4-sr" : "nvfp4";
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
struct float8_parts {
  using recipe = void;
  using scaler = void;
};
template <class R, class S>
struct float8_parts<Float8<R, S>> {
  using recipe = R;
  using scaler = S;
};

template <class P>
using mixed_compute_t = typename mixed_parts<P>::compute;
template <class P>
using mixed_scaler_t = typename mixed_parts<P>::scaler;
template <class P>
using true_dtype_t = typename true_part<P>::dtype;
template <class P>
using float8_recipe_t = typename float8_parts<P>::recipe;
template <class P>
using float8_scaler_t = typename float8_parts<P>::scaler;
// The dtype a policy computes in: Mixed<C, S> -> C, True<D> -> D, Float8 ->
// bf16 (what is not a float8 linear), else void.
template <class P>
using policy_compute_t =
    std::conditional_t<is_mixed_v<P>, mixed_compute_t<P>, std::conditional_t<is_float8_v<P>, bf16, true_dtype_t<P>>>;
// The dtype parameters are kept in: fp32 for Mixed and Float8, D for True<D>, else void.
template <class P>
using policy_param_t = std::conditional_t<uses_autocast_v<P>, fp32, true_dtype_t<P>>;
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
  static constexpr bool uses_loss_scaling = detail::uses_loss_scaling_v<Scaler>;
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

template <class Recipe, class Scaler>
struct policy_traits<Float8<Recipe, Scaler>> {
  using policy = Float8<Recipe, Scaler>;
  using compute_type = detail::policy_compute_t<policy>;  // bf16 for all but the float8 linears
  using param_type = detail::policy_param_t<policy>;      // fp32
  using scaler_type = Scaler;
  using recipe_type = Recipe;
  static constexpr bool uses_autocast = true;
  static constexpr bool uses_loss_scaling = detail::uses_loss_scaling_v<Scaler>;
  static constexpr const char* name = detail::policy_name<policy>::value;
};

}  // namespace amp
