// amp/train/detail/fp16_pitfalls.h: what Trainer and Fabric tell a user of an
// fp16 policy that LibTorch does not.
//
//   amp::detail::warn_if_slow_fp16<Policy, Device>("Trainer");   // at construction
//   return amp::detail::explain_fp16_errors<Policy>([&] { return fn(region); });
//
// fp16 on a CPU without native fp16 arithmetic is emulated: measured on a
// 2-core Zen 4, one Linear forward took 5x the fp32 time and 16x bf16's.
// `scores.masked_fill(mask, -1e9)` fails under fp16 with LibTorch's "value
// cannot be converted to type at::Half without overflow", which names no
// operation: rethrown as an amp: error that says where and what to write.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>
#include <type_traits>

#include "amp/core/device.h"
#include "amp/core/dtype.h"
#include "amp/core/policy.h"

namespace amp::detail {

template <class Policy>
inline constexpr bool computes_in_fp16_v = std::is_same_v<typename policy_traits<Policy>::compute_type, fp16> ||
                                           std::is_same_v<typename policy_traits<Policy>::param_type, fp16>;

// One warning per construction of an fp16 policy's `who` on a CPU device.
template <class Policy, class Device>
void warn_if_slow_fp16(const char* who) {
  if constexpr (computes_in_fp16_v<Policy> && std::is_same_v<Device, CPU>) {
    TORCH_WARN("amp: ", who, "<", policy_traits<Policy>::name,
               ", amp::CPU>: most CPUs have no fp16 arithmetic, so LibTorch emulates it and fp16 runs several "
               "times slower than fp32; bf16 has fp32's range and is the fast choice on CPU: "
               "amp::Mixed<amp::bf16, amp::NoScaler> (\"bf16-mixed\")");
  }
}

// f(), with LibTorch's fp16 overflow of a scalar rethrown as an amp: error
// that names the region and the fix (LibTorch's message kept).
template <class Policy, class F>
decltype(auto) explain_fp16_errors(F&& f) {
  if constexpr (computes_in_fp16_v<Policy>) {
    try {
      return f();
    } catch (const std::exception& e) {  // a std::runtime_error on 1.13 and 2.14, a c10::Error on 2.6
      const auto* error = dynamic_cast<const c10::Error*>(&e);
      const std::string what = error != nullptr ? error->what_without_backtrace() : e.what();
      // "value cannot be converted to type at::Half without overflow" (c10::Half from LibTorch 2.x's later lines)
      if (what.find("cannot be converted to type") == std::string::npos ||
          what.find("Half without overflow") == std::string::npos)
        throw;
      TORCH_CHECK(false, "amp: a scalar does not fit fp16 (largest finite value 65504) inside the forward of a ",
                  policy_traits<Policy>::name,
                  " region; a common cause is attention's `scores.masked_fill(mask, -1e9)`: write "
                  "-std::numeric_limits<float>::infinity() (or the dtype's lowest value) instead. LibTorch says: ",
                  what);
    }
  } else {
    return f();
  }
}

}  // namespace amp::detail
