// amp/precision/detail/autocast_tls.h: whether the op being dispatched was
// issued by autocast itself (strict casts and linear routing leave those alone).
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include "amp/core/device.h"

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

}  // namespace detail
}  // namespace amp
