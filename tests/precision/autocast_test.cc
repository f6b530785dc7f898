// Tests for amp/precision/autocast.h: Autocast<Dtype, Device> and AutocastDisabled<Device>
// against torch.autocast's __enter__/__exit__ semantics, on CPU (bf16).
//
//   bazel test //tests:autocast_test
//
// The CUDA guards are also checked here without a GPU: they only set CUDA's
// thread-local autocast state. Op-level CUDA checks GTEST_SKIP without a GPU.
#include "amp/precision/autocast.h"
#include "amp/precision/region.h"

#include "autocast_state.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn/modules/linear.h>

#include <condition_variable>
#include <mutex>
#include <ostream>
#include <stdexcept>
#include <thread>
#include <type_traits>

namespace autocast_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

namespace compat = amp::detail::compat;
using c10::DeviceType;
using c10::ScalarType;

using amp_test::kDefault;
using amp_test::nesting;
using amp_test::snapshot;
using amp_test::State;

at::Tensor linear_out() { return at::linear(at::ones({2, 4}), at::ones({3, 4})); }

// Every test starts and must end in the default state: a leaked guard would
// otherwise show up as a failure in a later, unrelated test.
class AutocastCpu : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(snapshot(), kDefault); }
  void TearDown() override { EXPECT_EQ(snapshot(), kDefault); }
};

TEST_F(AutocastCpu, CompileTimeMembers) {
  using A = amp::Autocast<amp::bf16, amp::CPU>;
  static_assert(A::scalar_type == ScalarType::BFloat16);
  static_assert(A::device_type == DeviceType::CPU);
  static_assert(std::is_same_v<A::dtype, amp::bf16> && std::is_same_v<A::device, amp::CPU>);
  static_assert(amp::Autocast<amp::fp16, amp::CUDA>::scalar_type == ScalarType::Half);
  static_assert(amp::Autocast<amp::fp16, amp::CUDA>::device_type == DeviceType::CUDA);
  static_assert(!std::is_copy_constructible_v<A> && !std::is_move_constructible_v<A>);
  static_assert(!std::is_copy_assignable_v<A> && !std::is_move_assignable_v<A>);
  static_assert(!std::is_copy_constructible_v<amp::AutocastDisabled<amp::CPU>>);
  static_assert(!std::is_move_constructible_v<amp::AutocastDisabled<amp::CPU>>);
  EXPECT_EQ(linear_out().scalar_type(), ScalarType::Float);
}

TEST_F(AutocastCpu, EnablesBf16AndRestoresOnExit) {
  {
    amp::Autocast<amp::bf16, amp::CPU> autocast;
    EXPECT_TRUE(autocast.enabled());
    EXPECT_TRUE(compat::autocast_enabled(DeviceType::CPU));
    EXPECT_FALSE(compat::autocast_enabled(DeviceType::CUDA));
    EXPECT_EQ(compat::autocast_dtype(DeviceType::CPU), ScalarType::BFloat16);
    EXPECT_EQ(nesting(), 1);
    EXPECT_TRUE(compat::autocast_cache_enabled());
    EXPECT_EQ(linear_out().scalar_type(), ScalarType::BFloat16);
  }
  EXPECT_EQ(linear_out().scalar_type(), ScalarType::Float);
}

TEST_F(AutocastCpu, EnabledFalseMirrorsTorch) {
  // torch.autocast(enabled=False): nesting still counted, ops in their own dtype.
  amp::Autocast<amp::bf16, amp::CPU> autocast(/*enabled=*/false);
  EXPECT_FALSE(autocast.enabled());
  EXPECT_FALSE(compat::autocast_enabled(DeviceType::CPU));
  EXPECT_EQ(nesting(), 1);
  EXPECT_EQ(linear_out().scalar_type(), ScalarType::Float);
}

TEST_F(AutocastCpu, CacheFlagInheritedSetAndRestored) {
  compat::set_autocast_cache_enabled(false);
  {
    amp::Autocast<amp::bf16, amp::CPU> inherits;  // cache_enabled=None keeps the current flag
    EXPECT_FALSE(compat::autocast_cache_enabled());
    {
      amp::Autocast<amp::bf16, amp::CPU> caches(true, /*cache_enabled=*/true);
      EXPECT_TRUE(compat::autocast_cache_enabled());
    }
    EXPECT_FALSE(compat::autocast_cache_enabled());
  }
  EXPECT_FALSE(compat::autocast_cache_enabled());
  compat::set_autocast_cache_enabled(true);
}

TEST_F(AutocastCpu, InnerGuardExitsOuterStillActive) {
  amp::Autocast<amp::bf16, amp::CPU> outer;
  {
    amp::AutocastDisabled<amp::CPU> island;
    EXPECT_FALSE(compat::autocast_enabled(DeviceType::CPU));
    EXPECT_EQ(compat::autocast_dtype(DeviceType::CPU), ScalarType::BFloat16);
    EXPECT_EQ(nesting(), 2);
    EXPECT_EQ(linear_out().scalar_type(), ScalarType::Float);
  }
  EXPECT_TRUE(compat::autocast_enabled(DeviceType::CPU));
  EXPECT_EQ(nesting(), 1);
  EXPECT_EQ(linear_out().scalar_type(), ScalarType::BFloat16);
  {
    amp::Autocast<amp::bf16, amp::CPU> inner;
    EXPECT_EQ(nesting(), 2);
  }
  EXPECT_TRUE(compat::autocast_enabled(DeviceType::CPU));
  EXPECT_EQ(linear_out().scalar_type(), ScalarType::BFloat16);
}

// The cast cache keeps one bf16 copy per fp32 leaf that requires grad (a
// weight) and is dropped only when the outermost guard exits. Observed through
// at::autocast::cached_cast (the function autocast's kernels call) and through
// a conv whose weight is changed in place.
TEST_F(AutocastCpu, CacheClearedExactlyWhenOutermostExits) {
  const at::Tensor w = at::randn({3, 2, 3, 3}).requires_grad_();
  const at::Tensor x = at::randn({1, 2, 5, 5});
  at::Tensor first_cast, y1;
  {
    amp::Autocast<amp::bf16, amp::CPU> outer;
    first_cast = at::autocast::cached_cast(ScalarType::BFloat16, w, DeviceType::CPU);
    y1 = at::conv2d(x, w);
    ASSERT_EQ(y1.scalar_type(), ScalarType::BFloat16);
    {
      amp::Autocast<amp::bf16, amp::CPU> inner;
      EXPECT_TRUE(at::autocast::cached_cast(ScalarType::BFloat16, w, DeviceType::CPU).is_same(first_cast));
      amp::AutocastDisabled<amp::CPU> island;
    }
    // Still cached after the inner guards exit ...
    EXPECT_TRUE(at::autocast::cached_cast(ScalarType::BFloat16, w, DeviceType::CPU).is_same(first_cast));
    {
      at::NoGradGuard no_grad;
      w.mul_(2);
    }
    // ... so inside the same outermost region an in-place update is not seen
    // by the conv (torch semantics: update weights outside autocast).
    EXPECT_TRUE(at::equal(at::conv2d(x, w), y1));
  }
  amp::Autocast<amp::bf16, amp::CPU> next;
  EXPECT_FALSE(at::autocast::cached_cast(ScalarType::BFloat16, w, DeviceType::CPU).is_same(first_cast));
  // bf16(2w) == 2 bf16(w) exactly, and the conv is linear in w.
  EXPECT_TRUE(at::equal(at::conv2d(x, w), y1 * 2));
}

TEST_F(AutocastCpu, ExceptionRestoresState) {
  compat::set_autocast_cache_enabled(true);
  try {
    amp::Autocast<amp::bf16, amp::CPU> outer;
    amp::Autocast<amp::bf16, amp::CPU> no_cache(true, /*cache_enabled=*/false);
    amp::AutocastDisabled<amp::CPU> island;
    amp::Autocast<amp::fp16, amp::CUDA> cuda;
    ASSERT_EQ(nesting(), 4);
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(snapshot(), kDefault);
}

// No GPU needed: the CUDA guard only touches CUDA's thread-local state.
TEST_F(AutocastCpu, CudaGuardSetsOnlyCudaState) {
  {
    amp::Autocast<amp::fp16, amp::CUDA> fp16;
    EXPECT_TRUE(compat::autocast_enabled(DeviceType::CUDA));
    EXPECT_EQ(compat::autocast_dtype(DeviceType::CUDA), ScalarType::Half);
    EXPECT_FALSE(compat::autocast_enabled(DeviceType::CPU));
    EXPECT_EQ(linear_out().scalar_type(), ScalarType::Float);  // CPU tensors unaffected
    {
      amp::Autocast<amp::bf16, amp::CUDA> bf16;
      EXPECT_EQ(compat::autocast_dtype(DeviceType::CUDA), ScalarType::BFloat16);
      amp::AutocastDisabled<amp::CUDA> off;
      EXPECT_FALSE(compat::autocast_enabled(DeviceType::CUDA));
    }
    EXPECT_TRUE(compat::autocast_enabled(DeviceType::CUDA));
    EXPECT_EQ(compat::autocast_dtype(DeviceType::CUDA), ScalarType::Half);
  }
  EXPECT_EQ(snapshot(), kDefault);
}

TEST_F(AutocastCpu, CudaOpsRunInFp16) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto opts = at::TensorOptions().device(at::kCUDA);
  amp::Autocast<amp::fp16, amp::CUDA> autocast;
  EXPECT_EQ(at::linear(at::ones({2, 4}, opts), at::ones({3, 4}, opts)).scalar_type(), ScalarType::Half);
  EXPECT_EQ(at::mse_loss(at::ones({2}, opts).to(at::kHalf), at::ones({2}, opts)).scalar_type(), ScalarType::Float);
  EXPECT_EQ(linear_out().scalar_type(), ScalarType::Float);  // CPU tensors: CPU autocast is off
}

// A tiny two-party rendezvous (std::barrier is C++20).
class Rendezvous {
 public:
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const int gen = generation_;
    if (++arrived_ == 2) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != gen; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int generation_ = 0;
};

TEST_F(AutocastCpu, GuardInOneThreadDoesNotChangeAnother) {
  Rendezvous rv;
  ScalarType in_guard = ScalarType::Undefined, other = ScalarType::Undefined;
  bool other_enabled = true;
  std::thread with_guard([&] {
    amp::Autocast<amp::bf16, amp::CPU> autocast;
    rv.arrive_and_wait();  // 1: the guard is active
    in_guard = linear_out().scalar_type();
    rv.arrive_and_wait();  // 2: both measured while the guard is still active
  });
  std::thread without([&] {
    rv.arrive_and_wait();
    other_enabled = compat::autocast_enabled(DeviceType::CPU);
    other = linear_out().scalar_type();
    rv.arrive_and_wait();
  });
  with_guard.join();
  without.join();
  EXPECT_EQ(in_guard, ScalarType::BFloat16);
  EXPECT_FALSE(other_enabled);
  EXPECT_EQ(other, ScalarType::Float);
}

TEST_F(AutocastCpu, NewThreadStartsWithAutocastOff) {
  amp::Autocast<amp::bf16, amp::CPU> outer(true, /*cache_enabled=*/false);
  State child{};
  ScalarType child_op = ScalarType::Undefined;
  std::thread t([&] {
    child = snapshot();
    child_op = linear_out().scalar_type();
  });
  t.join();
  EXPECT_EQ(child, kDefault);
  EXPECT_EQ(child_op, ScalarType::Float);
  EXPECT_EQ(linear_out().scalar_type(), ScalarType::BFloat16);
}

// Autocast routes LibTorch's C++ linears (amp/precision/linear_routing.h) by
// default, as a Region does: a weight is cast once per guard, as Python's
// nn.Linear is; LinearRouting::kOff and enabled=false leave LibTorch's ops.
TEST_F(AutocastCpu, RoutesLinearsByDefault) {
  EXPECT_EQ(amp::detail::current_linear_routing(), amp::LinearRouting::kOff);
  {
    amp::Autocast<amp::bf16, amp::CPU> on;
    EXPECT_EQ(amp::detail::current_linear_routing(), amp::LinearRouting::kOn);
    {
      amp::Autocast<amp::bf16, amp::CPU> off(amp::LinearRouting::kOff);
      EXPECT_EQ(amp::detail::current_linear_routing(), amp::LinearRouting::kOff);
    }
    {
      amp::Autocast<amp::bf16, amp::CPU> disabled(/*enabled=*/false);
      EXPECT_EQ(amp::detail::current_linear_routing(), amp::LinearRouting::kOff);
    }
    EXPECT_EQ(amp::detail::current_linear_routing(), amp::LinearRouting::kOn);
  }
  EXPECT_EQ(amp::detail::current_linear_routing(), amp::LinearRouting::kOff);
}

// A Linear called twice: its weight gradient under a bare Autocast is the
// routed Region's bit for bit, and differs from LibTorch's own ops (kOff),
// whose two casts sum their gradients in fp32.
TEST_F(AutocastCpu, ALinearCalledTwiceHasTheRoutedRegionsGradient) {
  enum class Guard { kAutocast, kAutocastOff, kRegion };
  auto weight_grad = [](Guard guard) {
    torch::manual_seed(0);
    torch::nn::Linear fc(64, 32);
    const at::Tensor x = torch::randn({16, 64}) * 4;
    at::Tensor loss;
    if (guard == Guard::kRegion) {
      amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> region;
      loss = fc(x).sum() + fc(x * 2).sum();
    } else {
      amp::Autocast<amp::bf16, amp::CPU> autocast(guard == Guard::kAutocast ? amp::LinearRouting::kOn
                                                                            : amp::LinearRouting::kOff);
      loss = fc(x).sum() + fc(x * 2).sum();
    }
    loss.backward();
    return fc->weight.grad().clone();
  };
  const at::Tensor routed = weight_grad(Guard::kRegion);
  EXPECT_TRUE(at::equal(weight_grad(Guard::kAutocast), routed));
  EXPECT_FALSE(at::equal(weight_grad(Guard::kAutocastOff), routed));
}

}  // namespace
}  // namespace autocast_test
