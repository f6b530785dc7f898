// amp/detail/per_device.h: tensors made once per device and reused, as
// torch's _MultiDeviceReplicator and the fused optimizers' grad_scale_dict /
// found_inf_dict keep them (the GradScaler's scale per device, a step's flags).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <utility>
#include <vector>

namespace amp {
namespace detail {

class PerDevice {
 public:
  // The tensor for `device`: made by make() (already on `device`) the first time.
  template <class Make>
  const at::Tensor& get(const c10::Device& device, Make&& make) {
    for (const auto& entry : cache_)
      if (entry.first == device) return entry.second;
    cache_.emplace_back(device, make());
    return cache_.back().second;
  }
  // `master` copied to `device` (non_blocking), once.
  const at::Tensor& copy(const at::Tensor& master, const c10::Device& device) {
    return get(device, [&] { return master.to(device, /*non_blocking=*/true); });
  }

 private:
  std::vector<std::pair<c10::Device, at::Tensor>> cache_;
};

}  // namespace detail
}  // namespace amp
