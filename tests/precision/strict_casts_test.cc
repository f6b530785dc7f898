// Tests for amp/precision/strict_casts.h: raw manual fp16/bf16 casts inside a mixed
// region are caught at run time; autocast's own casts, fp32/fp64 casts, other
// threads and code outside the region are left alone.
//
//   bazel test //tests:strict_casts_test
#include "amp/precision/strict_casts.h"

#include "../error_of.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "amp/precision/region.h"
#include "amp/train/trainer.h"

namespace strict_casts_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

using amp::StrictCasts;
using Bf16Region = amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>;
using Fp64Region = amp::Region<amp::True<amp::fp64>, amp::CPU>;

bool key_included() { return c10::impl::tls_is_dispatch_key_included(amp::detail::kStrictCastsKey); }

int count(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (size_t pos = haystack.find(needle); pos != std::string::npos; pos = haystack.find(needle, pos + 1)) ++n;
  return n;
}

using amp_test::error_of;
// The start of strict casts' error for x.to(torch::kBFloat16) on an fp32 x.
constexpr const char* kRejected =
    "amp: manual cast to BFloat16 (aten::to.dtype from Float, e.g. x.to(torch::kBFloat16))";

class StrictCastsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(0);
    ASSERT_EQ(amp::detail::current_strict_casts(), StrictCasts::kOff);
    ASSERT_FALSE(key_included());
  }
  // Nothing may leak out of a test: no mode, no included key.
  void TearDown() override {
    EXPECT_EQ(amp::detail::current_strict_casts(), StrictCasts::kOff);
    EXPECT_FALSE(key_included());
  }
  torch::Tensor x = torch::randn({4, 8});
};

TEST_F(StrictCastsTest, ManualBf16AndHalfCastsThrowWithTheAmpMessage) {
  Bf16Region region(amp::RegionOptions().strict_casts(StrictCasts::kThrow));
  EXPECT_EQ(region.strict_casts(), StrictCasts::kThrow);
  EXPECT_EQ(amp::detail::current_strict_casts(), StrictCasts::kThrow);

  const std::string bf16 = error_of([&] { (void)x.to(torch::kBFloat16); });
  EXPECT_EQ(bf16.rfind("amp: manual cast to BFloat16 (aten::to.dtype from Float, e.g. x.to(torch::kBFloat16)) inside a "
                       "Mixed<bf16, ...> region on cpu is rejected by strict casts",
                       0),
            0u)
      << bf16;
  EXPECT_NE(bf16.find("let autocast choose the dtype"), std::string::npos) << bf16;
  EXPECT_NE(bf16.find("region.full_precision(f, x)"), std::string::npos) << bf16;
  EXPECT_NE(bf16.find("cast outside the region"), std::string::npos) << bf16;

  const std::string half = error_of([&] { (void)x.to(torch::kHalf); });
  EXPECT_EQ(half.rfind("amp: manual cast to Half (aten::to.dtype from Float, e.g. x.to(torch::kHalf))", 0), 0u) << half;

  // The other spellings, each named in the message.
  EXPECT_NE(error_of([&] { (void)x.to(x.options().dtype(torch::kBFloat16)); }).find("aten::to.dtype_layout"),
            std::string::npos);
  EXPECT_NE(error_of([&] { (void)x.to(torch::kCPU, torch::kHalf); }).find("aten::to.device"), std::string::npos);
  torch::Tensor bf16_tensor;
  EXPECT_NO_THROW(bf16_tensor = torch::zeros({1}, torch::kBFloat16));  // created, not cast: allowed
  EXPECT_NE(error_of([&] { (void)x.to(bf16_tensor); }).find("aten::to.other"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)x.type_as(bf16_tensor); }).find("aten::type_as"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)at::_to_copy(x, torch::kBFloat16); }).find("aten::_to_copy"), std::string::npos);
  // Integer tensors are cast too (masks, labels): the rule is about the dtype.
  EXPECT_EQ(error_of([&] {
              (void)torch::ones({2}, torch::kLong).to(torch::kBFloat16);
            }).rfind("amp: manual cast to BFloat16 (aten::to.dtype from Long", 0),
            0u);
}

// Casts that ATen makes inside an op the user called (type promotion in
// TensorIterator, a composite's pieces) are not the user's.
TEST_F(StrictCastsTest, CastsInsideOtherOpsAreNotFlagged) {
  torch::nn::Linear linear(8, 3);
  Bf16Region region(amp::RegionOptions().strict_casts(StrictCasts::kThrow));
  const auto y = linear(x);  // bf16
  torch::Tensor r;
  ASSERT_NO_THROW(r = y * 2);  // Long scalar -> bf16 inside mul
  EXPECT_EQ(r.scalar_type(), torch::kBFloat16);
  ASSERT_NO_THROW(r = y + torch::ones({}, torch::kLong));  // 0-dim Long tensor promoted to bf16
  EXPECT_EQ(r.scalar_type(), torch::kBFloat16);
  ASSERT_NO_THROW(r = y.pow(2).mean());
  ASSERT_NO_THROW(r = torch::where(y > 0, y, torch::zeros_like(y)));
  ASSERT_NO_THROW(r = torch::nn::functional::gelu(y));
}

TEST_F(StrictCastsTest, AutocastsOwnCastsAreNeverFlagged) {
  torch::nn::Linear linear(8, 3);
  torch::nn::Conv1d conv(torch::nn::Conv1dOptions(2, 2, 3));
  Bf16Region region(amp::RegionOptions().strict_casts(StrictCasts::kThrow));
  torch::Tensor y, z, m;
  ASSERT_NO_THROW(y = linear(x));
  ASSERT_NO_THROW(z = conv(torch::randn({1, 2, 8})));
  ASSERT_NO_THROW(m = torch::matmul(x, x.t()));
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);  // autocast did cast: weights and input to bf16
  EXPECT_EQ(z.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(m.scalar_type(), torch::kBFloat16);
  // A loss on autocast's fp32 list: autocast casts the bf16 input up to fp32.
  torch::Tensor loss;
  ASSERT_NO_THROW(loss = torch::mse_loss(y, torch::zeros({4, 3})));
  EXPECT_EQ(loss.scalar_type(), torch::kFloat);
}

TEST_F(StrictCastsTest, CastsToFp32AndFp64AndNoOpCastsAreAllowed) {
  torch::nn::Linear linear(8, 3);
  Bf16Region region(amp::RegionOptions().strict_casts(StrictCasts::kThrow));
  const auto y = linear(x);
  EXPECT_EQ(y.to(torch::kFloat).scalar_type(), torch::kFloat);
  EXPECT_EQ(x.to(torch::kDouble).scalar_type(), torch::kDouble);
  EXPECT_EQ(y.to(torch::kBFloat16).scalar_type(), torch::kBFloat16);  // already bf16: no cast happens
  EXPECT_EQ(region.cast<amp::fp32>(y).scalar_type(), torch::kFloat);
}

TEST_F(StrictCastsTest, AfterTheRegionTheSameCastWorks) {
  {
    Bf16Region region(amp::RegionOptions().strict_casts(StrictCasts::kThrow));
    EXPECT_THAT(error_of([&] { (void)x.to(torch::kBFloat16); }), ::testing::StartsWith(kRejected));
  }
  EXPECT_EQ(x.to(torch::kBFloat16).scalar_type(), torch::kBFloat16);
  EXPECT_EQ(x.to(torch::kHalf).scalar_type(), torch::kHalf);
}

TEST_F(StrictCastsTest, AnotherThreadIsUnaffected) {
  Bf16Region region(amp::RegionOptions().strict_casts(StrictCasts::kThrow));
  torch::ScalarType other = torch::kFloat;
  bool other_included = true;
  std::thread t([&] {
    other_included = key_included();
    other = x.to(torch::kBFloat16).scalar_type();
  });
  t.join();
  EXPECT_FALSE(other_included);
  EXPECT_EQ(other, torch::kBFloat16);
  EXPECT_THAT(error_of([&] { (void)x.to(torch::kBFloat16); }), ::testing::StartsWith(kRejected));  // still on here
}

TEST_F(StrictCastsTest, ARegionInAnotherThreadDoesNotReachThisOne) {
  std::mutex mu;
  std::condition_variable cv;
  bool inside = false, done = false;
  std::thread t([&] {
    Bf16Region region(amp::RegionOptions().strict_casts(StrictCasts::kThrow));
    std::unique_lock<std::mutex> lock(mu);
    inside = true;
    cv.notify_all();
    cv.wait(lock, [&] { return done; });
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return inside; });
    EXPECT_EQ(x.to(torch::kBFloat16).scalar_type(), torch::kBFloat16);
    done = true;
  }
  cv.notify_all();
  t.join();
}

TEST_F(StrictCastsTest, AnExceptionInsideTheRegionRemovesTheCheck) {
  try {
    Bf16Region region(amp::RegionOptions().strict_casts(StrictCasts::kThrow));
    throw std::runtime_error("user error");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(key_included());
  EXPECT_EQ(amp::detail::current_strict_casts(), StrictCasts::kOff);
  // And when the strict check itself threw:
  try {
    Bf16Region region(amp::RegionOptions().strict_casts(StrictCasts::kThrow));
    (void)x.to(torch::kHalf);
  } catch (const c10::Error&) {
  }
  EXPECT_FALSE(key_included());
  EXPECT_EQ(x.to(torch::kHalf).scalar_type(), torch::kHalf);
}

TEST_F(StrictCastsTest, WarnModeWarnsOncePerDtypeAndDoesNotThrow) {
  amp::detail::reset_strict_casts_warnings();
  ::testing::internal::CaptureStderr();
  torch::Tensor a, b, c, d;
  {
    Bf16Region region(amp::RegionOptions().strict_casts(StrictCasts::kWarn));
    a = x.to(torch::kBFloat16);
    b = (x * 2).to(torch::kBFloat16);
    c = x.to(torch::kHalf);
    d = x.to(torch::kHalf);
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(a.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(b.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(c.scalar_type(), torch::kHalf);
  EXPECT_EQ(d.scalar_type(), torch::kHalf);
  EXPECT_EQ(count(err, "amp: manual cast to BFloat16"), 1) << err;
  EXPECT_EQ(count(err, "amp: manual cast to Half"), 1) << err;
  EXPECT_NE(err.find("is discouraged by strict casts"), std::string::npos) << err;
}

TEST_F(StrictCastsTest, OffModeAndTrueRegionsCheckNothing) {
  {
    Bf16Region region(amp::RegionOptions().strict_casts(StrictCasts::kOff));
    EXPECT_FALSE(key_included());
    EXPECT_EQ(x.to(torch::kBFloat16).scalar_type(), torch::kBFloat16);
  }
  {
    Fp64Region region(amp::RegionOptions().strict_casts(StrictCasts::kThrow));  // no autocast, nothing to protect
    EXPECT_EQ(region.strict_casts(), StrictCasts::kOff);
    EXPECT_FALSE(key_included());
    EXPECT_EQ(x.to(torch::kBFloat16).scalar_type(), torch::kBFloat16);
  }
}

TEST_F(StrictCastsTest, NestedRegionsRestoreTheOuterMode) {
  Bf16Region outer(amp::RegionOptions().strict_casts(StrictCasts::kThrow));
  {
    Bf16Region inner(amp::RegionOptions().strict_casts(StrictCasts::kOff));
    EXPECT_EQ(x.to(torch::kBFloat16).scalar_type(), torch::kBFloat16);
  }
  EXPECT_EQ(amp::detail::current_strict_casts(), StrictCasts::kThrow);
  EXPECT_THAT(error_of([&] { (void)x.to(torch::kBFloat16); }), ::testing::StartsWith(kRejected));
}

TEST_F(StrictCastsTest, FullPrecisionIslandIsTheUsers) {
  Bf16Region region(amp::RegionOptions().strict_casts(StrictCasts::kThrow));
  const auto t = region.full_precision([](const torch::Tensor& v) { return v.to(torch::kBFloat16); }, x);
  EXPECT_EQ(t.scalar_type(), torch::kBFloat16);
  EXPECT_THAT(error_of([&] { (void)x.to(torch::kBFloat16); }),
              ::testing::StartsWith(kRejected));  // back on after the island
}

// The autograd engine casts gradients back to bf16 (ToCopyBackward0) during a
// backward() run inside the region: not the user's cast.
TEST_F(StrictCastsTest, BackwardInsideTheRegionIsNotFlagged) {
  torch::nn::Linear linear(8, 3);
  Bf16Region region(amp::RegionOptions().strict_casts(StrictCasts::kThrow));
  auto loss = torch::mse_loss(linear(x), torch::zeros({4, 3}));
  ASSERT_NO_THROW(loss.backward());
  EXPECT_EQ(linear->weight.grad().scalar_type(), torch::kFloat);
}

TEST(StrictCastsDefault, IsTheBuildWideSetting) {
  // strict_casts_test: the library's default (kThrow); strict_casts_warn_test
  // is built with AMP_STRICT_CASTS_DEFAULT=kWarn, NDEBUG either way.
#ifdef AMP_TEST_EXPECT_WARN_DEFAULT
  EXPECT_EQ(amp::detail::kDefaultStrictCasts, StrictCasts::kWarn);
#else
  EXPECT_EQ(amp::detail::kDefaultStrictCasts, StrictCasts::kThrow);
#endif
  EXPECT_EQ(amp::TrainerOptions().region().strict_casts(), amp::detail::kDefaultStrictCasts);
  EXPECT_STREQ(amp::detail::to_string(StrictCasts::kWarn), "warn");
}

// --- through the Trainer -----------------------------------------------------

struct Trained {
  std::vector<torch::Tensor> params;
  std::vector<double> losses;
};

Trained train(StrictCasts mode) {
  torch::manual_seed(7);
  torch::nn::Sequential model(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(
      model, opt, amp::TrainerOptions().region(amp::RegionOptions().strict_casts(mode)).progress(false));
  const auto xs = torch::randn({64, 16});
  const auto ys = torch::randint(0, 4, {64});
  Trained out;
  for (int i = 0; i < 8; ++i) {
    auto r = trainer.step([&](auto&) { return torch::cross_entropy_loss(model->forward(xs), ys); });
    out.losses.push_back(r.loss_value());
  }
  for (const auto& p : model->parameters()) out.params.push_back(p.detach().clone());
  return out;
}

TEST(StrictCastsTrainer, TrainsBitwiseTheSameWithStrictCastsOnAndOff) {
  const Trained on = train(StrictCasts::kThrow);
  const Trained off = train(StrictCasts::kOff);
  ASSERT_EQ(on.params.size(), off.params.size());
  for (size_t i = 0; i < on.params.size(); ++i) EXPECT_TRUE(torch::equal(on.params[i], off.params[i])) << i;
  EXPECT_EQ(on.losses, off.losses);
  EXPECT_LT(on.losses.back(), on.losses.front());
}

TEST(StrictCastsTrainer, AManualCastInTheForwardThrowsAndLeavesNoCheckBehind) {
  torch::nn::Linear model(8, 2);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(
      model, opt, amp::TrainerOptions().region(amp::RegionOptions().strict_casts(StrictCasts::kThrow)).progress(false));
  const auto x = torch::randn({4, 8});
  const auto before = model->weight.detach().clone();
  const std::string msg = error_of(
      [&] { trainer.step([&](auto&) { return model(x.to(torch::kBFloat16)).to(torch::kFloat).pow(2).mean(); }); });
  EXPECT_EQ(msg.rfind("amp: manual cast to BFloat16 (aten::to.dtype from Float", 0), 0u) << msg;
  EXPECT_TRUE(torch::equal(model->weight, before));
  EXPECT_FALSE(key_included());
  EXPECT_EQ(amp::detail::current_strict_casts(), StrictCasts::kOff);
}

}  // namespace
}  // namespace strict_casts_test
