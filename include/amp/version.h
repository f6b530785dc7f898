// amp/version.h: the library's version and the LibTorch version it is built against.
//
//   #include <amp/version.h>
//   static_assert(amp::kVersionMajor == 0);
//   if constexpr (amp::libtorch_at_least(2, 3)) { /* CPU GradScaler kernels */ }
//
// Every LibTorch version difference is decided from these numbers (taken from
// torch/version.h, i.e. TORCH_VERSION_MAJOR/MINOR), never per machine.
#pragma once

#include <torch/version.h>

#define AMP_VERSION_MAJOR 0
#define AMP_VERSION_MINOR 2
#define AMP_VERSION_PATCH 0

namespace amp {

inline constexpr int kVersionMajor = AMP_VERSION_MAJOR;
inline constexpr int kVersionMinor = AMP_VERSION_MINOR;
inline constexpr int kVersionPatch = AMP_VERSION_PATCH;
inline constexpr const char* kVersionString = "0.2.0";

inline constexpr int kLibTorchMajor = TORCH_VERSION_MAJOR;
inline constexpr int kLibTorchMinor = TORCH_VERSION_MINOR;

// True when the LibTorch being compiled against is `major.minor` or newer.
constexpr bool libtorch_at_least(int major, int minor) {
  return kLibTorchMajor > major || (kLibTorchMajor == major && kLibTorchMinor >= minor);
}

}  // namespace amp
