// amp/detail/compat.h: the one place that knows LibTorch version differences.
//
//   amp::detail::compat::...   (never used by callers)
//
// Sections: GradScaler kernels; autocast state API; telling autocast's own work apart.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/DeviceType.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/ScalarType.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/graph_task.h>

#include <cstdlib>

#include "amp/version.h"

namespace amp {
namespace detail {
namespace compat {

// --- GradScaler kernels -----------------------------------------------------
// _amp_foreach_non_finite_check_and_unscale_ and _amp_update_scale_ have CUDA
// kernels in every supported LibTorch and CPU kernels from 2.3 on
// (pytorch#109281). Before that, CPU uses amp's portable path.
inline constexpr bool kCpuHasAmpKernels = libtorch_at_least(2, 3);

// Whether both kernels can run on tensors of `device`. CUDA always; CPU from
// 2.3; anything else (MPS, XPU, ...) takes the portable path, which is correct
// on every device because it is made of ordinary ATen ops.
constexpr bool has_amp_kernels(c10::DeviceType device) {
  return device == c10::DeviceType::CUDA || (device == c10::DeviceType::CPU && kCpuHasAmpKernels);
}

// --- autocast state API -----------------------------------------------------
// LibTorch 2.4 (pytorch#124359) made the autocast state per device type:
// at::autocast::is_autocast_enabled(DeviceType), set_autocast_enabled(DeviceType,
// bool), get_autocast_dtype(DeviceType), set_autocast_dtype(DeviceType,
// ScalarType), and deprecated the per-device functions 1.13 only has
// (is_enabled/set_enabled and get/set_autocast_gpu_dtype for CUDA,
// is_cpu_enabled/set_cpu_enabled and get/set_autocast_cpu_dtype for CPU).
// Read in aten/src/ATen/autocast_mode.h of pytorch/pytorch (2.4+ and main):
// the deprecated ones are C10_DEPRECATED_MESSAGE inline wrappers that also
// TORCH_WARN_DEPRECATION at run time, so the choice is made by the
// preprocessor (an `if constexpr` would still name, and warn on, the old API).
// clear_cache, increment_nesting, decrement_nesting, is_autocast_cache_enabled
// and set_autocast_cache_enabled kept their names and signatures.
// All of this state is thread-local in every version (see amp/autocast.h).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define AMP_DETAIL_DEVICE_GENERIC_AUTOCAST_API 1
#else
#define AMP_DETAIL_DEVICE_GENERIC_AUTOCAST_API 0
#endif
inline constexpr bool kDeviceGenericAutocastApi = AMP_DETAIL_DEVICE_GENERIC_AUTOCAST_API;
static_assert(kDeviceGenericAutocastApi == libtorch_at_least(2, 4), "amp: compat.h's autocast API switch disagrees with version.h");

#if !AMP_DETAIL_DEVICE_GENERIC_AUTOCAST_API
// 1.13 has per-device functions for CPU, CUDA and XPU only; amp has CPU and CUDA tags.
[[noreturn]] inline void autocast_device_unsupported(c10::DeviceType device) {
  TORCH_CHECK(false, "amp: autocast on ", c10::DeviceTypeName(device), " is not supported by amp with LibTorch ",
              TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR, "; use amp::CPU or amp::CUDA");
  std::abort();  // unreachable: TORCH_CHECK(false) throws
}
#endif

inline bool autocast_enabled(c10::DeviceType device) {
#if AMP_DETAIL_DEVICE_GENERIC_AUTOCAST_API
  return at::autocast::is_autocast_enabled(device);
#else
  switch (device) {
    case c10::DeviceType::CPU:
      return at::autocast::is_cpu_enabled();
    case c10::DeviceType::CUDA:
      return at::autocast::is_enabled();  // 1.13's CUDA-only name
    default:
      autocast_device_unsupported(device);
  }
#endif
}

inline void set_autocast_enabled(c10::DeviceType device, bool enabled) {
#if AMP_DETAIL_DEVICE_GENERIC_AUTOCAST_API
  at::autocast::set_autocast_enabled(device, enabled);
#else
  switch (device) {
    case c10::DeviceType::CPU:
      return at::autocast::set_cpu_enabled(enabled);
    case c10::DeviceType::CUDA:
      return at::autocast::set_enabled(enabled);
    default:
      autocast_device_unsupported(device);
  }
#endif
}

// The dtype autocast computes eligible ops in. Defaults: Half on CUDA, BFloat16 on CPU.
inline c10::ScalarType autocast_dtype(c10::DeviceType device) {
#if AMP_DETAIL_DEVICE_GENERIC_AUTOCAST_API
  return at::autocast::get_autocast_dtype(device);
#else
  switch (device) {
    case c10::DeviceType::CPU:
      return at::autocast::get_autocast_cpu_dtype();
    case c10::DeviceType::CUDA:
      return at::autocast::get_autocast_gpu_dtype();
    default:
      autocast_device_unsupported(device);
  }
#endif
}

// Throws on 1.13 for CPU and any dtype but BFloat16 ("AutocastCPU only support
// Bfloat16"); amp's static rules keep Autocast from asking for it.
inline void set_autocast_dtype(c10::DeviceType device, c10::ScalarType dtype) {
#if AMP_DETAIL_DEVICE_GENERIC_AUTOCAST_API
  at::autocast::set_autocast_dtype(device, dtype);
#else
  switch (device) {
    case c10::DeviceType::CPU:
      return at::autocast::set_autocast_cpu_dtype(dtype);
    case c10::DeviceType::CUDA:
      return at::autocast::set_autocast_gpu_dtype(dtype);
    default:
      autocast_device_unsupported(device);
  }
#endif
}

// The cast cache (autocast's fp32 -> low-precision copies of leaf tensors that
// require grad, i.e. weights) and the nesting counter are one per thread, not
// per device type; torch.autocast's __exit__ clears the cache when the
// counter returns to 0.
inline bool autocast_cache_enabled() { return at::autocast::is_autocast_cache_enabled(); }
inline void set_autocast_cache_enabled(bool enabled) { at::autocast::set_autocast_cache_enabled(enabled); }
inline int autocast_increment_nesting() { return at::autocast::increment_nesting(); }
inline int autocast_decrement_nesting() { return at::autocast::decrement_nesting(); }
inline void clear_autocast_cache() { at::autocast::clear_cache(); }

// --- telling autocast's own work apart (strict_casts.h) ----------------------
// Autocast is "on" for a device exactly while its Autocast* dispatch key is
// not excluded in the thread's TLS; autocast's kernels exclude it while they
// run (ExcludeDispatchKeyGuard in autocast_mode.cpp), so an op issued with the
// key excluded comes from autocast itself, or from code where autocast is off.
// Same keys and mechanism in 1.13 and 2.x.
inline bool autocast_dispatch_excluded(c10::DeviceType device) {
  return c10::impl::tls_is_dispatch_key_excluded(device == c10::DeviceType::CUDA ? c10::DispatchKey::AutocastCUDA
                                                                                  : c10::DispatchKey::AutocastCPU);
}

// Whether this thread is executing a backward() graph task (the autograd
// engine sets a thread-local current graph task around every node it runs;
// this accessor of it exists, with this signature, in 1.13 and 2.x).
inline bool inside_autograd_backward() { return torch::autograd::get_current_graph_task_exec_info() != nullptr; }

}  // namespace compat
}  // namespace detail
}  // namespace amp
