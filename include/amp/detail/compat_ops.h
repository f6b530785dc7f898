// amp/detail/compat_ops.h: the ATen calls whose spelling differs between
// LibTorch versions, switched on compat.h's names (never on version numbers).
//
//   amp::detail::compat::set_autocast_enabled(c10::DeviceType::CPU, true);
//
// Sections: autocast state; telling autocast's own work apart; autograd
// nodes; TF32 flags; optimizer state keys.
#pragma once

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/ScalarType.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "amp/detail/compat.h"

namespace amp {
namespace detail {
namespace compat {

// --- autocast state (see compat.h) ---------------------------------------------
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

// Whether this thread is executing a backward() graph task (the autograd
// engine sets a thread-local current graph task around every node it runs;
// this accessor of it exists, with this signature, in 1.13 and 2.x).
inline bool inside_autograd_backward() { return torch::autograd::get_current_graph_task_exec_info() != nullptr; }

// --- autograd nodes (train/activation_checkpoint.h) ---------------------------
// torch::autograd::Node was held by std::shared_ptr (1.13, 2.6) and is held by
// c10::intrusive_ptr since pytorch#181782 (2026; 2.14 here). The switch is the
// type itself, which says exactly which one this LibTorch has.
inline constexpr bool kAutogradNodeIsIntrusive = std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>;
template <class T, class... Args>
auto make_autograd_node(Args&&... args) {
  if constexpr (kAutogradNodeIsIntrusive) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<T>(std::forward<Args>(args)...);
  }
}

// --- TF32 math mode (tf32.h) -------------------------------------------------
// allowTF32CuBLAS() is derived from float32MatmulPrecision (HIGHEST = off) in
// 1.13 and 2.x, so saving the precision (not the bool) restores "medium" too.
struct Tf32Flags {
#if AMP_DETAIL_FP32_PRECISION_API
  bool cublas;
#else
  at::Float32MatmulPrecision matmul;
#endif
  bool cudnn;
};
inline Tf32Flags tf32_flags() {
#if AMP_DETAIL_FP32_PRECISION_API
  return {at::globalContext().allowTF32CuBLAS(), at::globalContext().allowTF32CuDNN()};
#else
  return {at::globalContext().float32MatmulPrecision(), at::globalContext().allowTF32CuDNN()};
#endif
}
inline void set_tf32(bool on) {
  at::globalContext().setAllowTF32CuBLAS(on);
  at::globalContext().setAllowTF32CuDNN(on);
}
inline const char* float32_matmul_precision_name(at::Float32MatmulPrecision p) {
  return p == at::Float32MatmulPrecision::HIGHEST ? "highest"
         : p == at::Float32MatmulPrecision::HIGH  ? "high"
                                                  : "medium";
}
inline void restore_tf32_flags(const Tf32Flags& flags) {
#if AMP_DETAIL_FP32_PRECISION_API
  at::globalContext().setAllowTF32CuBLAS(flags.cublas);
#else
  at::globalContext().setFloat32MatmulPrecision(float32_matmul_precision_name(flags.matmul));
#endif
  at::globalContext().setAllowTF32CuDNN(flags.cudnn);
}

// --- bf16 on CUDA ----------------------------------------------------------------
// Ampere or newer (compute capability 8.0+), asked through ATen's CUDA hooks so
// that a CPU-only build compiles too (its hooks answer false). The hook checks
// exactly `major >= 8` where cuDNN is enabled, as the wheels are built.
inline bool cuda_supports_bf16() { return at::detail::getCUDAHooks().supportsBFloat16ConvolutionWithCuDNNv8(); }

}  // namespace compat
}  // namespace detail
}  // namespace amp
