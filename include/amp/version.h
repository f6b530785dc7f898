// amp/version.h: the library's version and the LibTorch version it is built against.
//
//   #include <amp/version.h>
//   static_assert(AMP_VERSION_MAJOR == 0);
//   std::cout << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR;  // the LibTorch built against
//
// Every LibTorch version difference is decided from torch/version.h's
// TORCH_VERSION_MAJOR/MINOR (amp::detail::libtorch_at_least, used by the
// compat*.h shims only), never per machine.
#pragma once

#include <torch/version.h>

#define AMP_VERSION_MAJOR 0
#define AMP_VERSION_MINOR 2
#define AMP_VERSION_PATCH 0

namespace amp {
namespace detail {

// True when the LibTorch being compiled against is `major.minor` or newer.
constexpr bool libtorch_at_least(int major, int minor) {
  return TORCH_VERSION_MAJOR > major || (TORCH_VERSION_MAJOR == major && TORCH_VERSION_MINOR >= minor);
}

}  // namespace detail
}  // namespace amp
