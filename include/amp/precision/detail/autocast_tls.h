// amp/precision/detail/autocast_tls.h: whether the op being dispatched was
// issued by autocast itself (strict casts and linear routing leave those
// alone), or inside a backward pass.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include "amp/core/device.h"
#include "amp/detail/compat_ops.h"

namespace amp {
namespace detail {

// Autocast is "on" for a device exactly while its Autocast* dispatch key is
// not excluded in the thread's TLS; autocast's kernels exclude it while they
// run (ExcludeDispatchKeyGuard in autocast_mode.cpp), so an op issued with the
// key excluded comes from autocast itself, or from code where autocast is off.
// Same keys and mechanism in 1.13 and 2.x.
inline bool autocast_dispatch_excluded(c10::DeviceType device) {
  const c10::DispatchKey key = autocast_key(device);
  TORCH_CHECK(key != c10::DispatchKey::Undefined, "amp: no autocast dispatch key is known for ",
              c10::DeviceTypeName(device), "; give its device tag an autocast_key in amp/core/device.h");
  return c10::impl::tls_is_dispatch_key_excluded(key);
}

// Set while amp::checkpoint recomputes a forward inside backward
// (amp/train/activation_checkpoint.h): linear routing and the precision map,
// which stay out of backward passes, then apply as they did in the forward.
inline bool& recomputing_forward() {
  static thread_local bool on = false;
  return on;
}

// Inside a backward pass, and not in such a recompute.
inline bool in_backward_pass() { return compat::inside_autograd_backward() && !recomputing_forward(); }

}  // namespace detail
}  // namespace amp
