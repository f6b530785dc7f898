// amp/scaler/detail/unscale.h: unscaling gradients and checking them for inf/NaN.
//
//   amp::detail::non_finite_check_and_unscale_(grads, found_inf, inv_scale);  // no host sync
//
// ATen's _amp_foreach_non_finite_check_and_unscale_ where the device has it
// (amp::detail::has_amp_kernels), else a portable path made of ordinary ATen ops
// that gives the kernels' bits for every finite and infinite value and the
// same found-inf flag. NaN payloads are not promised (docs/numerics.md).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "amp/core/device.h"

namespace amp {
namespace detail {

// --- portable kernels --------------------------------------------------------

// The portable unscale reads each gradient twice (check, then multiply), as
// 1.13 has no fused op. To keep that near one pass over memory, a big
// contiguous gradient is processed in chunks of this many bytes: the check
// (aminmax) brings a chunk into L2 and the multiply finds it there.
inline constexpr int64_t kUnscaleChunkBytes = int64_t{512} * 1024;
// Gradients up to this size are checked in batches (one cat, one aminmax)
// instead of one aminmax each: for them the per-op overhead (~1 us), not the
// bytes, is the cost. See bench/scaler_bench.cc for the measurements.
inline constexpr int64_t kUnscaleSmallBytes = int64_t{32} * 1024;

// Appends t's minimum and maximum. Both are NaN when t holds a NaN (aminmax
// propagates NaN), and one of them is +-inf when t holds an infinity, so they
// are all finite exactly when every element of t is. Unlike a sum, this cannot
// overflow into a false positive, and it reads t once without a temporary.
inline void append_extrema(const at::Tensor& t, std::vector<at::Tensor>& extrema) {
  auto min_max = at::aminmax(t);
  extrema.push_back(std::move(std::get<0>(min_max)));
  extrema.push_back(std::move(std::get<1>(min_max)));
}

// The state of one portable unscale: extrema to reduce at the end (per dtype:
// stack needs one dtype) and a batch of small gradients not yet checked.
class PortableUnscale {
 public:
  explicit PortableUnscale(const at::Tensor& inv_scale) : inv_scale_(inv_scale) {}

  // Checks t (values before the multiply, as the kernels do) and multiplies it
  // in place, now or when its batch is flushed.
  void add(const at::Tensor& t) {
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (bytes <= kUnscaleSmallBytes) {
      if (!pending_.empty() &&
          (pending_.front().scalar_type() != t.scalar_type() || pending_bytes_ + bytes > kUnscaleChunkBytes)) {
        flush();
      }
      pending_.push_back(t);
      pending_bytes_ += bytes;
      return;
    }
    const int64_t chunk = kUnscaleChunkBytes / static_cast<int64_t>(t.element_size());
    if (!t.is_contiguous() || t.numel() <= 2 * chunk) {
      append_extrema(t, group_of(t.scalar_type()));
      t.mul_(inv_scale_);
      return;
    }
    const at::Tensor flat = t.view({-1});
    for (int64_t begin = 0; begin < flat.numel(); begin += chunk) {
      const at::Tensor part = flat.narrow(0, begin, std::min(chunk, flat.numel() - begin));
      append_extrema(part, group_of(t.scalar_type()));
      part.mul_(inv_scale_);
    }
  }

  // Checks and multiplies the pending small gradients.
  void flush() {
    if (pending_.empty()) {
      return;
    }
    std::vector<at::Tensor>& extrema = group_of(pending_.front().scalar_type());
    if (pending_.size() == 1) {
      append_extrema(pending_.front(), extrema);
    } else {
      std::vector<at::Tensor> flat;
      flat.reserve(pending_.size());
      for (const at::Tensor& t : pending_) {
        // cat needs one rank; making a view costs as much as the multiply
        // of a small tensor, so 1-D ones (biases, norms) are taken as they are.
        flat.push_back(t.dim() == 1 ? t : (t.is_contiguous() ? t.view({-1}) : t.reshape({-1})));
      }
      append_extrema(at::cat(flat), extrema);
    }
    for (const at::Tensor& t : pending_) {
      t.mul_(inv_scale_);
    }
    pending_.clear();
    pending_bytes_ = 0;
  }

  // Flushes, then sets found_inf to 1 if any extremum is not finite.
  void finish(at::Tensor& found_inf) {
    flush();
    for (const auto& group : extrema_) {
      const at::Tensor all_finite = at::isfinite(at::stack(group.second)).all();
      found_inf.masked_fill_(all_finite.logical_not(), 1.0);
    }
  }

 private:
  std::vector<at::Tensor>& group_of(at::ScalarType dtype) {
    for (auto& group : extrema_) {
      if (group.first == dtype) {
        return group.second;
      }
    }
    extrema_.emplace_back(dtype, std::vector<at::Tensor>{});
    return extrema_.back().second;
  }

  const at::Tensor& inv_scale_;
  std::vector<std::pair<at::ScalarType, std::vector<at::Tensor>>> extrema_;
  std::vector<at::Tensor> pending_;
  int64_t pending_bytes_ = 0;
};

// The CPU form of the kernel for one small contiguous gradient, over its
// memory. For small gradients the per-call cost of ATen ops, not the bytes, is
// what an unscale pays (1000 gradients of 1000 floats: 0.85 ms as cat +
// aminmax + mul_, 0.55 ms here, 0.47 ms for a plain copy of the same bytes;
// bench/scaler_bench.cc). Larger ones stay on the ATen path, whose kernels are
// vectorized and multi-threaded where this scalar loop is not.
// Element for element what LibTorch 2.3's CPU kernel (and the CUDA one)
// computes: val in opmath (float; double for fp64), found if !isfinite(val),
// result static_cast<scalar_t>(inv == 1.f ? val : val * inv). Returns found.
template <class T>
bool cpu_check_and_unscale(T* data, int64_t n, float inv) {
  using opmath = std::conditional_t<std::is_same_v<T, double>, double, float>;
  bool found = false;
  if (inv == 1.f && std::is_same_v<T, opmath>) {
    // The kernel writes val back unchanged: only check. (For fp16/bf16 it
    // writes static_cast<T>(float(val)), which can canonicalize a NaN.)
    for (int64_t i = 0; i < n; ++i) found |= !std::isfinite(static_cast<opmath>(data[i]));
    return found;
  }
  const opmath s = static_cast<opmath>(inv);
  const bool identity = inv == 1.f;
  for (int64_t i = 0; i < n; ++i) {
    const opmath v = static_cast<opmath>(data[i]);
    found |= !std::isfinite(v);
    data[i] = static_cast<T>(identity ? v : v * s);
  }
  return found;
}

// Runs cpu_check_and_unscale on `grad` if it is a small contiguous CPU tensor
// of a dtype the kernels take; false if it left `grad` to the ATen-op path.
inline bool try_cpu_check_and_unscale(const at::Tensor& grad, float inv, bool& found) {
  if (!grad.device().is_cpu() || !grad.is_contiguous() ||
      grad.numel() * static_cast<int64_t>(grad.element_size()) > kUnscaleSmallBytes) {
    return false;
  }
  const int64_t n = grad.numel();
  switch (grad.scalar_type()) {
    case at::kFloat:
      found |= cpu_check_and_unscale(grad.data_ptr<float>(), n, inv);
      return true;
    case at::kDouble:
      found |= cpu_check_and_unscale(grad.data_ptr<double>(), n, inv);
      return true;
    case at::kBFloat16:
      found |= cpu_check_and_unscale(grad.data_ptr<at::BFloat16>(), n, inv);
      return true;
    case at::kHalf:
      found |= cpu_check_and_unscale(grad.data_ptr<at::Half>(), n, inv);
      return true;
    default:
      return false;
  }
}

// The portable _amp_foreach_non_finite_check_and_unscale_: multiplies every
// gradient in place by inv_scale (a 0-dim fp32 tensor) and sets found_inf (a
// 0-dim fp32 tensor, pre-zeroed by the caller) to 1 if any element was inf or
// NaN before the multiply. No host sync.
//
// Bitwise equal to the CPU and CUDA kernels, which compute
// `inv_scale == 1.f ? val : val * inv_scale` in float (opmath) for fp32,
// fp16 and bf16 and in double for fp64, and round back to the gradient's dtype:
// - fp32: Tensor::mul_ with a 0-dim fp32 tensor is the same IEEE product;
//   x * 1.f == x bit for bit except that a signalling NaN comes out quiet.
// - fp16/bf16: mul_ would round inv_scale to the gradient's dtype first, so the
//   product is taken in fp32 and copied back (round to nearest even, like
//   static_cast<scalar_t>(float)).
// - fp64: the fp32 inv_scale widens exactly, as in the kernel.
// A finite value whose product overflows (inv_scale > 1) does not count as
// found, as in the kernels: the check reads the values before the multiply.
inline void portable_non_finite_check_and_unscale_(at::TensorList scaled_grads, at::Tensor& found_inf,
                                                   const at::Tensor& inv_scale) {
  if (scaled_grads.empty()) {
    return;
  }
  TORCH_CHECK(inv_scale.numel() == 1, "inv_scale must be a 1-element tensor.");
  TORCH_CHECK(found_inf.numel() == 1, "found_inf must be a 1-element tensor.");
  TORCH_CHECK(inv_scale.scalar_type() == at::kFloat, "inv_scale must be a float tensor.");
  TORCH_CHECK(found_inf.scalar_type() == at::kFloat, "found_inf must be a float tensor.");
  // Past the autograd kernels: for a small gradient the VariableType wrapper of
  // mul_ costs more than the multiply (1000 gradients of 1000 floats: 1.0 ms of
  // mul_ calls under NoGradGuard, 0.38 ms here, measured on 1.13). Unlike
  // AutoDispatchBelowADInplaceOrView, InferenceMode still bumps the version
  // counters of the (normal) gradients it writes; the temporaries made here
  // (extrema, fp32 copies) are inference tensors that never leave this function.
  c10::InferenceMode inference_mode;
  PortableUnscale unscale(inv_scale);
  // On the CPU, inv_scale and found_inf are host memory: reading and writing
  // them directly is no device sync.
  const bool on_cpu = inv_scale.device().is_cpu() && found_inf.device().is_cpu();
  const float inv = on_cpu ? inv_scale.item<float>() : 0.f;
  bool found = false;
  for (const at::Tensor& grad : scaled_grads) {
    TORCH_CHECK(grad.layout() == at::kStrided, "one of scaled_grads was not a strided tensor.");
    if (grad.numel() == 0) {
      continue;
    }
    if (on_cpu && try_cpu_check_and_unscale(grad, inv, found)) {
      continue;
    }
    if (grad.scalar_type() == at::kHalf || grad.scalar_type() == at::kBFloat16) {
      at::Tensor wide = grad.to(at::kFloat);
      unscale.add(wide);
      unscale.flush();  // wide must be multiplied before it is copied back
      grad.copy_(wide);
    } else {
      unscale.add(grad);
    }
  }
  unscale.finish(found_inf);
  if (found) found_inf.fill_(1.0);
}

// Unscales with the fused kernel where the device has one, else portably.
inline void non_finite_check_and_unscale_(const std::vector<at::Tensor>& scaled_grads, at::Tensor& found_inf,
                                          const at::Tensor& inv_scale) {
  if (scaled_grads.empty()) {
    return;
  }
  if (has_amp_kernels(scaled_grads.front().device().type())) {
    at::_amp_foreach_non_finite_check_and_unscale_(scaled_grads, found_inf, inv_scale);
  } else {
    portable_non_finite_check_and_unscale_(scaled_grads, found_inf, inv_scale);
  }
}

}  // namespace detail
}  // namespace amp
