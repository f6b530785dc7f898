// amp/detail/compat.h: the one place that knows LibTorch version differences.
//
//   amp::detail::compat::...   (never used by callers)
//
// Sections: GradScaler kernels; autocast state API.
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

}  // namespace compat
}  // namespace detail
}  // namespace amp
