// amp/precision/autocast.h: Autocast<Dtype, Device> and AutocastDisabled<Device>, RAII
// guards over LibTorch's autocast state (the C++ form of `with torch.autocast(...)`),
// and autocast<Dtype, Device>(fn), the same guard around one call.
//
//   {
//     amp::Autocast<amp::bf16, amp::CPU> autocast;   // with torch.autocast("cpu", torch.bfloat16):
//     auto y = model->forward(x);                    //   linear/matmul/conv run in bf16, losses in fp32
//   }                                                // previous state restored, cast cache dropped
//
// The guards mirror torch.amp.autocast.__enter__/__exit__ step by step:
//   enter: save (enabled, dtype) of the device and the cache flag; set enabled,
//          set dtype, increment the nesting counter, set the cache flag.
//   exit:  decrement the nesting counter and clear the cast cache when it
//          reaches 0 (only the outermost guard drops the cached weight casts),
//          then restore enabled, dtype and the cache flag.
// So nested guards behave as nested `with` blocks, and an exception leaving the
// scope restores everything (the destructor runs during unwinding).
//
// Thread-locality (measured on LibTorch 1.13, CPU; tests/precision/autocast_test.cc
// checks it): the enabled flags (dispatch-key TLS), the dtypes, the cache flag,
// the nesting counter and the cast cache are all per thread. A guard in one
// thread does not change the dtype of ops in another, and a new std::thread
// starts with autocast off and default dtypes even when its parent is inside a
// guard: threads you spawn inside a region need their own guard.
//
// Autocast needs no GPU to be constructed: Autocast<fp16, CUDA> only sets
// CUDA's thread-local autocast state. Unlike torch.autocast("cuda",
// torch.bfloat16) it does not check torch.cuda.is_bf16_supported(); that is the
// caller's (Trainer's) job, since the check needs CUDA headers.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <type_traits>

#include "amp/detail/compat_ops.h"
#include "amp/core/device.h"
#include "amp/core/dtype.h"
#include "amp/core/rules.h"
#include "amp/precision/linear_routing.h"

namespace amp {
namespace detail {

// Scalar and device types that never fail to instantiate, so that a rejected
// Autocast<int, CPU> prints only its `amp:` message, not a second error.
template <class D>
constexpr c10::ScalarType scalar_type_or_undefined() {
  if constexpr (is_dtype_v<D>) {
    return scalar_type_v<D>;
  } else {
    return c10::ScalarType::Undefined;
  }
}
template <class Dev>
constexpr c10::DeviceType device_type_or_cpu() {
  if constexpr (is_device_v<Dev>) {
    return device_traits<Dev>::device_type;
  } else {
    return c10::DeviceType::CPU;
  }
}

// The untyped guard both public guards are built on. `dtype` is nullopt for
// autocast(enabled=False) without a dtype: torch then re-sets the current one.
class AutocastState {
 public:
  AutocastState(c10::DeviceType device, bool enabled, std::optional<c10::ScalarType> dtype,
                std::optional<bool> cache_enabled)
      : device_(device),
        prev_enabled_(compat::autocast_enabled(device)),
        prev_dtype_(compat::autocast_dtype(device)),
        prev_cache_enabled_(compat::autocast_cache_enabled()) {
    // Set the dtype first: it is the only call that can throw (1.13 CPU rejects
    // anything but bf16), and when it does nothing has been changed yet, so a
    // constructor that throws leaves the thread's state as it found it.
    compat::set_autocast_dtype(device_, dtype.value_or(prev_dtype_));
    compat::set_autocast_enabled(device_, enabled);
    compat::autocast_increment_nesting();
    // torch.autocast(cache_enabled=None) keeps the current flag.
    compat::set_autocast_cache_enabled(cache_enabled.value_or(prev_cache_enabled_));
  }

  ~AutocastState() {
    // As torch.autocast.__exit__: drop cached casts only when leaving the
    // outermost autocast block, so that an inner block does not throw away the
    // outer one's weight casts, and the next region re-casts updated weights.
    if (compat::autocast_decrement_nesting() == 0) compat::clear_autocast_cache();
    compat::set_autocast_enabled(device_, prev_enabled_);
    compat::set_autocast_dtype(device_, prev_dtype_);
    compat::set_autocast_cache_enabled(prev_cache_enabled_);
  }

  AutocastState(const AutocastState&) = delete;
  AutocastState& operator=(const AutocastState&) = delete;
  AutocastState(AutocastState&&) = delete;
  AutocastState& operator=(AutocastState&&) = delete;

 private:
  c10::DeviceType device_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_cache_enabled_;
};

// Autocast's weight-cast cache off for the scope: a captured step's cached
// cast would be recorded once and never redone (replaying stale weights);
// amp::checkpoint's forward without autograd would cache casts without history.
class AutocastCacheOff {
 public:
  AutocastCacheOff() : was_(compat::autocast_cache_enabled()) { compat::set_autocast_cache_enabled(false); }
  ~AutocastCacheOff() { compat::set_autocast_cache_enabled(was_); }
  AutocastCacheOff(const AutocastCacheOff&) = delete;
  AutocastCacheOff& operator=(const AutocastCacheOff&) = delete;

 private:
  bool was_;
};

}  // namespace detail

// Autocast<Dtype, Device>: eligible ops on Device run in Dtype (fp16 or bf16)
// for the guard's lifetime, and LibTorch's C++ linear layers are routed to
// aten::linear so that each weight is cast once per region, as Python's
// nn.Linear is (amp/precision/linear_routing.h; LinearRouting::kOff: LibTorch's
// own ops, a cast per call). Non-copyable and non-movable: it restores the
// state of the thread and scope it was created in.
//
//   amp::Autocast<amp::bf16, amp::CPU> on;                   // enabled, linears routed
//   amp::Autocast<amp::bf16, amp::CPU> off(/*enabled=*/false);  // torch.autocast(..., enabled=False)
//   amp::Autocast<amp::bf16, amp::CPU> nocache(true, /*cache_enabled=*/false);
//   amp::Autocast<amp::bf16, amp::CPU> unrouted(amp::LinearRouting::kOff);
template <class Dtype, class Device>
class Autocast {
  static_assert(detail::check_autocast<Dtype, Device>());

 public:
  using dtype = Dtype;
  using device = Device;
  static constexpr c10::ScalarType scalar_type = detail::scalar_type_or_undefined<Dtype>();
  static constexpr c10::DeviceType device_type = detail::device_type_or_cpu<Device>();

  // enabled=false is torch.autocast(enabled=False): the dtype is still set and
  // the nesting counted, but ops run in their own dtypes. cache_enabled unset
  // keeps the thread's current cache flag, as torch's cache_enabled=None.
  explicit Autocast(bool enabled = true, std::optional<bool> cache_enabled = std::nullopt,
                    LinearRouting linear_routing = LinearRouting::kOn)
      : state_(device_type, enabled, scalar_type, cache_enabled),
        enabled_(enabled),
        routing_(enabled ? linear_routing : LinearRouting::kOff, device_type) {}
  explicit Autocast(LinearRouting linear_routing) : Autocast(true, std::nullopt, linear_routing) {}

  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;
  Autocast(Autocast&&) = delete;
  Autocast& operator=(Autocast&&) = delete;

  // Whether this guard turned autocast on (the constructor's `enabled`).
  bool enabled() const { return enabled_; }

 private:
  detail::AutocastState state_;
  bool enabled_;
  // After state_: routing starts once autocast is on and stops before it is off.
  detail::LinearRoutingGuard routing_;
};

// The function form: fn() under Autocast<Dtype, Device>, returning what fn
// returns (the autocast state comes back when fn returns or throws).
//
//   auto logits = amp::autocast<amp::bf16, amp::CPU>([&] { return model->forward(x); });
template <class Dtype, class Device, class F>
decltype(auto) autocast(F&& fn) {
  static_assert(std::is_invocable_v<F&>, "amp: autocast<Dtype, Device>(fn) calls fn(); pass [&] { return model(x); }");
  Autocast<Dtype, Device> guard;
  return fn();
}

// AutocastDisabled<Device>: torch.autocast(device, enabled=False) — ops on
// Device run in their own dtypes for the guard's lifetime (an fp32 island
// inside a mixed region), then the enclosing autocast state comes back.
//
//   amp::Autocast<amp::bf16, amp::CPU> outer;
//   { amp::AutocastDisabled<amp::CPU> island; auto p = torch::softmax(logits.to(torch::kFloat), 1); }
template <class Device>
class AutocastDisabled {
  static_assert(detail::is_device_v<Device>,
                "amp: AutocastDisabled<Device> needs a device tag; use amp::AutocastDisabled<amp::CPU> or "
                "amp::AutocastDisabled<amp::CUDA>");

 public:
  using device = Device;
  static constexpr c10::DeviceType device_type = detail::device_type_or_cpu<Device>();

  AutocastDisabled() : state_(device_type, /*enabled=*/false, std::nullopt, std::nullopt) {}

  AutocastDisabled(const AutocastDisabled&) = delete;
  AutocastDisabled& operator=(const AutocastDisabled&) = delete;
  AutocastDisabled(AutocastDisabled&&) = delete;
  AutocastDisabled& operator=(AutocastDisabled&&) = delete;

 private:
  detail::AutocastState state_;
};

}  // namespace amp
