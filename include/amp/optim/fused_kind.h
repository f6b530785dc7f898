// amp/optim/fused_kind.h: FusedKind, which of ATen's fused optimizer kernels
// serves an optimizer, or kOptimizer for one that takes grad_scale/found_inf
// itself (optim/supports_amp_scaling.h); amp::detail::fused_kind in optim/fused.h decides.
//
//   if (amp::detail::fused_kind(optimizer, c10::DeviceType::CPU) != amp::FusedKind::kNone) { ... }
#pragma once

namespace amp {

enum class FusedKind { kNone, kAdam, kAdamW, kSgd, kOptimizer };

namespace detail {
inline const char* fused_kind_name(FusedKind kind) {
  switch (kind) {
    case FusedKind::kAdam:
      return "Adam";
    case FusedKind::kAdamW:
      return "AdamW";
    case FusedKind::kSgd:
      return "SGD";
    case FusedKind::kOptimizer:
      return "the optimizer's own";
    case FusedKind::kNone:
      break;
  }
  return "none";
}
}  // namespace detail

}  // namespace amp
