// tests/precision/autocast_state.h: a snapshot of one thread's autocast state, for the
// tests of precision/autocast.h and precision/region.h (what a guard saves and must restore).
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <ostream>

#include "amp/detail/compat_ops.h"

namespace amp_test {

// The nesting counter has no getter: read it by a balanced increment/decrement.
inline int nesting() {
  const int n = amp::detail::compat::autocast_increment_nesting() - 1;
  amp::detail::compat::autocast_decrement_nesting();
  return n;
}

// Everything an autocast guard saves and restores, for one thread.
struct State {
  bool cpu_enabled, cuda_enabled;
  c10::ScalarType cpu_dtype, cuda_dtype;
  bool cache_enabled;
  int nesting;
  bool operator==(const State& o) const {
    return cpu_enabled == o.cpu_enabled && cuda_enabled == o.cuda_enabled && cpu_dtype == o.cpu_dtype &&
           cuda_dtype == o.cuda_dtype && cache_enabled == o.cache_enabled && nesting == o.nesting;
  }
};
inline std::ostream& operator<<(std::ostream& os, const State& s) {
  return os << "{cpu " << s.cpu_enabled << "/" << s.cpu_dtype << ", cuda " << s.cuda_enabled << "/" << s.cuda_dtype
            << ", cache " << s.cache_enabled << ", nesting " << s.nesting << "}";
}
inline State snapshot() {
  namespace compat = amp::detail::compat;
  return {compat::autocast_enabled(c10::DeviceType::CPU),
          compat::autocast_enabled(c10::DeviceType::CUDA),
          compat::autocast_dtype(c10::DeviceType::CPU),
          compat::autocast_dtype(c10::DeviceType::CUDA),
          compat::autocast_cache_enabled(),
          nesting()};
}
// A fresh thread's state (measured on 1.13: CPU bf16, CUDA fp16, both off).
inline const State kDefault{false, false, c10::ScalarType::BFloat16, c10::ScalarType::Half, true, 0};

}  // namespace amp_test
