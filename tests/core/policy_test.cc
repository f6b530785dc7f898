// The compile-time core: every combination of dtype x scaler x device is
// checked against an expected table written out by hand (not derived from the
// traits under test), plus the Hana lists, typed tests and dispatch.
#include <gtest/gtest.h>

#include <boost/hana.hpp>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "amp/core/experiment.h"
#include "amp/scaler/dynamic_scaler.h"
#include "amp/scaler/no_scaler.h"
#include "amp/scaler/static_scaler.h"
#include "amp/testing.h"

namespace hana = boost::hana;

namespace {

constexpr auto kDtypes = hana::tuple_t<amp::fp16, amp::bf16, amp::fp32, amp::fp64, amp::tf32>;
constexpr auto kScalers = hana::tuple_t<amp::NoScaler, amp::StaticScaler, amp::DynamicScaler>;

struct Row {
  bool valid, cpu, cuda;
};

// What the rules say, written independently of the implementation.
// cpu16: LibTorch >= 2.3 adds CPU fp16 autocast and kernels.
std::map<std::string, Row> expected_table() {
  const bool cpu16 = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3);
  std::map<std::string, Row> t;
  for (std::string d : {"fp16", "bf16", "fp32", "fp64", "tf32"})
    for (std::string s : {"NoScaler", "StaticScaler", "DynamicScaler"})
      t["Mixed<" + d + ", " + s + ">"] = {false, false, false};
  t["Mixed<fp16, StaticScaler>"] = {true, cpu16, true};
  t["Mixed<fp16, DynamicScaler>"] = {true, cpu16, true};
  t["Mixed<bf16, NoScaler>"] = {true, true, true};
  t["True<fp16>"] = {true, cpu16, true};
  t["True<bf16>"] = {true, true, true};
  t["True<fp32>"] = {true, true, true};
  t["True<fp64>"] = {true, true, true};
  t["True<tf32>"] = {true, false, true};
  // Float8: _scaled_mm on CUDA from 2.5, on CPU from 2.8; never with a scaler.
  const bool f8_cuda = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5);
  const bool f8_cpu = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8);
  t["Float8<Tensorwise, NoScaler>"] = {true, f8_cpu, f8_cuda};
  t["Float8<Delayed<>, NoScaler>"] = {true, f8_cpu, f8_cuda};
  t["Float8<Delayed<16, 2>, NoScaler>"] = {true, f8_cpu, f8_cuda};
  t["Float8<Delayed<0, 0>, NoScaler>"] = {false, false, false};
  t["Float8<Delayed<16, 64>, NoScaler>"] = {false, false, false};
  t["Float8<fp32, NoScaler>"] = {false, false, false};
  t["Float8<Tensorwise, DynamicScaler>"] = {false, false, false};
  t["Float8<Tensorwise, StaticScaler>"] = {false, false, false};
  // The rowwise recipes: CPU's _scaled_mm takes rowwise scales from 2.14.
  const bool rw_cpu = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14);
  t["Float8<Rowwise, NoScaler>"] = {true, rw_cpu, f8_cuda};
  t["Float8<RowwiseWithGwHp, NoScaler>"] = {true, rw_cpu, f8_cuda};
  t["Float8<Rowwise, DynamicScaler>"] = {false, false, false};
  // The block-scaled recipes run emulated: they need the float8 dtypes (2.1), not _scaled_mm.
  const bool bs = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1);
  t["Float8<MXFP8<>, NoScaler>"] = {true, bs, bs};
  t["Float8<MXFP8<kFloor>, NoScaler>"] = {true, bs, bs};
  t["Float8<NVFP4<>, NoScaler>"] = {true, bs, bs};
  t["Float8<NVFP4<true>, NoScaler>"] = {true, bs, bs};
  t["Float8<MXFP8<>, DynamicScaler>"] = {false, false, false};
  t["Float8<NVFP4<>, StaticScaler>"] = {false, false, false};
  return t;
}

TEST(PolicyTable, EveryCombinationMatchesTheRules) {
  std::map<std::string, Row> actual;
  hana::for_each(kDtypes, [&](auto d) {
    using D = typename decltype(d)::type;
    const std::string dn = amp::dtype_traits<D>::name;
    hana::for_each(kScalers, [&](auto s) {
      using S = typename decltype(s)::type;
      using P = amp::Mixed<D, S>;
      actual["Mixed<" + dn + ", " + std::string(amp::detail::builtin_scaler<S>::name) + ">"] = {
          amp::is_valid_policy_v<P>, amp::is_supported_v<P, amp::CPU>, amp::is_supported_v<P, amp::CUDA>};
    });
    using T = amp::True<D>;
    actual["True<" + dn + ">"] = {amp::is_valid_policy_v<T>, amp::is_supported_v<T, amp::CPU>,
                                  amp::is_supported_v<T, amp::CUDA>};
  });
  auto float8_row = [&](const std::string& name, auto policy) {
    using P = typename decltype(policy)::type;
    actual[name] = {amp::is_valid_policy_v<P>, amp::is_supported_v<P, amp::CPU>, amp::is_supported_v<P, amp::CUDA>};
  };
  float8_row("Float8<Tensorwise, NoScaler>", hana::type_c<amp::Float8<amp::Tensorwise>>);
  float8_row("Float8<Delayed<>, NoScaler>", hana::type_c<amp::Float8<amp::Delayed<>>>);
  float8_row("Float8<Delayed<16, 2>, NoScaler>", hana::type_c<amp::Float8<amp::Delayed<16, 2>>>);
  float8_row("Float8<Delayed<0, 0>, NoScaler>", hana::type_c<amp::Float8<amp::Delayed<0, 0>>>);
  float8_row("Float8<Delayed<16, 64>, NoScaler>", hana::type_c<amp::Float8<amp::Delayed<16, 64>>>);
  float8_row("Float8<fp32, NoScaler>", hana::type_c<amp::Float8<amp::fp32>>);
  float8_row("Float8<Tensorwise, DynamicScaler>", hana::type_c<amp::Float8<amp::Tensorwise, amp::DynamicScaler>>);
  float8_row("Float8<Tensorwise, StaticScaler>", hana::type_c<amp::Float8<amp::Tensorwise, amp::StaticScaler>>);
  float8_row("Float8<Rowwise, NoScaler>", hana::type_c<amp::Float8<amp::Rowwise>>);
  float8_row("Float8<RowwiseWithGwHp, NoScaler>", hana::type_c<amp::Float8<amp::RowwiseWithGwHp>>);
  float8_row("Float8<Rowwise, DynamicScaler>", hana::type_c<amp::Float8<amp::Rowwise, amp::DynamicScaler>>);
  float8_row("Float8<MXFP8<>, NoScaler>", hana::type_c<amp::Float8<amp::MXFP8<>>>);
  float8_row("Float8<MXFP8<kFloor>, NoScaler>", hana::type_c<amp::Float8<amp::MXFP8<amp::MxScaleMode::kFloor>>>);
  float8_row("Float8<NVFP4<>, NoScaler>", hana::type_c<amp::Float8<amp::NVFP4<>>>);
  float8_row("Float8<NVFP4<true>, NoScaler>", hana::type_c<amp::Float8<amp::NVFP4<true>>>);
  float8_row("Float8<MXFP8<>, DynamicScaler>", hana::type_c<amp::Float8<amp::MXFP8<>, amp::DynamicScaler>>);
  float8_row("Float8<NVFP4<>, StaticScaler>", hana::type_c<amp::Float8<amp::NVFP4<>, amp::StaticScaler>>);
  const auto expected = expected_table();
  ASSERT_EQ(actual.size(), 37u);
  ASSERT_EQ(expected.size(), actual.size());
  for (const auto& [name, row] : expected) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(actual.count(name));
    EXPECT_EQ(actual[name].valid, row.valid);
    EXPECT_EQ(actual[name].cpu, row.cpu);
    EXPECT_EQ(actual[name].cuda, row.cuda);
  }
}

// Non-policies and non-devices are never valid or supported.
static_assert(!amp::detail::is_policy_v<int>);
static_assert(!amp::is_valid_policy_v<int>);
static_assert(!amp::is_valid_policy_v<amp::fp16>);
static_assert(!amp::is_valid_policy_v<amp::True<int>>);
static_assert(!amp::is_valid_policy_v<amp::Mixed<amp::fp16, int>>);
static_assert(!amp::is_supported_v<amp::True<amp::fp32>, int>);
static_assert(amp::is_scaler_v<amp::NoScaler> && amp::is_scaler_v<amp::DynamicScaler> &&
              amp::is_scaler_v<amp::StaticScaler>);
static_assert(!amp::is_scaler_v<int> && !amp::is_scaler_v<amp::fp16>);
static_assert(amp::detail::uses_loss_scaling_v<amp::DynamicScaler> &&
              amp::detail::uses_loss_scaling_v<amp::StaticScaler>);
static_assert(!amp::detail::uses_loss_scaling_v<amp::NoScaler>);

// A user-defined scaler with the whole interface and a name is accepted, and
// its policy is named after it; without a name it is rejected.
struct MyScaler : amp::NoScaler {
  static constexpr const char* kName = "mine";
};
static_assert(amp::is_scaler_v<MyScaler> && amp::is_valid_policy_v<amp::Mixed<amp::bf16, MyScaler>>);
struct UnnamedScaler : amp::NoScaler {};
static_assert(amp::is_scaler_v<UnnamedScaler> && !amp::is_valid_policy_v<amp::Mixed<amp::bf16, UnnamedScaler>>);

TEST(PolicyName, UserScalerPolicyIsNamedAfterTheScaler) {
  using Mine = amp::Mixed<amp::bf16, MyScaler>;
  using Unnamed = amp::Mixed<amp::bf16, UnnamedScaler>;
  EXPECT_STREQ(amp::policy_traits<Mine>::name, "bf16-mixed-mine");
  EXPECT_EQ(amp::policy_traits<Unnamed>::name, nullptr);
}

TEST(DtypeTraits, ScalarTypesNamesAndBits) {
  EXPECT_EQ(amp::scalar_type_v<amp::fp16>, c10::ScalarType::Half);
  EXPECT_EQ(amp::scalar_type_v<amp::bf16>, c10::ScalarType::BFloat16);
  EXPECT_EQ(amp::scalar_type_v<amp::fp32>, c10::ScalarType::Float);
  EXPECT_EQ(amp::scalar_type_v<amp::fp64>, c10::ScalarType::Double);
  EXPECT_EQ(amp::scalar_type_v<amp::tf32>, c10::ScalarType::Float);
  EXPECT_STREQ(amp::dtype_traits<amp::bf16>::name, "bf16");
  EXPECT_EQ(amp::dtype_traits<amp::fp16>::bits, 16);
  EXPECT_EQ(amp::dtype_traits<amp::fp64>::bits, 64);
  EXPECT_EQ(amp::dtype_traits<amp::tf32>::bits, 32);
}

TEST(PolicyTraits, WhatEachPolicyMeans) {
  using M16 = amp::policy_traits<amp::Mixed<amp::fp16, amp::DynamicScaler>>;
  static_assert(std::is_same_v<M16::compute_type, amp::fp16> && std::is_same_v<M16::param_type, amp::fp32>);
  static_assert(std::is_same_v<M16::scaler_type, amp::DynamicScaler> && M16::uses_autocast && M16::uses_loss_scaling);
  using MB = amp::policy_traits<amp::Mixed<amp::bf16, amp::NoScaler>>;
  static_assert(std::is_same_v<MB::compute_type, amp::bf16> && std::is_same_v<MB::param_type, amp::fp32>);
  static_assert(MB::uses_autocast && !MB::uses_loss_scaling);
  using T64 = amp::policy_traits<amp::True<amp::fp64>>;
  static_assert(std::is_same_v<T64::param_type, amp::fp64> && !T64::uses_autocast && !T64::uses_loss_scaling);
  static_assert(std::is_same_v<T64::scaler_type, amp::NoScaler>);
  EXPECT_STREQ(M16::name, "16-mixed");
  EXPECT_STREQ(MB::name, "bf16-mixed");
  EXPECT_STREQ(T64::name, "64-true");
  EXPECT_STREQ(amp::policy_traits<amp::True<amp::fp32>>::name, "32-true");
  EXPECT_STREQ(amp::policy_traits<amp::True<amp::bf16>>::name, "bf16-true");
  EXPECT_STREQ(amp::policy_traits<amp::True<amp::fp16>>::name, "16-true");
  EXPECT_STREQ(amp::policy_traits<amp::True<amp::tf32>>::name, "tf32-true");
  EXPECT_STREQ((amp::policy_traits<amp::Mixed<amp::fp16, amp::StaticScaler>>::name), "16-mixed-static");
  using F8 = amp::policy_traits<amp::Float8<amp::Tensorwise>>;
  using F8D = amp::policy_traits<amp::Float8<amp::Delayed<16, 1>>>;
  EXPECT_STREQ(F8::name, "fp8-tensorwise");
  EXPECT_STREQ(F8D::name, "fp8-delayed");
  EXPECT_STREQ(amp::policy_traits<amp::Float8<amp::Rowwise>>::name, "fp8-rowwise");
  EXPECT_STREQ(amp::policy_traits<amp::Float8<amp::RowwiseWithGwHp>>::name, "fp8-rowwise-gw-hp");
  static_assert(std::is_same_v<F8::compute_type, amp::bf16> && std::is_same_v<F8::param_type, amp::fp32>);
  static_assert(F8::uses_autocast && !F8::uses_loss_scaling);
  static_assert(std::is_same_v<F8D::recipe_type, amp::Delayed<16, 1>>);
  static_assert(amp::Delayed<>::history_length == 1024 && amp::Delayed<>::margin == 0);
  static_assert(amp::detail::is_float8_v<amp::Float8<amp::Tensorwise>> &&
                !amp::detail::is_float8_v<amp::Mixed<amp::bf16, amp::NoScaler>>);
}

TEST(PolicyLists, AllPoliciesAreValidDistinctAndNamed) {
  std::set<std::string> names;
  std::size_t n = 0;
  amp::for_each_policy([&](auto p) {
    using P = typename decltype(p)::type;
    static_assert(amp::is_valid_policy_v<P>);
    names.insert(amp::precision_name<P>());
    ++n;
  });
  EXPECT_EQ(n, 14u);
  EXPECT_EQ(names.size(), n);
}

TEST(PolicyLists, SupportedListsAreTheFilteredTable) {
  const auto expected = expected_table();
  auto collect = [](auto list) {
    std::vector<std::string> out;
    amp::for_each_policy(list, [&](auto p) { out.push_back(amp::policy_traits<typename decltype(p)::type>::name); });
    return out;
  };
  std::vector<std::string> cpu = collect(amp::supported_policies<amp::CPU>);
  std::vector<std::string> cuda = collect(amp::supported_policies<amp::CUDA>);
  EXPECT_EQ(cuda.size(),
            8u + (amp::detail::compat::kHasFloat8Matmul ? 4u : 0u) + (amp::detail::compat::kHasFloat8Dtype ? 2u : 0u));
  // all_policies has each recipe family once, with its defaults: Float8<Delayed<>>,
  // not Delayed<16, 2>; MXFP8<> (RCEIL), not kFloor; NVFP4<>, not NVFP4<true>.
  const std::set<std::string> not_listed = {"Float8<Delayed<16, 2>, NoScaler>", "Float8<MXFP8<kFloor>, NoScaler>",
                                            "Float8<NVFP4<true>, NoScaler>"};
  std::size_t expected_cpu = 0;
  for (const auto& [name, row] : expected) expected_cpu += row.cpu && !not_listed.count(name);
  // 16-mixed-static shares Mixed<fp16, StaticScaler>'s row.
  EXPECT_EQ(cpu.size(), expected_cpu);
  EXPECT_NE(std::find(cpu.begin(), cpu.end(), "bf16-mixed"), cpu.end());
  EXPECT_NE(std::find(cpu.begin(), cpu.end(), "64-true"), cpu.end());
  EXPECT_EQ(std::find(cpu.begin(), cpu.end(), "tf32-true"), cpu.end());
  const bool cpu16 = amp::detail::libtorch_at_least(2, 3);
  EXPECT_EQ(std::find(cpu.begin(), cpu.end(), "16-mixed") != cpu.end(), cpu16);
  EXPECT_EQ(std::find(cpu.begin(), cpu.end(), "fp8-delayed") != cpu.end(), amp::detail::libtorch_at_least(2, 8));
  EXPECT_EQ(std::find(cpu.begin(), cpu.end(), "fp8-rowwise") != cpu.end(), amp::detail::libtorch_at_least(2, 14));
  for (const char* block_scaled : {"mxfp8-rceil", "nvfp4"}) {
    EXPECT_EQ(std::find(cpu.begin(), cpu.end(), block_scaled) != cpu.end(), amp::detail::libtorch_at_least(2, 1));
    EXPECT_EQ(std::find(cuda.begin(), cuda.end(), block_scaled) != cuda.end(), amp::detail::libtorch_at_least(2, 1));
  }
}

// Typed tests over the compile-time list, named by precision string.
template <class P>
class EverySupportedPolicy : public ::testing::Test {};
TYPED_TEST_SUITE(EverySupportedPolicy, amp::testing::PolicyTypes<decltype(amp::supported_policies<amp::CPU>)>,
                 amp::testing::PolicyNames);

TYPED_TEST(EverySupportedPolicy, ItsNameDispatchesBackToIt) {
  using P = TypeParam;
  const bool same = amp::dispatch_precision<amp::CPU>(
      amp::policy_traits<P>::name, [](auto p) { return std::is_same_v<typename decltype(p)::type, P>; });
  EXPECT_TRUE(same) << amp::policy_traits<P>::name;
}

TEST(DispatchPrecision, EveryStringReachesItsPolicy) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"64-true", "64-true"},     {"32-true", "32-true"},     {"bf16-mixed", "bf16-mixed"},
      {"bf16-true", "bf16-true"}, {"64", "64-true"},          {"32", "32-true"},
      {"bf16", "bf16-mixed"},     {"16-mixed", "16-mixed"},   {"16", "16-mixed"},
      {"16-true", "16-true"},     {"tf32-true", "tf32-true"}, {"16-mixed-static", "16-mixed-static"}};
  for (const auto& [in, out] : cases) {
    SCOPED_TRACE(in);
    std::string reached = amp::dispatch_precision<amp::CUDA>(
        in, [](auto p) { return std::string(amp::policy_traits<typename decltype(p)::type>::name); });
    EXPECT_EQ(reached, out);
  }
  // A Mixed<bf16, NoScaler> type, not just its name, arrives.
  bool is_bf16_mixed = false;
  amp::dispatch_precision<amp::CPU>("bf16-mixed", [&](auto p) {
    is_bf16_mixed = std::is_same_v<typename decltype(p)::type, amp::Mixed<amp::bf16, amp::NoScaler>>;
  });
  EXPECT_TRUE(is_bf16_mixed);
}

// Regression: the result comes back by value, not as a reference into
// dispatch_precision's frame (a Row of the sweep example was destroyed twice).
TEST(DispatchPrecision, ReturnsTheResultByValue) {
  auto make = [](auto p) {
    return std::vector<std::string>(64, std::string(100, 'x') + amp::policy_traits<typename decltype(p)::type>::name);
  };
  static_assert(std::is_same_v<decltype(amp::dispatch_precision<amp::CPU>("32", make)), std::vector<std::string>>);
  const std::vector<std::string> v = amp::dispatch_precision<amp::CPU>("32", make);
  ASSERT_EQ(v.size(), 64u);
  EXPECT_EQ(v.back(), std::string(100, 'x') + "32-true");
}

// The block-scaled recipes by name, the defaults and the two variants that
// dispatch by name only (mxfp8-floor, nvfp4-sr: in no sweep), where LibTorch
// has the float8 dtypes (2.1+), else a clear error naming the LibTorch version.
TEST(DispatchPrecision, BlockScaledNamesReachTheirRecipes) {
  for (const std::string name : {"mxfp8-rceil", "nvfp4", "mxfp8-floor", "nvfp4-sr"}) {
    SCOPED_TRACE(name);
    if (amp::detail::libtorch_at_least(2, 1)) {
      const bool same = amp::dispatch_precision<amp::CPU>(name, [&](auto p) {
        using P = typename decltype(p)::type;
        if (name == "nvfp4") return std::is_same_v<P, amp::Float8<amp::NVFP4<>>>;
        if (name == "nvfp4-sr") return std::is_same_v<P, amp::Float8<amp::NVFP4<true>>>;
        if (name == "mxfp8-floor") return std::is_same_v<P, amp::Float8<amp::MXFP8<amp::MxScaleMode::kFloor>>>;
        return std::is_same_v<P, amp::Float8<amp::MXFP8<>>>;
      });
      EXPECT_TRUE(same);
      // The variants are not swept: not in all_policies, so not in the typed suites.
      bool swept = false;
      amp::for_each_policy(amp::all_policies,
                           [&](auto p) { swept = swept || amp::precision_name<typename decltype(p)::type>() == name; });
      EXPECT_EQ(swept, name == "nvfp4" || name == "mxfp8-rceil");
    } else {
      try {
        amp::dispatch_precision<amp::CPU>(name, [](auto) {});
        FAIL() << "no throw";
      } catch (const c10::Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("amp: precision \"" + name + "\" is not supported on cpu with LibTorch 1."),
                  std::string::npos)
            << msg;
      }
    }
  }
}

TEST(DispatchPrecision, UnknownStringThrowsWithTheList) {
  try {
    amp::dispatch_precision<amp::CPU>("fp17", [](auto) {});
    FAIL() << "no throw";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("amp: unknown precision \"fp17\""), std::string::npos) << msg;
    for (const char* n : {"64-true", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"})
      EXPECT_NE(msg.find(n), std::string::npos) << n;
  }
}

TEST(DispatchPrecision, UnsupportedOnDeviceThrowsWithTheSupportedList) {
  try {
    amp::dispatch_precision<amp::CPU>("tf32-true", [](auto) {});
    FAIL() << "no throw";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("amp: precision \"tf32-true\" is not supported on cpu"), std::string::npos) << msg;
    EXPECT_NE(msg.find("bf16-mixed"), std::string::npos) << msg;
  }
}

}  // namespace
