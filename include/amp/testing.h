// amp/testing.h: GoogleTest helpers driven by the compile-time policy lists.
//
//   template <class P> class MyTest : public ::testing::Test {};
//   TYPED_TEST_SUITE(MyTest, amp::testing::PolicyTypes<decltype(amp::supported_policies<amp::CPU>)>,
//                    amp::testing::PolicyNames);
//
// Typed tests run one body under every policy of a Hana list and are named by
// the policy's precision string ("bf16-mixed", "64-true", ...).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "amp/core/experiment.h"

namespace amp {
namespace testing {

// ::testing::Types<P...> for a hana::tuple_t<P...> list.
template <class List>
using PolicyTypes = detail::unpack_types_t<::testing::Types, List>;

// Name generator for TYPED_TEST_SUITE: the precision string with characters
// gtest accepts in a test name ("bf16-mixed" -> "bf16_mixed").
struct PolicyNames {
  template <class P>
  static std::string GetName(int /*index*/) {
    std::string name = policy_traits<P>::name;
    for (char& c : name)
      if (c == '-') c = '_';
    return name;
  }
};

}  // namespace testing
}  // namespace amp
