// amp/precision/region.h: Region<Policy, Device>, the scope a forward pass runs in under
// a precision policy, and the static rules for what code inside it may do.
//
//   amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> region;   // autocast to bf16 until '}'
//   auto logits = model->forward(x);                                         // linear/conv in bf16
//   auto loss = region.full_precision([](const at::Tensor& l, const at::Tensor& y) { return my_loss(l, y); }, logits,
//   y);
//
// A Mixed<C, S> region holds an Autocast<C, Device> for its lifetime (LibTorch
// picks each op's dtype: eligible ops in C, sensitive ops in fp32). A True<D>
// region leaves autocast alone: the model itself is in D (Trainer converts
// it); True<tf32> on CUDA holds an AllowTF32 (amp/precision/tf32.h), TF32 math for
// cuBLAS and cuDNN while it lives; those flags are process-wide. Regions are non-copyable and non-movable (they restore
// the thread's autocast state on destruction), so a Trainer hands `Region&` to the user's forward.
//
// Rules (each a trait below, with one static_assert and message):
//  * region.cast<D>(t) inside a Mixed<C, S> region is rejected for a 16-bit D:
//    casting to C by hand fights autocast (which already picks C or fp32 per
//    op), and the other 16-bit dtype mixes fp16 and bf16 in one forward, which
//    makes autocast's promote ops (cat, stack, addcmul, ...) throw. Casts to
//    fp32/fp64 are allowed. In a True<D> region every cast is allowed: no
//    autocast runs, so moving data into the model's dtype is the user's job.
//  * region.autocast<D>(f) inside a Mixed<C, S> region is a no-op for D == C and
//    rejected otherwise; inside a True<D> region it is always rejected (True
//    regions do not autocast: use a Mixed policy).
//  * A Float8<Recipe> region is a Mixed<bf16, NoScaler> region whose routed
//    linears run in float8 (amp/float8/policy.h, which it needs included).
//  * region.full_precision(f, args...) is the sanctioned fp32 island.
//  * At run time (amp/precision/strict_casts.h), a Mixed region also catches raw
//    x.to(torch::kHalf) / x.to(torch::kBFloat16) casts, which no type can see:
//    Region(RegionOptions().strict_casts(amp::StrictCasts::kThrow | kWarn | kOff)).
//  * A Mixed region routes LibTorch's C++ linear layers to aten::linear, so
//    each weight is cast once per region, as in Python (amp/precision/linear_routing.h):
//    Region(RegionOptions().linear_routing(amp::LinearRouting::kOn | kOff)).
//  * A precision map (amp/precision/precision_map.h) runs chosen modules in
//    fp32, bf16 or fp16, or out of float8: Region(RegionOptions().precision_map(map), model).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/precision/autocast.h"
#include "amp/core/device.h"
#include "amp/core/dtype.h"
#include "amp/precision/linear_routing.h"
#include "amp/precision/precision_map.h"
#include "amp/core/policy.h"
#include "amp/precision/strict_casts.h"
#include "amp/precision/tf32.h"
#include "amp/core/rules.h"

namespace amp {
namespace detail {

// Rule: may code inside a Region<P, ...> call region.cast<D>(t)?
template <class P, class D>
inline constexpr bool region_cast_allowed_v = is_dtype_v<D> && (!uses_autocast_v<P> || !is_half_precision_v<D>);

// Rule: may code inside a Region<P, ...> call region.autocast<D>(f)? Only a
// Mixed (or Float8) region to its own compute dtype, where it is a no-op.
template <class P, class D>
inline constexpr bool region_autocast_allowed_v = uses_autocast_v<P>&& std::is_same_v<D, policy_compute_t<P>>;

template <class P, class D>
constexpr bool check_region_cast() {
  using C = policy_compute_t<P>;
  if constexpr (!is_dtype_v<D>) {
    static_assert(is_dtype_v<D>, "amp: Region::cast<D> needs a dtype tag; use e.g. region.cast<amp::fp32>(t)");
    return false;
  } else if constexpr (region_cast_allowed_v<P, D>) {
    return true;
  } else if constexpr (std::is_same_v<C, fp16> && std::is_same_v<D, fp16>) {
    static_assert(
        region_cast_allowed_v<P, D>,
        "amp: manual fp16 casts inside a Mixed<fp16, ...> region are rejected: autocast already runs eligible "
        "ops in fp16 and keeps sensitive ones in fp32; let autocast choose the dtype, or use "
        "region.full_precision(f, x) for an fp32 island");
    return false;
  } else if constexpr (std::is_same_v<C, bf16> && std::is_same_v<D, bf16>) {
    static_assert(
        region_cast_allowed_v<P, D>,
        "amp: manual bf16 casts inside a Mixed<bf16, ...> or Float8 region are rejected: autocast already runs "
        "eligible ops in bf16 (a Float8 region's linears in float8) and keeps sensitive ones in fp32; let autocast "
        "choose the dtype, or use region.full_precision(f, x) for an fp32 island");
    return false;
  } else if constexpr (std::is_same_v<C, bf16>) {
    static_assert(region_cast_allowed_v<P, D>,
                  "amp: manual fp16 casts inside a Mixed<bf16, ...> or Float8 region are rejected: fp16 and bf16 in "
                  "one forward make autocast's promote ops throw; use region.cast<amp::fp32>(t), or let autocast "
                  "choose the dtype");
    return false;
  } else {
    static_assert(region_cast_allowed_v<P, D>,
                  "amp: manual bf16 casts inside a Mixed<fp16, ...> region are rejected: fp16 and bf16 in one forward "
                  "make autocast's promote ops throw; use region.cast<amp::fp32>(t), or let autocast choose the dtype");
    return false;
  }
}

template <class P, class D>
constexpr bool check_region_autocast() {
  using C = policy_compute_t<P>;
  if constexpr (!is_dtype_v<D>) {
    static_assert(is_dtype_v<D>, "amp: Region::autocast<D> needs a dtype tag; use e.g. region.autocast<amp::bf16>(f)");
    return false;
  } else if constexpr (region_autocast_allowed_v<P, D>) {
    return true;
  } else if constexpr (!uses_autocast_v<P>) {
    static_assert(
        region_autocast_allowed_v<P, D>,
        "amp: True<> regions do not autocast: the whole model runs in the policy's dtype; use a Mixed policy, "
        "e.g. amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>, or region.full_precision(f, x) "
        "for an fp32 island");
    return false;
  } else if constexpr (!is_half_precision_v<D>) {
    static_assert(region_autocast_allowed_v<P, D>,
                  "amp: a nested autocast to fp32/fp64/tf32 inside a Mixed<...> region is rejected: autocast computes "
                  "only in fp16 or bf16; use region.full_precision(f, x) for an fp32 island");
    return false;
  } else if constexpr (std::is_same_v<C, bf16>) {
    static_assert(region_autocast_allowed_v<P, D>,
                  "amp: a nested autocast to fp16 inside a Mixed<bf16, ...> region is rejected: fp16 and bf16 in one "
                  "forward make autocast's promote ops throw; call f(x) directly (the region already autocasts to "
                  "bf16), or use region.full_precision(f, x) for an fp32 island");
    return false;
  } else {
    static_assert(region_autocast_allowed_v<P, D>,
                  "amp: a nested autocast to bf16 inside a Mixed<fp16, ...> region is rejected: fp16 and bf16 in one "
                  "forward make autocast's promote ops throw; call f(x) directly (the region already autocasts to "
                  "fp16), or use region.full_precision(f, x) for an fp32 island");
    return false;
  }
}

// As torch.amp.custom_fwd(cast_inputs=torch.float32)'s _cast: floating-point
// tensors on the autocast device go to fp32, fp64 ones are left alone (never
// narrowed), everything else passes through untouched.
inline at::Tensor to_full_precision(const at::Tensor& t, c10::DeviceType device) {
  if (t.defined() && t.is_floating_point() && t.device().type() == device && t.scalar_type() != c10::ScalarType::Double)
    return t.to(c10::ScalarType::Float);
  return t;
}

template <class T>
decltype(auto) full_precision_arg(T&& x, c10::DeviceType device) {
  using U = std::remove_cv_t<std::remove_reference_t<T>>;
  if constexpr (std::is_same_v<U, at::Tensor>) {
    return to_full_precision(x, device);
  } else if constexpr (std::is_same_v<U, std::vector<at::Tensor>>) {
    std::vector<at::Tensor> out;
    out.reserve(x.size());
    for (const at::Tensor& t : x) out.push_back(to_full_precision(t, device));
    return out;
  } else {
    return std::forward<T>(x);
  }
}

}  // namespace detail

// What a region does besides autocasting: the options every entry point that
// makes regions takes (Region itself, TrainerOptions::region,
// FabricOptions::region), so each is honoured wherever a region is made.
struct RegionOptions {
  // What a raw x.to(torch::kHalf / kBFloat16) in a Mixed region does
  // (amp/precision/strict_casts.h): kThrow, kWarn or kOff.
  TORCH_ARG(StrictCasts, strict_casts) = detail::kDefaultStrictCasts;
  // Whether LibTorch's C++ linear layers cast each weight once per region, as
  // Python's nn.Linear does (amp/precision/linear_routing.h). Mixed policies
  // only; a Float8 region runs its linears through it, so it must stay on.
  TORCH_ARG(LinearRouting, linear_routing) = LinearRouting::kOn;
  // Modules that run in another precision (amp/precision/precision_map.h):
  // Mixed and Float8 policies, with linear routing on.
  TORCH_ARG(PrecisionMap, precision_map) = {};
};

namespace detail {
// The precision map's rules that depend on the policy and the device, as amp: errors.
template <class Policy, class Device>
void check_precision_map(const RegionOptions& options) {
  const PrecisionMap& map = options.precision_map();
  if (map.empty()) return;
  const char* name = policy_traits<Policy>::name;
  TORCH_CHECK(uses_autocast_v<Policy>, "amp: a precision map needs a policy that autocasts (Mixed or Float8), and ",
              name, " runs the whole model in one dtype; use a Mixed policy, or convert the module yourself");
  TORCH_CHECK(options.linear_routing() == LinearRouting::kOn,
              "amp: a precision map runs on linear routing's dispatch key; leave RegionOptions::linear_routing on");
  TORCH_CHECK(is_float8_v<Policy> || !map.maps_to(ModulePrecision::kNotFloat8),
              "amp: the precision map has "
              "ModulePrecision::kNotFloat8 entries, but ",
              name, " runs no linear in float8; drop them");
  if constexpr (std::is_same_v<Device, CPU>) {
    TORCH_CHECK(compat::kCpuHasFp16 || !map.maps_to(ModulePrecision::kFp16),
                "amp: the precision map maps a module to fp16, but CPU autocast to fp16 needs LibTorch 2.3 or newer; "
                "map it to kBf16 or kFp32");
  }
}
}  // namespace detail

namespace detail {
// What a Float8 region installs for its recipe, specialized in
// amp/float8/policy.h (the float8 layer sits above this one).
template <class Recipe>
struct Float8RegionGuard {
  static_assert(dependent_false_v<Recipe>,
                "amp: a Float8 region needs the float8 code: #include <amp/float8/policy.h> (or <amp/amp.h>)");
};
}  // namespace detail

template <class Policy, class Device>
class Region {
  static_assert(detail::check_supported<Policy, Device>());

 public:
  using policy = Policy;
  using device = Device;
  using compute_type = detail::policy_compute_t<Policy>;  // Mixed<C, S> -> C; True<D> -> D
  using param_type = detail::policy_param_t<Policy>;      // Mixed -> fp32; True<D> -> D
  // Compile-time, for `if constexpr (R::compute_dtype == c10::kBFloat16)`.
  // tf32 is fp32 storage, so True<tf32> has compute_dtype Float.
  static constexpr c10::ScalarType compute_dtype = detail::scalar_type_or_undefined<compute_type>();
  static constexpr c10::ScalarType param_dtype = detail::scalar_type_or_undefined<param_type>();
  static constexpr c10::DeviceType device_type = detail::device_type_or_cpu<Device>();
  static constexpr bool uses_autocast = detail::uses_autocast_v<Policy>;

  // The options (RegionOptions: strict casts, linear routing); a precision
  // map needs the model to resolve it against (the next constructor).
  explicit Region(const RegionOptions& options = {}) : Region(options, PrecisionMap::Resolved()) {
    TORCH_CHECK(options.precision_map().empty(),
                "amp: a Region with a precision map needs the model to resolve it against: Region(options, model)");
  }
  // With the options' precision map resolved against `model` (its
  // named_modules() names; cached in the map while the model's parameter count holds).
  Region(const RegionOptions& options, const torch::nn::Module& model)
      : Region(options, resolved(options, {{"", &model}})) {}
  // With a map already resolved (map.resolve(...); Trainer and Fabric resolve theirs once).
  Region(const RegionOptions& options, PrecisionMap::Resolved table)
      : guard_(/*enabled=*/true, /*cache_enabled=*/std::nullopt, checked_routing(options.linear_routing())),
        strict_mode_(options.strict_casts()),
        strict_(options.strict_casts(), device_type, compute_dtype),
        routing_mode_(options.linear_routing()) {
    if (table != nullptr) {
      detail::check_precision_map<Policy, Device>(options);
      map_.install(std::move(table));
    }
  }
  // User-provided on purpose: `amp::Region<amp::True<amp::fp64>, amp::CPU> region;`
  // around user code must not trip -Wunused-variable (an inert region would
  // otherwise be trivially destructible, which is what that warning looks for).
  ~Region() {}
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  Region(Region&&) = delete;
  Region& operator=(Region&&) = delete;

  // Runs f(args...) with autocast off on Device and each floating-point
  // at::Tensor argument (also inside a std::vector<at::Tensor>) on Device cast
  // to fp32 (fp64 stays fp64); other arguments are forwarded unchanged.
  // Returns f's result as is. Autocast state comes back when f returns or throws.
  template <class F, class... Args>
  decltype(auto) full_precision(F&& f, Args&&... args) const {
    AutocastDisabled<Device> island;
    return std::invoke(std::forward<F>(f), detail::full_precision_arg(std::forward<Args>(args), device_type)...);
  }

  // t.to(D), where the policy allows it (see region_cast_allowed_v).
  template <class D>
  at::Tensor cast(const at::Tensor& t) const {
    static_assert(detail::check_region_cast<Policy, D>());
    return t.to(detail::scalar_type_or_undefined<D>());
  }

  // The strict-casts mode this region was created with (kOff for True<> regions).
  StrictCasts strict_casts() const { return uses_autocast ? strict_mode_ : StrictCasts::kOff; }

  // The linear routing this region was created with (kOff for True<> regions).
  LinearRouting linear_routing() const { return uses_autocast ? routing_mode_ : LinearRouting::kOff; }

  // Nested autocast: in a Mixed<C, S> region, autocast<C>(f, args...) just calls
  // f (the region already autocasts to C); any other use is a compile error.
  template <class D, class F, class... Args>
  decltype(auto) autocast(F&& f, Args&&... args) const {
    static_assert(detail::check_region_autocast<Policy, D>());
    return std::invoke(std::forward<F>(f), std::forward<Args>(args)...);
  }

 private:
  struct Inert {};
  struct InertAutocast {
    InertAutocast(bool, std::optional<bool>, LinearRouting) {}
  };
  // Only a supported Mixed policy names an Autocast (which also routes the
  // linears, with the region's LinearRouting), so an unsupported one prints
  // check_supported's message and nothing else.
  using guard_type = std::conditional_t<uses_autocast && is_supported_v<Policy, Device>, Autocast<compute_type, Device>,
                                        InertAutocast>;
  struct InertStrict {
    InertStrict(StrictCasts, c10::DeviceType, c10::ScalarType) {}
  };
  using strict_type =
      std::conditional_t<uses_autocast && is_supported_v<Policy, Device>, detail::StrictCastsGuard, InertStrict>;

  using tf32_type =
      std::conditional_t<std::is_same_v<Policy, True<tf32>> && std::is_same_v<Device, CUDA>, AllowTF32, Inert>;

  // A Float8 policy's recipe guard (detail::Float8RegionGuard, amp/float8/policy.h).
  using float8_type = std::conditional_t<detail::is_float8_v<Policy> && is_supported_v<Policy, Device>,
                                         detail::Float8RegionGuard<detail::float8_recipe_t<Policy>>, Inert>;

  static PrecisionMap::Resolved resolved(const RegionOptions& options,
                                         const std::vector<std::pair<std::string, const torch::nn::Module*>>& models) {
    if (options.precision_map().empty()) return nullptr;
    detail::check_precision_map<Policy, Device>(options);
    return options.precision_map().resolve(models);
  }

  static LinearRouting checked_routing(LinearRouting mode) {
    TORCH_CHECK(!detail::is_float8_v<Policy> || mode == LinearRouting::kOn, "amp: a ", policy_traits<Policy>::name,
                " region runs its linears in float8 through linear routing; LinearRouting::kOff is not available "
                "for Float8 policies (leave TrainerOptions::linear_routing on)");
    return mode;
  }

  [[maybe_unused]] guard_type guard_;
  [[maybe_unused]] tf32_type tf32_;
  StrictCasts strict_mode_;
  // After guard_: checking starts once autocast is on and stops before it is off.
  [[maybe_unused]] strict_type strict_;
  LinearRouting routing_mode_;
  // After guard_: the linears it routes go to float8 while both live.
  [[maybe_unused]] float8_type float8_;
  // After guard_: mapped ops run in their module's precision while routing is on.
  detail::PrecisionMapGuard map_;
};

}  // namespace amp
