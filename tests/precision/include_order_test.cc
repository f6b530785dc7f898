// A policy's rules checked before its scaler's header is included (the scaler
// still incomplete) must not fix the scaler's traits: is_scaler_v and the
// naming rule never ask a built-in scaler for its members. Otherwise the
// scaler's header fails its own check (builtin_scaler_matches_v) once included.
// First in tests/BUILD.bazel's precision_test: no header before it includes
// the scalers.
#include <gtest/gtest.h>

#include "amp/core/rules.h"

namespace include_order_test {  // a layer's test files share one TU (tests/BUILD.bazel)
using Fp16 = amp::Mixed<amp::fp16, amp::DynamicScaler>;
using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;
static_assert(amp::is_scaler_v<amp::DynamicScaler> && amp::is_scaler_v<amp::NoScaler>);
static_assert(amp::detail::check_policy<Fp16>() && amp::detail::check_policy<Bf16>());
}  // namespace include_order_test

#include "amp/scaler/dynamic_scaler.h"
#include "amp/scaler/no_scaler.h"

namespace include_order_test {
namespace {

TEST(IncludeOrder, ScalersNamedBeforeTheirHeadersKeepTheirTraits) {
  static_assert(amp::detail::builtin_scaler_matches_v<amp::DynamicScaler>);
  static_assert(amp::detail::builtin_scaler_matches_v<amp::NoScaler>);
  EXPECT_TRUE(amp::detail::uses_loss_scaling_v<amp::DynamicScaler>);
  EXPECT_FALSE(amp::detail::uses_loss_scaling_v<amp::NoScaler>);
}

}  // namespace
}  // namespace include_order_test
