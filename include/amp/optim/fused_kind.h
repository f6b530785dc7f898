// amp/optim/fused_kind.h: FusedKind, which of ATen's fused optimizer kernels
// serves an optimizer (amp::fused_kind in optim/fused.h decides).
//
//   if (amp::fused_kind(optimizer, c10::DeviceType::CPU) != amp::FusedKind::kNone) { ... }
#pragma once

namespace amp {

enum class FusedKind { kNone, kAdam, kAdamW, kSGD };

inline const char* fused_kind_name(FusedKind kind) {
  switch (kind) {
    case FusedKind::kAdam:
      return "Adam";
    case FusedKind::kAdamW:
      return "AdamW";
    case FusedKind::kSGD:
      return "SGD";
    case FusedKind::kNone:
      break;
  }
  return "none";
}

}  // namespace amp
