// amp/device.h: device tags CPU and CUDA.
//
//   using Dev = amp::CPU;
//   torch::Device d = amp::device_traits<Dev>::device();   // kCPU
//   static_assert(amp::is_device_v<amp::CUDA>);
//
// What each device supports (per LibTorch version) is decided in traits.h.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>

#include <type_traits>

namespace amp {

struct CPU {};
struct CUDA {};

template <class Dev>
struct device_traits;

template <>
struct device_traits<CPU> {
  static constexpr c10::DeviceType device_type = c10::DeviceType::CPU;
  static constexpr const char* name = "cpu";
  static c10::Device device() { return c10::Device(c10::DeviceType::CPU); }
};
template <>
struct device_traits<CUDA> {
  static constexpr c10::DeviceType device_type = c10::DeviceType::CUDA;
  static constexpr const char* name = "cuda";
  static c10::Device device() { return c10::Device(c10::DeviceType::CUDA); }
};

template <class Dev>
inline constexpr bool is_device_v = std::is_same_v<Dev, CPU> || std::is_same_v<Dev, CUDA>;

}  // namespace amp
