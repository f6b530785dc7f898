// amp/core/device.h: device tags CPU and CUDA, and device_traits: everything amp
// knows about a device, in one place.
//
//   using Dev = amp::CUDA;
//   static_assert(amp::device_traits<Dev>::device_type == c10::DeviceType::CUDA);
//   std::cout << amp::device_traits<Dev>::tag;              // "amp::CUDA" (for messages)
//   bool ok = amp::device_traits<Dev>::available();        // a CUDA device is visible
//
// Adding a device (XPU, MPS, ...) is one device_traits specialization, its
// entry in amp::detail::all_devices, and its rows in rules.h's support matrix;
// everything else (messages, kernel choice, autocast keys) is derived.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <tuple>
#include <type_traits>

#include "amp/detail/compat.h"

namespace amp {

struct CPU {};
struct CUDA {};

// Primary template undefined: a type is a device exactly when it has traits.
template <class Dev>
struct device_traits;

template <>
struct device_traits<CPU> {
  static constexpr c10::DeviceType device_type = c10::DeviceType::CPU;
  static constexpr c10::DispatchKey autocast_key = c10::DispatchKey::AutocastCPU;
  static constexpr const char* name = "cpu";      // torch.device's spelling
  static constexpr const char* tag = "amp::CPU";  // the tag, as a user writes it
  static constexpr const char* torch_name = "torch::kCPU";
  // _amp_foreach_non_finite_check_and_unscale_ and _amp_update_scale_ run here.
  static constexpr bool has_amp_kernels = detail::compat::kCpuHasAmpKernels;
  static c10::Device device() { return c10::Device(device_type); }
  static bool available() { return true; }
};

template <>
struct device_traits<CUDA> {
  static constexpr c10::DeviceType device_type = c10::DeviceType::CUDA;
  static constexpr c10::DispatchKey autocast_key = c10::DispatchKey::AutocastCUDA;
  static constexpr const char* name = "cuda";
  static constexpr const char* tag = "amp::CUDA";
  static constexpr const char* torch_name = "torch::kCUDA";
  static constexpr bool has_amp_kernels = true;
  static c10::Device device() { return c10::Device(device_type); }
  // LibTorch built with CUDA (its device guard is registered) and a GPU visible.
  static bool available() {
    return c10::impl::hasDeviceGuardImpl(device_type) && c10::impl::getDeviceGuardImpl(device_type)->deviceCount() > 0;
  }
};

namespace detail {
// Every device tag amp knows, for run-time lookups by c10::DeviceType.
using all_devices = std::tuple<CPU, CUDA>;

template <class Dev, class = void>
struct is_device_impl : std::false_type {};
template <class Dev>
struct is_device_impl<Dev, std::void_t<decltype(device_traits<Dev>::device_type)>> : std::true_type {};
template <class Dev>
inline constexpr bool is_device_v = is_device_impl<Dev>::value;

template <class... Devs>
constexpr bool has_amp_kernels_in(c10::DeviceType type, std::tuple<Devs...>*) {
  return ((type == device_traits<Devs>::device_type && device_traits<Devs>::has_amp_kernels) || ...);
}
template <class... Devs>
constexpr c10::DispatchKey autocast_key_in(c10::DeviceType type, std::tuple<Devs...>*) {
  c10::DispatchKey key = c10::DispatchKey::Undefined;
  ((type == device_traits<Devs>::device_type ? (key = device_traits<Devs>::autocast_key, true) : false) || ...);
  return key;
}

// Whether the GradScaler kernels run on tensors of `type`. A device amp has no
// tag for takes the portable path, which is made of ordinary ATen ops.
constexpr bool has_amp_kernels(c10::DeviceType type) {
  return has_amp_kernels_in(type, static_cast<all_devices*>(nullptr));
}

// The autocast dispatch key of `type`; Undefined for a device amp has no tag for.
constexpr c10::DispatchKey autocast_key(c10::DeviceType type) {
  return autocast_key_in(type, static_cast<all_devices*>(nullptr));
}
}  // namespace detail

}  // namespace amp
