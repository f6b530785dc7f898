// amp/precision/strict_casts.h: strict casts — a run-time check that catches manual
// fp16/bf16 casts (x.to(torch::kHalf), x.to(torch::kBFloat16), x.to(other))
// inside a mixed region, where no type system can see them.
//
//   using R = amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>;
//   R region(amp::RegionOptions().strict_casts(amp::StrictCasts::kThrow));
//   auto y = model->forward(x);          // fine: autocast's own casts are never flagged
//   auto h = x.to(torch::kBFloat16);     // throws c10::Error "amp: manual cast to BFloat16 ..."
//
// Why: a hand-written 16-bit cast inside a Mixed region fights autocast (it
// narrows what autocast keeps in fp32, or mixes fp16 and bf16). While a strict
// region lives, a boxed fallback on a TLS-included dispatch key
// (TESTING_ONLY_GenericMode) sees only the ops the user's code calls itself
// and checks its casts to fp16/bf16; autocast's casts, full_precision islands
// and backward() pass. Modes: kThrow (c10::Error), kWarn (once per dtype
// pair), kOff. docs/regions.md ("Strict casts") tells the limits,
// docs/maintainers.md ("How strict casts work") the mechanism.
//
// The default, kDefaultStrictCasts, is one build-wide setting:
// AMP_STRICT_CASTS_DEFAULT (kThrow, kWarn or kOff; kThrow when unset), which
// the amp::amp CMake target and the Bazel //:amp library define for every TU.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceType.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/ScalarType.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "amp/detail/compat_ops.h"
#include "amp/detail/thread_state_guard.h"
#include "amp/precision/detail/autocast_tls.h"
#include "amp/core/dtype.h"

namespace amp {

// What a mixed region does about a manual cast to a 16-bit floating dtype.
enum class StrictCasts : std::uint8_t {
  kOff,    // nothing is checked
  kWarn,   // TORCH_WARN once per (target dtype, region dtype), the cast runs
  kThrow,  // c10::Error with an `amp:` message, the cast does not run
};

// Build-wide, not per TU (unlike NDEBUG): every TU of a program must see the
// same value, since it is a default inside TrainerOptions and Region.
#ifndef AMP_STRICT_CASTS_DEFAULT
#define AMP_STRICT_CASTS_DEFAULT kThrow
#endif

namespace detail {
inline constexpr StrictCasts kDefaultStrictCasts = StrictCasts::AMP_STRICT_CASTS_DEFAULT;

inline const char* to_string(StrictCasts mode) {
  switch (mode) {
    case StrictCasts::kOff:
      return "off";
    case StrictCasts::kWarn:
      return "warn";
    case StrictCasts::kThrow:
      return "throw";
  }
  return "?";
}

inline constexpr c10::DispatchKey kStrictCastsKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

// The innermost strict region of this thread (mode kOff: none).
struct StrictCastsState {
  StrictCasts mode = StrictCasts::kOff;
  c10::DeviceType device = c10::DeviceType::CPU;
  c10::ScalarType compute = c10::ScalarType::Undefined;
};

inline StrictCastsState& strict_casts_state() {
  static thread_local StrictCastsState state;
  return state;
}

// (target dtype, region compute dtype) pairs already warned about.
struct StrictCastsWarned {
  std::mutex mutex;
  std::set<std::pair<c10::ScalarType, c10::ScalarType>> seen;
};
inline StrictCastsWarned& strict_casts_warned() {
  static StrictCastsWarned warned;
  return warned;
}

// Forgets which casts were warned about, so kWarn warns again (for tests).
inline void reset_strict_casts_warnings() {
  auto& w = strict_casts_warned();
  std::lock_guard<std::mutex> lock(w.mutex);
  w.seen.clear();
}

inline std::string strict_casts_message(const std::string& op, c10::ScalarType from, c10::ScalarType to,
                                        const StrictCastsState& s, const char* verdict) {
  const char* torch_name = to == c10::ScalarType::Half ? "torch::kHalf" : "torch::kBFloat16";
  return "amp: manual cast to " + std::string(c10::toString(to)) + " (" + op + " from " + c10::toString(from) +
         ", e.g. x.to(" + torch_name + ")) inside a Mixed<" + dtype_name(s.compute) + ", ...> region on " +
         c10::DeviceTypeName(s.device, true) + " " + verdict +
         " by strict casts: autocast already runs eligible ops in " + dtype_name(s.compute) +
         " and keeps sensitive ones in fp32; let autocast choose the dtype (drop the cast), use "
         "region.full_precision(f, x) for an fp32 island, or cast outside the region";
}

// The operators through which user code changes a tensor's dtype: every
// Tensor::to overload, type_as, and _to_copy called directly.
inline bool is_cast_op(const c10::OperatorHandle& op) {
  const std::string& name = op.schema().name();
  return name == "aten::to" || name == "aten::_to_copy" || name == "aten::type_as";
}

// Checks one cast op called by user code; throws or warns per the mode.
inline void check_user_cast(const c10::OperatorHandle& op, const torch::jit::Stack& stack, const StrictCastsState& s) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t first = stack.size() - schema.arguments().size();
  const c10::IValue& self = stack[first];
  if (!self.isTensor()) return;
  const at::Tensor& t = self.toTensor();
  c10::optional<c10::ScalarType> to;
  if (const auto dtype = schema.argumentIndexWithName("dtype")) {
    const c10::IValue& v = stack[first + *dtype];
    if (!v.isNone()) to = v.toScalarType();
  } else if (const auto other = schema.argumentIndexWithName("other")) {
    const c10::IValue& v = stack[first + *other];
    if (v.isTensor()) to = v.toTensor().scalar_type();
  }
  if (!to || !is_half_precision(*to) || t.scalar_type() == *to || t.device().type() != s.device ||
      autocast_dispatch_excluded(s.device) || compat::inside_autograd_backward()) {
    return;
  }
  std::string name = schema.name();
  if (!schema.overload_name().empty()) name += "." + schema.overload_name();
  if (s.mode == StrictCasts::kThrow) {
    TORCH_CHECK(false, strict_casts_message(name, t.scalar_type(), *to, s, "is rejected"));
  }
  bool first_time = false;
  {
    auto& w = strict_casts_warned();
    std::lock_guard<std::mutex> lock(w.mutex);
    first_time = w.seen.insert({*to, s.compute}).second;
  }
  if (first_time) TORCH_WARN(strict_casts_message(name, t.scalar_type(), *to, s, "is discouraged"));
}

// The fallback amp registers for every operator on kStrictCastsKey. It sees
// only the ops the user's code calls itself: while one runs, the key is
// excluded, so the ops it calls in turn (TensorIterator's type-promotion
// casts, autocast's casts, a composite's pieces) never reach it. That is what
// makes `bf16_out * 2` (a Long scalar cast to bf16 inside mul) legal and
// `x.to(torch::kBFloat16)` not.
inline void strict_casts_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const StrictCastsState& s = strict_casts_state();
  if (s.mode != StrictCasts::kOff && is_cast_op(op)) check_user_cast(op, *stack, s);
  c10::impl::ExcludeDispatchKeyGuard nested(kStrictCastsKey);
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kStrictCastsKey), stack);
}

// Registers the fallback once per process.
inline void register_strict_casts_kernels() {
  static const bool registered = [] {
    TORCH_CHECK(!c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kStrictCastsKey),
                "amp: strict casts need the dispatch key TESTING_ONLY_GenericMode, but this program already "
                "registered a fallback for it; turn strict casts off (amp::StrictCasts::kOff)");
    static torch::Library fallback(torch::Library::IMPL, "_", kStrictCastsKey, __FILE__, __LINE__);
    fallback.fallback(torch::CppFunction::makeFromBoxedFunction<&strict_casts_fallback>());
    return true;
  }();
  (void)registered;
}

// RAII: this thread's casts are checked under `mode` until the guard dies;
// the enclosing state (an outer strict region, or none) comes back after.
class StrictCastsGuard {
 public:
  StrictCastsGuard(StrictCasts mode, c10::DeviceType device, c10::ScalarType compute)
      : guard_(strict_casts_state(), checked(mode, device, compute), mode != StrictCasts::kOff) {}

 private:
  static StrictCastsState checked(StrictCasts mode, c10::DeviceType device, c10::ScalarType compute) {
    if (mode != StrictCasts::kOff) register_strict_casts_kernels();
    return StrictCastsState{mode, device, compute};
  }
  ThreadStateGuard<StrictCastsState, kStrictCastsKey> guard_;
};

// Whether strict casts are checking this thread's casts now, and how.
inline StrictCasts current_strict_casts() { return strict_casts_state().mode; }
}  // namespace detail

}  // namespace amp
