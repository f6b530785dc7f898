// Tests for amp/float8: the scaling formulas against hand-computed values,
// saturation, the dimension filter, the batch padding of dW, and the linear's
// float8 path through a routing region. The float8 matmul needs a CPU
// _scaled_mm (LibTorch 2.8+; the tests that run one skip before); the
// delayed-scaling update is plain tensor math and runs on every LibTorch.
//
//   bazel test //tests:float8_test
#include "amp/float8/linear.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "amp/detail/compat_float8.h"
#include "amp/float8/recipe.h"
#include "amp/region.h"
#include "error_of.h"

namespace {

namespace f8 = amp::float8;
using amp_test::error_of;
using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;
constexpr bool kCpuFloat8 = amp::detail::compat::kCpuHasScaledMm;

#define SKIP_WITHOUT_CPU_FLOAT8()                                                                     \
  if (!kCpuFloat8)                                                                                    \
  GTEST_SKIP() << "needs a CPU at::_scaled_mm (LibTorch 2.8+; this is " << TORCH_VERSION_MAJOR << "." \
               << TORCH_VERSION_MINOR << ")"

torch::Tensor f32(std::initializer_list<float> v) { return torch::tensor(std::vector<float>(v), torch::kFloat); }

// --- delayed scaling (TE's DelayedScaling, amax_compute_algo "max") ---

TEST(Float8Delayed, ScaleIsMaxOverTheHistoryAndTheHistoryRolls) {
  // history [length 3, roles 2]
  auto history = torch::tensor({{0.5f, 1.0f}, {2.0f, 0.0f}, {1.0f, 0.0f}});
  const auto scale = f32({1.0f, 5.0f});
  const auto next = f8::delayed_scale_update(history, scale, 448.0, 0);
  EXPECT_TRUE(torch::equal(next, f32({224.0f, 448.0f})));  // 448 / 2, 448 / 1
  // roll by -1 ([2,0],[1,0],[0.5,1]), then slot 0 zeroed
  EXPECT_TRUE(torch::equal(history, torch::tensor({{0.0f, 0.0f}, {1.0f, 0.0f}, {0.5f, 1.0f}})));
}

TEST(Float8Delayed, MarginDividesByAPowerOfTwo) {
  auto history = torch::tensor({{4.0f}, {1.0f}});
  EXPECT_TRUE(torch::equal(f8::delayed_scale_update(history, f32({1.0f}), 57344.0, 2), f32({3584.0f})));  // 57344/4/4
}

TEST(Float8Delayed, ZeroInfAndNanAmaxKeepThePreviousScale) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  auto history = torch::tensor({{0.0f, inf, nan, 8.0f}, {0.0f, 1.0f, 1.0f, 0.0f}});
  const auto next = f8::delayed_scale_update(history, f32({7.0f, 7.0f, 7.0f, 7.0f}), 448.0, 0);
  EXPECT_TRUE(torch::equal(next, f32({7.0f, 7.0f, 7.0f, 56.0f})));
}

TEST(Float8Delayed, ShapesAreChecked) {
  auto history = torch::zeros({4, 2});
  EXPECT_NE(error_of([&] {
              f8::delayed_scale_update(history, torch::ones({3}), 448.0, 0);
            }).find("amp: delayed scaling needs an amax history [length, roles] and a scale [roles]"),
            std::string::npos);
}

TEST(Float8Fits, BothDimensionsMultiplesOf16) {
  EXPECT_TRUE(f8::fits(torch::zeros({16, 32})));
  EXPECT_FALSE(f8::fits(torch::zeros({16, 20})));
  EXPECT_FALSE(f8::fits(torch::zeros({10, 32})));
  EXPECT_FALSE(f8::fits(torch::zeros({32})));
}

#if AMP_DETAIL_HAS_FLOAT8_MATMUL

// --- tensorwise current scaling (torchao.float8's default) ---

TEST(Float8Tensorwise, ScaleFromAmax) {
  EXPECT_EQ(f8::scale_from_amax(torch::tensor(2.0f), f8::kE4M3).item<float>(), 224.0f);
  EXPECT_EQ(f8::scale_from_amax(torch::tensor(7.0f), f8::kE5M2).item<float>(), 8192.0f);
  EXPECT_EQ(f8::scale_from_amax(torch::tensor(2.0f, torch::kBFloat16), f8::kE4M3).scalar_type(), torch::kFloat);
  // amax 0: the 1e-12 floor, 448e12 as fp32
  EXPECT_EQ(f8::scale_from_amax(torch::tensor(0.0f), f8::kE4M3).item<float>(), static_cast<float>(448e12));
  EXPECT_NE(error_of([] {
              f8::scale_from_amax(torch::tensor(1.0f), torch::kHalf);
            }).find("amp: float8 formats are at::kFloat8_e4m3fn and at::kFloat8_e5m2"),
            std::string::npos);
}

TEST(Float8Tensorwise, CastsSaturateAtTheFormatsLargestValue) {
  const auto x = f32({1000.0f, -1000.0f, 1e6f, 1.5f, 0.0f});
  const auto one = torch::tensor(1.0f), two = torch::tensor(2.0f);
  // e4m3: +-448 at most; 1.5 * 2 = 3 exactly
  EXPECT_TRUE(torch::equal(f8::to_float8(x, two, f8::kE4M3).to(torch::kFloat), f32({448, -448, 448, 3, 0})));
  // e5m2 (2 mantissa bits): 1000 rounds to 1024; 1e6 saturates at 57344 instead of inf
  EXPECT_TRUE(torch::equal(f8::to_float8(x, one, f8::kE5M2).to(torch::kFloat), f32({1024, -1024, 57344, 1.5, 0})));
  EXPECT_EQ(f8::to_float8(x, one, f8::kE4M3).scalar_type(), torch::kFloat8_e4m3fn);
  EXPECT_TRUE(torch::equal(f8::amax_of(f32({-3.0f, 2.0f})), torch::tensor(3.0f)));
}

double relative_error(const torch::Tensor& got, const torch::Tensor& want) {
  return ((got.to(torch::kFloat) - want).norm() / want.norm()).item<double>();
}

TEST(Float8Linear, ForwardAndGradientsAreCloseToFp32) {
  SKIP_WITHOUT_CPU_FLOAT8();
  torch::manual_seed(0);
  auto x = torch::randn({24, 64}, torch::requires_grad());
  auto w = torch::randn({32, 64}, torch::requires_grad());
  auto b = torch::randn({32}, torch::requires_grad());
  const auto dy = torch::randn({24, 32});
  auto y = f8::linear(x, w, b);
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  y.backward(dy.to(torch::kBFloat16));
  auto x32 = x.detach().clone().requires_grad_(), w32 = w.detach().clone().requires_grad_();
  auto b32 = b.detach().clone().requires_grad_();
  auto y32 = torch::linear(x32, w32, b32);
  y32.backward(dy);
  // e4m3 keeps 3 mantissa bits, e5m2 2: a few percent on random data
  EXPECT_LT(relative_error(y, y32), 0.06);
  EXPECT_LT(relative_error(x.grad(), x32.grad()), 0.12);
  EXPECT_LT(relative_error(w.grad(), w32.grad()), 0.12);
  EXPECT_LT(relative_error(b.grad(), b32.grad()), 0.01);
  EXPECT_EQ(x.grad().scalar_type(), torch::kFloat);
  EXPECT_EQ(w.grad().scalar_type(), torch::kFloat);
}

TEST(Float8Linear, InputsOfAnyRankAreFlattenedForTheMatmul) {
  SKIP_WITHOUT_CPU_FLOAT8();
  torch::manual_seed(1);
  const auto x = torch::randn({2, 8, 32}), w = torch::randn({16, 32});
  const auto y = f8::linear(x, w);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 8, 16}));
  EXPECT_TRUE(torch::equal(y, f8::linear(x.reshape({16, 32}), w).reshape({2, 8, 16})));
  EXPECT_NE(error_of([&] {
              f8::linear(torch::randn({4, 16}), w);
            }).find("amp: float8::linear got input"),
            std::string::npos);
}

// dW = dYᵀ·X sums over the batch, padded with zero rows to a multiple of 16:
// 10 rows give the bits of the same 10 rows followed by 6 zero rows (the
// amaxes, hence the scales, are the same).
TEST(Float8Linear, WeightGradientOverABatchThatIsNotAMultipleOf16) {
  SKIP_WITHOUT_CPU_FLOAT8();
  torch::manual_seed(2);
  const auto x = torch::randn({10, 32}), dy = torch::randn({10, 16}).to(torch::kBFloat16);
  const auto w0 = torch::randn({16, 32});
  auto w = w0.clone().requires_grad_();
  f8::linear(x, w).backward(dy);
  auto w_padded = w0.clone().requires_grad_();
  f8::linear(torch::cat({x, torch::zeros({6, 32})}), w_padded)
      .backward(torch::cat({dy, torch::zeros_like(dy).narrow(0, 0, 6)}));
  EXPECT_TRUE(torch::equal(w.grad(), w_padded.grad()));
}

TEST(Float8Linear, AWeightThatDoesNotFitRunsAtLinear) {
  torch::manual_seed(3);
  const auto x = torch::randn({8, 20}), w = torch::randn({16, 20}), b = torch::randn({16});
  amp::Region<Bf16, amp::CPU> region;
  EXPECT_TRUE(torch::equal(f8::linear(x, w, b), torch::linear(x, w, b)));  // bf16 by autocast
}

// In a routing region with the guard, C++ modules' linears run float8::linear:
// a Sequential gives the bits of the same layers called by hand.
TEST(Float8Linear, RoutedModulesRunTheFloat8Path) {
  SKIP_WITHOUT_CPU_FLOAT8();
  torch::manual_seed(4);
  torch::nn::Sequential net(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 10));
  const auto x = torch::randn({24, 32});
  auto* fc1 = net[0]->as<torch::nn::Linear>();
  auto* fc2 = net[2]->as<torch::nn::Linear>();
  torch::Tensor routed, by_hand, plain;
  {
    amp::Region<Bf16, amp::CPU> region;
    f8::LinearGuard fp8;
    routed = net->forward(x);
    by_hand = torch::linear(torch::relu(f8::linear(x, fc1->weight, fc1->bias)), fc2->weight, fc2->bias);
  }
  {
    amp::Region<Bf16, amp::CPU> region;  // the guard gone: bf16 again
    plain = net->forward(x);
  }
  EXPECT_TRUE(torch::equal(routed, by_hand));
  EXPECT_FALSE(torch::equal(routed, plain));
  EXPECT_EQ(amp::detail::set_linear_fn(nullptr), nullptr);  // the guard put the default back
}

#endif  // AMP_DETAIL_HAS_FLOAT8_MATMUL

}  // namespace
