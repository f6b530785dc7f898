// amp/detail/compat.h: the one place that knows what each LibTorch version has.
//
//   if constexpr (amp::detail::compat::kCpuHasAmpKernels) { ... }
//   #if AMP_DETAIL_DEVICE_GENERIC_AUTOCAST_API ... #endif
//
// Every version threshold is a named constant or macro here, decided from
// TORCH_VERSION_MAJOR/MINOR; nothing else in amp compares version numbers.
// Only small headers: the compile-time layer (core/device.h, core/rules.h) reads it.
// The ATen calls whose spelling differs switch on these names in
// detail/compat_ops.h.
#pragma once

#include "amp/version.h"

namespace amp {
namespace detail {
namespace compat {

// --- GradScaler kernels -----------------------------------------------------
// _amp_foreach_non_finite_check_and_unscale_ and _amp_update_scale_ have CUDA
// kernels in every supported LibTorch and CPU kernels from 2.3 on
// (pytorch#109281). Before that, CPU uses amp's portable path.
inline constexpr bool kCpuHasAmpKernels = libtorch_at_least(2, 3);

// --- fp16 on CPU ----------------------------------------------------------------
// CPU autocast to fp16 (torch.autocast("cpu", dtype=torch.float16),
// pytorch#112484) and the CPU fp16 kernels True<fp16> needs (addmm, conv):
// 2.3. 1.13 rejects kHalf with "AutocastCPU only support Bfloat16".
inline constexpr bool kCpuHasFp16 = libtorch_at_least(2, 3);

// --- autocast state API -----------------------------------------------------
// LibTorch 2.4 (pytorch#124359) made the autocast state per device type:
// at::autocast::is_autocast_enabled(DeviceType), set_autocast_enabled(DeviceType,
// bool), get_autocast_dtype(DeviceType), set_autocast_dtype(DeviceType,
// ScalarType), and deprecated the per-device functions 1.13 only has
// (is_enabled/set_enabled and get/set_autocast_gpu_dtype for CUDA,
// is_cpu_enabled/set_cpu_enabled and get/set_autocast_cpu_dtype for CPU).
// The deprecated ones warn at compile and run time, so the choice is made by
// the preprocessor. The cache and nesting functions kept their names.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define AMP_DETAIL_DEVICE_GENERIC_AUTOCAST_API 1
#else
#define AMP_DETAIL_DEVICE_GENERIC_AUTOCAST_API 0
#endif
inline constexpr bool kDeviceGenericAutocastApi = AMP_DETAIL_DEVICE_GENERIC_AUTOCAST_API;
static_assert(kDeviceGenericAutocastApi == libtorch_at_least(2, 4),
              "amp: compat.h's autocast API switch disagrees with version.h");

// --- TF32 flags ----------------------------------------------------------------
// Up to 2.8 the cuBLAS TF32 flag is derived from float32MatmulPrecision, which
// is saved and restored as such. 2.9 added per-backend fp32_precision
// settings; with them, reading float32MatmulPrecision() after a mix of old and
// new setters throws (measured on 2.11), so from 2.9 amp saves and restores
// the cuBLAS/cuDNN TF32 booleans only.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
#define AMP_DETAIL_FP32_PRECISION_API 1
#else
#define AMP_DETAIL_FP32_PRECISION_API 0
#endif

}  // namespace compat
}  // namespace detail
}  // namespace amp

// --- fused optimizer kernels and optimizer state (optim/fused.h) ---
// Which of ATen's fused optimizer steps a LibTorch has, and the key type of
// torch::optim::Optimizer::state(); amp/optim/fused.h calls the kernels,
// switching on these names. Constants and light headers only, as the rest of
// this file.
//
// The kernels (native_functions.yaml of each release; the ATen/ops/
// *_cpu_dispatch.h / *_cuda_dispatch.h headers a LibTorch installs):
//   _fused_adam_   CUDA in every LibTorch amp supports (1.13: CUDA only);
//   _fused_adamw_  CUDA from 2.0 (pytorch#88015);
//   _fused_sgd_    CUDA from 2.3 (pytorch#116585);
//   CPU kernels of all three from 2.4 (pytorch#123074 for Adam/AdamW).
// Other devices (MPS, XPU, ...) are left out: amp cannot test them.
// optim/fused.h also asks the dispatcher whether the kernel is registered, so
// a wrong threshold here gives "no fused kernel", not a failed call.
// The double-lr overloads have the same schema in every version that has the
// op (2.x adds overloads with a Tensor lr):
//   _fused_adam_(Tensor[] self, Tensor[] grads, Tensor[] exp_avgs, Tensor[] exp_avg_sqs,
//       Tensor[] max_exp_avg_sqs, Tensor[] state_steps, *, float lr, float beta1, float beta2,
//       float weight_decay, float eps, bool amsgrad, bool maximize,
//       Tensor? grad_scale=None, Tensor? found_inf=None)           (_fused_adamw_ the same)
//   _fused_sgd_(Tensor[] self, Tensor[] grads, Tensor[] momentum_buffer_list, *,
//       float weight_decay, float momentum, float lr, float dampening, bool nesterov,
//       bool maximize, bool is_first_step, Tensor? grad_scale=None, Tensor? found_inf=None)
#include <c10/core/DeviceType.h>

#include <string>

#if TORCH_VERSION_MAJOR >= 2
#define AMP_DETAIL_HAS_FUSED_ADAMW 1
#else
#define AMP_DETAIL_HAS_FUSED_ADAMW 0
#endif
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define AMP_DETAIL_HAS_FUSED_SGD 1
#else
#define AMP_DETAIL_HAS_FUSED_SGD 0
#endif
#if TORCH_VERSION_MAJOR < 2
#include <c10/util/C++17.h>  // c10::guts::to_string, 1.13's state key
#endif

namespace amp {
namespace detail {
namespace compat {

inline constexpr bool kHasFusedAdamW = AMP_DETAIL_HAS_FUSED_ADAMW;
inline constexpr bool kHasFusedSgd = AMP_DETAIL_HAS_FUSED_SGD;
inline constexpr bool kCpuHasFusedOptimizers = libtorch_at_least(2, 4);
static_assert(kHasFusedAdamW == libtorch_at_least(2, 0) && kHasFusedSgd == libtorch_at_least(2, 3),
              "amp: compat.h's fused-optimizer switches disagree with version.h");

// ATen's CPU fused SGD skips the vectorized blocks of fp16/bf16 parameters:
// only a tensor's scalar tail (numel mod the SIMD width) is updated
// (pytorch#191763, fixed by pytorch#192545 in August 2026; measured on
// LibTorch 2.6: a 16-element bf16 parameter stays unchanged; 2.14 updates it).
// Releases between 2.6 and 2.14 are untested: amp takes the unfused step there.
inline constexpr bool kCpuFusedSgdUpdatesHalfTypes = libtorch_at_least(2, 14);

enum class FusedOp { kAdam, kAdamW, kSgd };

// The operator's name for the dispatcher (overload "": the double-lr one).
constexpr const char* fused_op_name(FusedOp op) {
  return op == FusedOp::kAdam    ? "aten::_fused_adam_"
         : op == FusedOp::kAdamW ? "aten::_fused_adamw_"
                                 : "aten::_fused_sgd_";
}

// The first LibTorch with the op's kernel for `device` ("" where amp knows of none).
constexpr const char* fused_op_since(FusedOp op, c10::DeviceType device) {
  if (device == c10::DeviceType::CPU) return "2.4";
  if (device != c10::DeviceType::CUDA) return "";
  return op == FusedOp::kAdam ? "1.13" : op == FusedOp::kAdamW ? "2.0" : "2.3";
}

// Whether this LibTorch has the op's kernel for `device`.
constexpr bool has_fused_op(FusedOp op, c10::DeviceType device) {
  const bool exists = op == FusedOp::kAdam || (op == FusedOp::kAdamW ? kHasFusedAdamW : kHasFusedSgd);
  return exists && (device == c10::DeviceType::CUDA || (device == c10::DeviceType::CPU && kCpuHasFusedOptimizers));
}

// The key of a parameter's entry in torch::optim::Optimizer::state(), from
// param.unsafeGetTensorImpl(): the std::string c10::guts::to_string makes of
// the pointer in 1.13 (torch/csrc/api/src/optim/adam.cpp:
// state_.find(c10::guts::to_string(p.unsafeGetTensorImpl()))), the void*
// itself from 2.0 on. optim/fused.h checks OptimStateKey against the map.
#if TORCH_VERSION_MAJOR >= 2
using OptimStateKey = void*;
inline OptimStateKey optim_state_key(void* tensor_impl) { return tensor_impl; }
#else
using OptimStateKey = std::string;
inline OptimStateKey optim_state_key(void* tensor_impl) { return c10::guts::to_string(tensor_impl); }
#endif

}  // namespace compat
}  // namespace detail
}  // namespace amp
