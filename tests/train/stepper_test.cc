// The Trainer's loss-scaling path, on CPU: Stepper<DynamicScaler> (the
// component Trainer::step runs after the forward) driven on fp32 gradients.
// LibTorch < 2.3 has no fp16 autocast on CPU, so this is the seam that keeps
// skip/backoff/clip/accumulate under test in CI without weakening any rule.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "amp/detail/compat.h"
#include "amp/scaler/dynamic_scaler.h"
#include "amp/scaler/no_scaler.h"
#include "amp/train/stepper.h"

namespace stepper_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

struct Fixture {
  torch::nn::Sequential net{torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 2)};
  torch::Tensor x, y;
  explicit Fixture(uint64_t seed = 0) {
    torch::manual_seed(seed);
    net = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 2));
    x = torch::randn({64, 8});
    y = torch::randn({64, 2});
  }
  torch::Tensor loss() { return torch::mse_loss(net->forward(x), y); }
  torch::Tensor loss(int64_t begin, int64_t n) {
    return torch::mse_loss(net->forward(x.narrow(0, begin, n)), y.narrow(0, begin, n));
  }
};

std::vector<torch::Tensor> snapshot(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}
bool bitwise_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}
std::vector<torch::Tensor> adam_state(torch::optim::Adam& opt) {
  std::vector<torch::Tensor> out;
  for (auto& p : opt.param_groups()[0].params()) {
    auto it = opt.state().find(amp::detail::compat::optim_state_key(p.unsafeGetTensorImpl()));
    if (it == opt.state().end()) continue;
    auto& s = static_cast<torch::optim::AdamParamState&>(*it->second);
    out.push_back(s.exp_avg().clone());
    out.push_back(s.exp_avg_sq().clone());
    out.push_back(torch::tensor(s.step()));
  }
  return out;
}

TEST(StepperDynamic, InfOrNanLossSkipsTheStepBacksOffAndTrainingContinues) {
  for (double poison : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    SCOPED_TRACE(poison);
    Fixture f;
    torch::optim::Adam opt(f.net->parameters(), torch::optim::AdamOptions(1e-2));
    amp::Stepper<amp::DynamicScaler> stepper(opt, {},
                                             amp::DynamicScaler(amp::DynamicScalerOptions().init_scale(1024.0)));
    auto r0 = stepper.step(f.loss());  // a clean step creates Adam's state
    ASSERT_TRUE(r0.optimizer_step);
    EXPECT_FALSE(r0.skipped());
    const auto params = snapshot(f.net->parameters());
    const auto state = adam_state(opt);
    ASSERT_FALSE(state.empty());

    auto r1 = stepper.step(f.loss() * poison);
    EXPECT_TRUE(r1.skipped());
    EXPECT_TRUE(bitwise_equal(params, f.net->parameters()));
    EXPECT_TRUE(bitwise_equal(state, adam_state(opt)));
    EXPECT_EQ(stepper.scaler().get_scale(), 512.0);

    auto r2 = stepper.step(f.loss());
    EXPECT_FALSE(r2.skipped());
    EXPECT_FALSE(bitwise_equal(params, f.net->parameters()));
    EXPECT_EQ(stepper.steps(), 3);
  }
}

TEST(StepperDynamic, ANanInOneGradientSkipsTheWholeStep) {
  Fixture f;
  torch::optim::SGD opt(f.net->parameters(), torch::optim::SGDOptions(0.1));
  amp::Stepper<amp::DynamicScaler> stepper(opt);
  const auto params = snapshot(f.net->parameters());
  auto weight = f.net->parameters()[2];
  auto hook = weight.register_hook([](torch::Tensor g) { return g.index_fill(0, torch::tensor({0}), NAN); });
  auto r = stepper.step(f.loss());
  weight.remove_hook(hook);
  EXPECT_TRUE(r.skipped());
  EXPECT_TRUE(bitwise_equal(params, f.net->parameters()));
  EXPECT_EQ(stepper.scaler().get_scale(), 32768.0);
  EXPECT_FALSE(stepper.step(f.loss()).skipped());
}

TEST(StepperDynamic, UpdatesMatchAnUnscaledLoopExactlyWhenNothingOverflows) {
  // Scaling by a power of two and unscaling is exact in fp32: the parameters
  // follow a plain fp32 loop bit for bit.
  Fixture a(3), b(3);
  torch::optim::SGD opt_a(a.net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD opt_b(b.net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  amp::Stepper<amp::DynamicScaler> scaled(opt_a);
  amp::Stepper<amp::NoScaler> plain(opt_b);
  for (int i = 0; i < 10; ++i) {
    scaled.step(a.loss());
    plain.step(b.loss());
  }
  EXPECT_TRUE(bitwise_equal(a.net->parameters(), b.net->parameters()));
}

TEST(StepperDynamic, ClipsTheUnscaledGradients) {
  Fixture a(4), b(4);
  const double max_norm = 0.05;
  torch::optim::SGD opt_a(a.net->parameters(), torch::optim::SGDOptions(1.0));
  amp::Stepper<amp::DynamicScaler> stepper(opt_a, amp::StepOptions().max_grad_norm(max_norm));
  const auto before = snapshot(a.net->parameters());
  stepper.step(a.loss());
  // Reference: fp32 gradients clipped by hand to the true norm.
  b.loss().backward();
  double sq = 0;
  for (const auto& p : b.net->parameters()) sq += p.grad().pow(2).sum().item<double>();
  const double coef = std::min(1.0, max_norm / (std::sqrt(sq) + 1e-6));
  ASSERT_LT(coef, 1.0) << "the test needs a norm above max_norm";
  auto after = a.net->parameters();
  auto pb = b.net->parameters();
  double clipped_sq = 0;
  for (size_t i = 0; i < after.size(); ++i) {
    auto step = before[i] - after[i];  // lr 1: the step is the clipped gradient
    EXPECT_TRUE(torch::allclose(step, pb[i].grad() * coef, 1e-5, 1e-7)) << i;
    clipped_sq += step.pow(2).sum().item<double>();
  }
  EXPECT_NEAR(std::sqrt(clipped_sq), max_norm, 1e-5);
}

TEST(StepperDynamic, AccumulationEqualsOneBigBatch) {
  Fixture a(5), b(5);
  torch::optim::SGD opt_a(a.net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt_b(b.net->parameters(), torch::optim::SGDOptions(0.1));
  amp::Stepper<amp::DynamicScaler> micro(opt_a, amp::StepOptions().accumulation_steps(4));
  amp::Stepper<amp::DynamicScaler> big(opt_b);
  for (int s = 0; s < 3; ++s) {
    for (int m = 0; m < 4; ++m) {
      auto r = micro.step(a.loss(m * 16, 16));
      EXPECT_EQ(r.optimizer_step, m == 3);
    }
    big.step(b.loss());
  }
  auto pa = a.net->parameters(), pb = b.net->parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::allclose(pa[i], pb[i], 1e-5, 1e-6)) << i;
  EXPECT_EQ(micro.steps(), 3);
}

TEST(StepperDynamic, GrowsAfterGrowthIntervalCleanSteps) {
  Fixture f;
  torch::optim::SGD opt(f.net->parameters(), torch::optim::SGDOptions(0.01));
  amp::Stepper<amp::DynamicScaler> stepper(
      opt, {}, amp::DynamicScaler(amp::DynamicScalerOptions().init_scale(4.0).growth_interval(3)));
  std::vector<double> scales;
  for (int i = 0; i < 7; ++i) {
    stepper.step(f.loss());
    scales.push_back(stepper.scaler().get_scale());
  }
  EXPECT_EQ(scales, (std::vector<double>{4, 4, 8, 8, 8, 16, 16}));
}

}  // namespace
}  // namespace stepper_test
