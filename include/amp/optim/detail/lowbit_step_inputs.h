// amp/optim/detail/lowbit_step_inputs.h: what a low-bit Adam's step takes
// besides its state: GradScaler's inverse scale and skip flag once per device,
// and torchao's stochastic rounding of fp32 to bf16.
//
//   detail::lowbit::DeviceFlags flags(grad_scale, found_inf);
//   at::Tensor inv = flags.inv_scale(param.device());   // undefined without a scaler
#pragma once

#include <ATen/ATen.h>

#include <utility>

#include "amp/detail/per_device.h"

namespace amp {
namespace detail {
namespace lowbit {

// torchao's _fp32_to_bf16_sr: round away from zero with probability (low 16
// bits) / 2^16, from 16 random bits per element.
inline at::Tensor fp32_to_bf16_sr(const at::Tensor& x) {
  const at::Tensor rand_16bit = at::randint(0, 1 << 16, x.sizes(), x.options().dtype(at::kInt));
  const at::Tensor bits = x.view(at::kInt);
  const at::Tensor fraction = at::bitwise_and(bits, 0xFFFF);
  const at::Tensor towards_zero = at::bitwise_and(bits, static_cast<int64_t>(0xFFFF0000LL));
  return at::where(rand_16bit < fraction, towards_zero + 0x10000, towards_zero).view(at::kFloat).to(at::kBFloat16);
}

// grad_scale's reciprocal and found_inf's "skip", once per device.
class DeviceFlags {
 public:
  DeviceFlags(at::Tensor grad_scale, at::Tensor found_inf)
      : grad_scale_(std::move(grad_scale)), found_inf_(std::move(found_inf)) {}
  // torch's unscale_: inv_scale = scale.double().reciprocal().float().
  at::Tensor inv_scale(const c10::Device& d) {
    if (!grad_scale_.defined()) return at::Tensor();
    return inv_.get(d, [&] {
      return grad_scale_.reshape({}).to(at::kDouble).reciprocal().to(at::kFloat).to(d, /*non_blocking=*/true);
    });
  }
  // 0-dim bool, true: keep everything as it was (found_inf nonzero).
  at::Tensor keep(const c10::Device& d) {
    if (!found_inf_.defined()) return at::Tensor();
    return keep_.get(d, [&] { return (found_inf_.reshape({}) != 0).to(d, /*non_blocking=*/true); });
  }

 private:
  at::Tensor grad_scale_, found_inf_;
  PerDevice inv_, keep_;
};

}  // namespace lowbit
}  // namespace detail

}  // namespace amp
