// Tests for amp/float8: the scaling formulas against hand-computed values,
// saturation, the dimension filter, the batch padding of dW, and the linear's
// float8 path through a routing region. The float8 matmul needs a CPU
// _scaled_mm (LibTorch 2.8+; the tests that run one skip before); the
// delayed-scaling update is plain tensor math and runs on every LibTorch.
//
//   bazel test //tests:float8_test
#include "amp/float8/linear.h"
#include "amp/float8/delayed.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "amp/detail/compat_float8.h"
#include "amp/float8/recipe.h"
#include "amp/precision/region.h"
#include "../error_of.h"

namespace float8_test {  // a layer's test files share one TU (tests/BUILD.bazel)
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
  const auto next = f8::detail::delayed_scale_update(history, scale, 448.0, 0);
  EXPECT_TRUE(torch::equal(next, f32({224.0f, 448.0f})));  // 448 / 2, 448 / 1
  // roll by -1 ([2,0],[1,0],[0.5,1]), then slot 0 zeroed
  EXPECT_TRUE(torch::equal(history, torch::tensor({{0.0f, 0.0f}, {1.0f, 0.0f}, {0.5f, 1.0f}})));
}

TEST(Float8Delayed, MarginDividesByAPowerOfTwo) {
  auto history = torch::tensor({{4.0f}, {1.0f}});
  EXPECT_TRUE(
      torch::equal(f8::detail::delayed_scale_update(history, f32({1.0f}), 57344.0, 2), f32({3584.0f})));  // 57344/4/4
}

TEST(Float8Delayed, OneFp32DivisionAsTransformerEnginesKernel) {
  // TE's fused kernel: scale = scaled_max / amax, one IEEE division. Its
  // Python fallback (reciprocal, then times fp8_max) differs in the last bit here.
  auto history = torch::tensor({{3.0f}});
  const float kernel = 448.0f / 3.0f, fallback = (1.0f / 3.0f) * 448.0f;
  ASSERT_NE(kernel, fallback);
  EXPECT_TRUE(torch::equal(f8::detail::delayed_scale_update(history, f32({1.0f}), 448.0, 0), f32({kernel})));
}

TEST(Float8Delayed, AStepWithZeroAmaxChangesNothing) {
  // The step's amax (slot 0) is 0: the kernel neither rolls the history nor
  // uses its older amaxes; the scale stays.
  auto history = torch::tensor({{0.0f, 2.0f}, {5.0f, 4.0f}});
  const auto next = f8::detail::delayed_scale_update(history, f32({3.0f, 3.0f}), 448.0, 0);
  EXPECT_TRUE(torch::equal(next, f32({3.0f, 112.0f})));  // role 1: 448 / max(2, 4)
  EXPECT_TRUE(torch::equal(history, torch::tensor({{0.0f, 0.0f}, {5.0f, 2.0f}})));
}

TEST(Float8Delayed, ATinyAmaxGivesTheLargestFloatNotInf) {
  auto history = torch::tensor({{1e-40f}});  // 448 / 1e-40 overflows fp32
  EXPECT_TRUE(torch::equal(f8::detail::delayed_scale_update(history, f32({1.0f}), 448.0, 0),
                           f32({std::numeric_limits<float>::max()})));
}

TEST(Float8Delayed, InfKeepsTheScaleAndNanIsIgnored) {
  // Roles: a zero step, an inf step (old scale kept), a NaN step (CUDA's
  // fmaxf skips NaN: the amax is the history's 1), a finite step.
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  auto history = torch::tensor({{0.0f, inf, nan, 8.0f}, {0.0f, 1.0f, 1.0f, 0.0f}});
  const auto next = f8::detail::delayed_scale_update(history, f32({7.0f, 7.0f, 7.0f, 7.0f}), 448.0, 0);
  EXPECT_TRUE(torch::equal(next, f32({7.0f, 7.0f, 448.0f, 56.0f})));
  // every role but the zero step rolled: slot 1 holds the step's amax
  EXPECT_TRUE(torch::equal(history.select(0, 0), f32({0.0f, 0.0f, 0.0f, 0.0f})));
  const auto slot1 = history.select(0, 1);
  EXPECT_EQ(slot1[0].item<float>(), 0.0f);
  EXPECT_EQ(slot1[1].item<float>(), inf);
  EXPECT_TRUE(std::isnan(slot1[2].item<float>()));
  EXPECT_EQ(slot1[3].item<float>(), 8.0f);
}

TEST(Float8Delayed, ShapesAreChecked) {
  auto history = torch::zeros({4, 2});
  EXPECT_NE(error_of([&] {
              f8::detail::delayed_scale_update(history, torch::ones({3}), 448.0, 0);
            }).find("amp: delayed scaling needs an amax history [length, roles] and a scale [roles]"),
            std::string::npos);
}

TEST(Float8Fits, BothDimensionsMultiplesOf16) {
  EXPECT_TRUE(f8::detail::fits(torch::zeros({16, 32})));
  EXPECT_FALSE(f8::detail::fits(torch::zeros({16, 20})));
  EXPECT_FALSE(f8::detail::fits(torch::zeros({10, 32})));
  EXPECT_FALSE(f8::detail::fits(torch::zeros({32})));
}

#if AMP_DETAIL_HAS_FLOAT8_MATMUL

// --- tensorwise current scaling (torchao.float8's default) ---

TEST(Float8Tensorwise, ScaleFromAmax) {
  EXPECT_EQ(f8::detail::scale_from_amax(torch::tensor(2.0f), f8::detail::kE4M3).item<float>(), 224.0f);
  EXPECT_EQ(f8::detail::scale_from_amax(torch::tensor(7.0f), f8::detail::kE5M2).item<float>(), 8192.0f);
  EXPECT_EQ(f8::detail::scale_from_amax(torch::tensor(2.0f, torch::kBFloat16), f8::detail::kE4M3).scalar_type(),
            torch::kFloat);
  // amax 0: the 1e-12 floor, 448e12 as fp32
  EXPECT_EQ(f8::detail::scale_from_amax(torch::tensor(0.0f), f8::detail::kE4M3).item<float>(),
            static_cast<float>(448e12));
  EXPECT_NE(error_of([] {
              f8::detail::scale_from_amax(torch::tensor(1.0f), torch::kHalf);
            }).find("amp: float8 formats are at::kFloat8_e4m3fn and at::kFloat8_e5m2"),
            std::string::npos);
}

TEST(Float8Tensorwise, CastsSaturateAtTheFormatsLargestValue) {
  const auto x = f32({1000.0f, -1000.0f, 1e6f, 1.5f, 0.0f});
  const auto one = torch::tensor(1.0f), two = torch::tensor(2.0f);
  // e4m3: +-448 at most; 1.5 * 2 = 3 exactly
  EXPECT_TRUE(
      torch::equal(f8::detail::to_float8(x, two, f8::detail::kE4M3).to(torch::kFloat), f32({448, -448, 448, 3, 0})));
  // e5m2 (2 mantissa bits): 1000 rounds to 1024; 1e6 saturates at 57344 instead of inf
  EXPECT_TRUE(torch::equal(f8::detail::to_float8(x, one, f8::detail::kE5M2).to(torch::kFloat),
                           f32({1024, -1024, 57344, 1.5, 0})));
  EXPECT_EQ(f8::detail::to_float8(x, one, f8::detail::kE4M3).scalar_type(), torch::kFloat8_e4m3fn);
  EXPECT_TRUE(torch::equal(f8::detail::amax_of(f32({-3.0f, 2.0f})), torch::tensor(3.0f)));
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

// --- delayed scaling in the linear (amp/float8/delayed.h) ---

TEST(Float8DelayedScaling, TracksTheLinearsThatFitByTheirPath) {
  torch::nn::Sequential net(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 10));
  f8::DelayedScaling fp8(f8::DelayedOptions().history_length(4));
  EXPECT_EQ(fp8.track(*net), 1);
  EXPECT_EQ(fp8.tracked(), (std::vector<std::string>{"0"}));
  std::vector<std::string> keys;
  for (const auto& item : fp8.state_dict()) keys.push_back(item.key());
  EXPECT_EQ(keys, (std::vector<std::string>{"0.fwd_amax_history", "0.fwd_scale", "0.bwd_amax_history", "0.bwd_scale"}));
  EXPECT_EQ(fp8.state_dict()["0.fwd_amax_history"].sizes(), (std::vector<int64_t>{4, 2}));
  // the same model again: an error that adds nothing
  EXPECT_NE(error_of([&] { fp8.track(*net); }).find("amp: the weight 0 is already tracked"), std::string::npos);
  EXPECT_EQ(fp8.tracked().size(), 1u);
  // Options are checked where they are used (LibTorch's TORCH_ARG style).
  EXPECT_NE(error_of([] {
              f8::DelayedScaling bad(f8::DelayedOptions().history_length(0));
            }).find("amp: DelayedOptions::history_length must be at least 1, got 0"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              f8::DelayedScaling bad(f8::DelayedOptions().margin(-1));
            }).find("amp: DelayedOptions::margin is a power of 2 in [0, 64), got -1"),
            std::string::npos);
}

// One step by hand: the amaxes land in slot 0, the casts use the scales of
// before (1), update() turns the amaxes into scales and rolls the history.
TEST(Float8DelayedScaling, AStepKeepsTheAmaxesAndUpdateMakesTheScales) {
  SKIP_WITHOUT_CPU_FLOAT8();
  torch::manual_seed(5);
  torch::nn::Linear fc(32, 16);
  f8::DelayedScaling fp8(f8::DelayedOptions().history_length(3).margin(1));
  fp8.track(*fc);
  const auto x = torch::randn({8, 32}), dy = torch::randn({8, 16});
  torch::Tensor y;
  {
    amp::Region<Bf16, amp::CPU> region;
    f8::DelayedLinearGuard guard(fp8);
    y = fc->forward(x);
  }
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  y.backward(dy.to(torch::kBFloat16));
  auto state = fp8.state_dict();
  const float amax_x = x.to(torch::kBFloat16).abs().max().item<float>();
  const float amax_w = fc->weight.abs().max().item<float>();
  const float amax_g = dy.to(torch::kBFloat16).abs().max().item<float>();
  EXPECT_TRUE(
      torch::equal(state["linear.fwd_amax_history"], torch::tensor({{amax_x, amax_w}, {0.0f, 0.0f}, {0.0f, 0.0f}})));
  EXPECT_TRUE(torch::equal(state["linear.bwd_amax_history"], torch::tensor({{amax_g}, {0.0f}, {0.0f}})));
  EXPECT_TRUE(torch::equal(state["linear.fwd_scale"], f32({1.0f, 1.0f})));
  fp8.update();
  // (fp8_max / amax) / 2^margin, as TE computes it (reciprocal, then multiply)
  const auto expected_fwd = torch::tensor({amax_x, amax_w}).reciprocal() * 448.0 / 2.0;
  EXPECT_TRUE(torch::equal(state["linear.fwd_scale"], expected_fwd));
  EXPECT_TRUE(torch::equal(state["linear.bwd_scale"], torch::tensor({amax_g}).reciprocal() * 57344.0 / 2.0));
  EXPECT_TRUE(
      torch::equal(state["linear.fwd_amax_history"], torch::tensor({{0.0f, 0.0f}, {0.0f, 0.0f}, {amax_x, amax_w}})));
}

TEST(Float8DelayedScaling, AnUntrackedWeightThatFitsIsAnError) {
  SKIP_WITHOUT_CPU_FLOAT8();
  torch::nn::Linear tracked(32, 16), other(16, 16), small(16, 10);
  f8::DelayedScaling fp8;
  fp8.track(*tracked);
  amp::Region<Bf16, amp::CPU> region;
  f8::DelayedLinearGuard guard(fp8);
  const auto h = tracked->forward(torch::randn({4, 32}));
  EXPECT_NO_THROW(small->forward(h));  // does not fit: bf16
  EXPECT_NE(error_of([&] { other->forward(h); }).find("fits float8 but this DelayedScaling does not track it"),
            std::string::npos);
}

TEST(Float8DelayedScaling, LoadStateDictChecksEverythingFirst) {
  torch::nn::Linear fc(32, 16);
  f8::DelayedScaling a(f8::DelayedOptions().history_length(4)), b(f8::DelayedOptions().history_length(4)),
      shorter(f8::DelayedOptions().history_length(2));
  a.track(*fc);
  b.track(*fc);
  shorter.track(*fc);
  a.state_dict()["linear.fwd_amax_history"].fill_(3.0f);
  a.state_dict()["linear.bwd_scale"].fill_(7.0f);
  b.load_state_dict(a.state_dict());
  for (const auto& item : a.state_dict()) EXPECT_TRUE(torch::equal(item.value(), b.state_dict()[item.key()]));
  const auto before = torch::ones({1});
  EXPECT_NE(error_of([&] { shorter.load_state_dict(a.state_dict()); }).find("(another history length?)"),
            std::string::npos);
  EXPECT_TRUE(torch::equal(shorter.state_dict()["linear.bwd_scale"], before));  // unchanged
  f8::DelayedScaling none;
  EXPECT_NE(error_of([&] { none.load_state_dict(a.state_dict()); }).find("track the same linears before loading"),
            std::string::npos);
}

#endif  // AMP_DETAIL_HAS_FLOAT8_MATMUL

}  // namespace
}  // namespace float8_test
