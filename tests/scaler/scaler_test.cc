// tests/scaler/scaler_test.cc: DynamicScaler (= GradScaler) against torch.amp.GradScaler's behaviour.
//
// Ports torch's own GradScaler tests (test/test_cuda.py, test_torch.py:
// test_grad_scaling_update_scale, _unscale_sparse, _state_dict, _clipping,
// _clipping_separate_unscale, _accumulation, _multiple, test_grad_scale_will_not_overflow)
// to CPU, plus every error message, the state machine, skipped steps leaving
// parameters and Adam state bitwise alone, checkpoints (pickle included) and
// amp's extensions. The portable path against a scalar reference lives in
// scaler_reference_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "amp/detail/compat.h"
#include "amp/scaler/dynamic_scaler.h"
#include "amp/scaler/no_scaler.h"
#include "amp/scaler/state_dict.h"
#include "amp/scaler/static_scaler.h"
#include "../error_of.h"

namespace scaler_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

using amp_test::error_of;

// One parameter whose gradient the test sets by hand: the smallest harness for
// driving the scaler's state machine and update rule.
struct Harness {
  torch::Tensor param = torch::zeros({4}, torch::requires_grad());
  torch::optim::SGD optimizer{std::vector<torch::Tensor>{param}, torch::optim::SGDOptions(1.0)};

  void set_grad(float value) { param.mutable_grad() = torch::full({4}, value); }

  // One iteration: scale (creates the scale lazily), a gradient that is inf
  // or finite, step, update.
  void iterate(amp::DynamicScaler& scaler, bool overflow) {
    scaler.scale(torch::ones({}));
    set_grad(overflow ? kInf : 1.0f);
    scaler.step(optimizer);
    scaler.update();
  }
};

// --- lazy init, scale() --------------------------------------------------------

// The optional capabilities (core/scaler_concept.h): the loss-scaling
// scalers have all four; NoScaler reports found_inf (undefined: no check).
struct MinimalScaler {
  static constexpr bool kLossScaling = true;
  torch::Tensor scale(const torch::Tensor& t) { return t; }
  void unscale_(torch::optim::Optimizer&) {}
  void step(torch::optim::Optimizer& o) { o.step(); }
  void update() {}
  double get_scale() const { return 1.0; }
  bool is_enabled() const { return true; }
  amp::StateDict state_dict() const { return amp::empty_state_dict(); }
  void load_state_dict(const amp::StateDict&) {}
};
template <class S>
constexpr int capabilities() {
  using C = amp::scaler_capabilities<S>;
  return C::found_inf * 1 + C::scale_async * 2 + C::fused_step * 4 + C::discard_iteration * 8;
}
static_assert(capabilities<amp::DynamicScaler>() == 15);
static_assert(capabilities<amp::StaticScaler>() == 15);
static_assert(capabilities<amp::NoScaler>() == 1);
static_assert(amp::is_scaler_v<MinimalScaler> && capabilities<MinimalScaler>() == 0);

TEST(ScalerState, EmptyStateDictIsEmptyAndTyped) {
  amp::StateDict s = amp::empty_state_dict();
  EXPECT_EQ(s.size(), 0u);
  s.insert("scale", c10::IValue(2.0));
  EXPECT_EQ(s.at("scale").toDouble(), 2.0);
}

TEST(DynamicScaler, DefaultsAreTorchs) {
  amp::GradScaler scaler;
  EXPECT_TRUE(scaler.is_enabled());
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.get_growth_factor(), 2.0);
  EXPECT_EQ(scaler.get_backoff_factor(), 0.5);
  EXPECT_EQ(scaler.get_growth_interval(), 2000);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
  static_assert(amp::is_scaler_v<amp::GradScaler>);
  static_assert(amp::detail::uses_loss_scaling_v<amp::DynamicScaler>);
}

TEST(DynamicScaler, ScaleMultipliesAndLazilyCreatesScale) {
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(3.0));
  EXPECT_FALSE(scaler.found_inf().defined());
  const torch::Tensor loss = torch::full({}, 2.0f);
  const torch::Tensor scaled = scaler.scale(loss);
  EXPECT_EQ(scaled.item<float>(), 6.0f);
  EXPECT_EQ(scaled.scalar_type(), torch::kFloat);
  // An fp16/bf16 output stays in its dtype (the 0-dim fp32 scale does not promote it).
  EXPECT_EQ(scaler.scale(torch::ones({3}, torch::kBFloat16)).scalar_type(), torch::kBFloat16);
  EXPECT_EQ(scaler.scale(torch::ones({3}, torch::kDouble)).scalar_type(), torch::kDouble);
}

TEST(DynamicScaler, ScaleIsDifferentiable) {
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(8.0));
  const torch::Tensor w = torch::full({2}, 3.0f, torch::requires_grad());
  scaler.scale((w * w).sum()).backward();
  EXPECT_TRUE(torch::equal(w.grad(), torch::full({2}, 48.0f)));
}

TEST(DynamicScaler, ScaleListLikeTorch) {
  // test_grad_scaling_scale: a list of outputs, scaled on their devices.
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(2.0));
  const std::vector<torch::Tensor> outputs{torch::full({1}, 4.0f), torch::full({2}, 3.0f)};
  const std::vector<torch::Tensor> scaled = scaler.scale(outputs);
  ASSERT_EQ(scaled.size(), 2u);
  EXPECT_TRUE(torch::equal(scaled[0], torch::full({1}, 8.0f)));
  EXPECT_TRUE(torch::equal(scaled[1], torch::full({2}, 6.0f)));
  EXPECT_TRUE(scaler.scale(std::vector<torch::Tensor>{}).empty());
}

// --- the update rule: test_grad_scaling_update_scale and friends ---------------

TEST(DynamicScaler, UpdateScaleLikeTorchsKernelTest) {
  // torch: growth 2, backoff 0.25, interval 2, scale 4: two clean -> 8, inf -> 2.
  amp::GradScaler scaler(
      amp::DynamicScalerOptions().init_scale(4.0).growth_factor(2.0).backoff_factor(0.25).growth_interval(2));
  Harness h;
  h.iterate(scaler, false);
  EXPECT_EQ(scaler.get_growth_tracker(), 1);
  EXPECT_EQ(scaler.get_scale(), 4.0);
  h.iterate(scaler, false);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
  EXPECT_EQ(scaler.get_scale(), 8.0);
  h.iterate(scaler, true);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
  EXPECT_EQ(scaler.get_scale(), 2.0);
}

TEST(DynamicScaler, GrowsExactlyAtTheIntervalthConsecutiveCleanStep) {
  const int64_t interval = 5;
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(16.0).growth_interval(interval));
  Harness h;
  for (int round = 0; round < 3; ++round) {
    const double before = scaler.get_scale();
    for (int64_t i = 1; i < interval; ++i) {
      h.iterate(scaler, false);
      EXPECT_EQ(scaler.get_scale(), before) << "grew early at clean step " << i;
      EXPECT_EQ(scaler.get_growth_tracker(), i);
    }
    h.iterate(scaler, false);
    EXPECT_EQ(scaler.get_scale(), 2.0 * before);
    EXPECT_EQ(scaler.get_growth_tracker(), 0);
  }
}

TEST(DynamicScaler, OverflowBacksOffAndRestartsTheGrowthCount) {
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(1024.0).growth_interval(3));
  Harness h;
  h.iterate(scaler, false);
  h.iterate(scaler, false);
  EXPECT_EQ(scaler.get_growth_tracker(), 2);
  h.iterate(scaler, true);
  EXPECT_EQ(scaler.get_scale(), 512.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
  // A NaN gradient counts as an overflow too.
  scaler.scale(torch::ones({}));
  h.set_grad(kNaN);
  scaler.step(h.optimizer);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 256.0);
  // Growth needs three new consecutive clean steps.
  h.iterate(scaler, false);
  h.iterate(scaler, false);
  EXPECT_EQ(scaler.get_scale(), 256.0);
  h.iterate(scaler, false);
  EXPECT_EQ(scaler.get_scale(), 512.0);
}

TEST(DynamicScaler, WillNotGrowToInf) {
  // test_grad_scale_will_not_overflow: init 1e38, growth 2**4, interval 1.
  torch::manual_seed(0);
  torch::nn::Linear model(5, 1);
  torch::optim::Adam optimizer(model->parameters());
  amp::GradScaler scaler(amp::DynamicScalerOptions().growth_interval(1).growth_factor(16.0).init_scale(1e38));
  const torch::Tensor x = torch::randn({1, 5});
  const torch::Tensor y = 1e-30 * torch::randn({1, 1});
  scaler.scale((model(x) - y).pow(2).mean()).backward();
  scaler.step(optimizer);
  scaler.update();
  EXPECT_TRUE(std::isfinite(scaler.get_scale()));
  EXPECT_EQ(scaler.get_scale(), static_cast<double>(static_cast<float>(1e38)));
  EXPECT_EQ(scaler.get_growth_tracker(), 0);  // the interval was reached; only the growth is refused

  // Near FLT_MAX with growth 2: 2 * 2**127 overflows fp32, so the scale stays.
  const double big = std::ldexp(1.0, 127);
  amp::GradScaler edge(amp::DynamicScalerOptions().init_scale(big).growth_interval(1));
  Harness h;
  h.iterate(edge, false);
  EXPECT_EQ(edge.get_scale(), big);
  EXPECT_EQ(edge.get_growth_tracker(), 0);
}

TEST(DynamicScaler, NonPowerOfTwoFactorsRoundLikeTheKernel) {
  // The kernel multiplies float scale by double factor and rounds once to float.
  amp::GradScaler scaler(
      amp::DynamicScalerOptions().init_scale(1000.0).growth_factor(1.1).backoff_factor(0.3).growth_interval(1));
  Harness h;
  float expected = 1000.0f;
  const bool pattern[] = {false, false, true, false, true, true, false, false, false};
  for (bool overflow : pattern) {
    h.iterate(scaler, overflow);
    expected = overflow ? static_cast<float>(static_cast<double>(expected) * 0.3)
                        : static_cast<float>(static_cast<double>(expected) * 1.1);
    EXPECT_EQ(scaler.get_scale(), static_cast<double>(expected));
  }
}

// --- step(): skipping ------------------------------------------------------------

struct AdamSnapshot {
  std::vector<int64_t> steps;
  std::vector<torch::Tensor> exp_avg, exp_avg_sq, params;
};

AdamSnapshot snapshot(torch::optim::Adam& optimizer, const std::vector<torch::Tensor>& params) {
  AdamSnapshot s;
  for (const auto& p : params) {
    auto& state = static_cast<torch::optim::AdamParamState&>(
        *optimizer.state().at(amp::detail::compat::optim_state_key(p.unsafeGetTensorImpl())));
    s.steps.push_back(state.step());
    s.exp_avg.push_back(state.exp_avg().clone());
    s.exp_avg_sq.push_back(state.exp_avg_sq().clone());
    s.params.push_back(p.detach().clone());
  }
  return s;
}

TEST(DynamicScaler, SkippedStepLeavesParamsAndAdamStateBitwiseUnchanged) {
  torch::manual_seed(1);
  torch::nn::Sequential model(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(128.0));
  const torch::Tensor x = torch::randn({8, 8});
  const torch::Tensor t = torch::randn({8, 8});
  auto iteration = [&](bool inject_inf) {
    optimizer.zero_grad();
    scaler.scale(torch::mse_loss(model->forward(x), t)).backward();
    if (inject_inf) {
      model->parameters()[2].mutable_grad().fill_(kInf);
    }
    const torch::Tensor ret = scaler.step(optimizer);
    scaler.update();
    return ret;
  };
  iteration(false);  // Adam state exists now
  const AdamSnapshot before = snapshot(optimizer, model->parameters());
  iteration(true);
  const AdamSnapshot after = snapshot(optimizer, model->parameters());
  EXPECT_EQ(scaler.get_scale(), 64.0);
  for (size_t i = 0; i < before.params.size(); ++i) {
    EXPECT_EQ(before.steps[i], after.steps[i]);
    EXPECT_TRUE(torch::equal(before.params[i], after.params[i])) << "param " << i;
    EXPECT_TRUE(torch::equal(before.exp_avg[i], after.exp_avg[i])) << "exp_avg " << i;
    EXPECT_TRUE(torch::equal(before.exp_avg_sq[i], after.exp_avg_sq[i])) << "exp_avg_sq " << i;
  }
  iteration(false);
  const AdamSnapshot stepped = snapshot(optimizer, model->parameters());
  EXPECT_EQ(stepped.steps[0], before.steps[0] + 1);
  EXPECT_FALSE(torch::equal(stepped.params[0], before.params[0]));
}

TEST(DynamicScaler, StepReturnsWhatOptimizerStepReturns) {
  // LibTorch's SGD::step() returns an undefined tensor without a closure; a
  // skipped step returns an undefined tensor as well (torch returns None).
  Harness h;
  amp::GradScaler scaler;
  scaler.scale(torch::ones({}));
  h.set_grad(1.0f);
  EXPECT_FALSE(scaler.step(h.optimizer).defined());
  scaler.update();
}

// --- every error, with torch's message ---------------------------------------

TEST(DynamicScaler, ErrorsBeforeScale) {
  Harness h;
  amp::GradScaler scaler;
  const std::string fix =
      " but _scale is None.  This may indicate your script did not use scaler.scale(loss or outputs) earlier in "
      "the iteration.";
  EXPECT_EQ(error_of([&] { scaler.unscale_(h.optimizer); }), "Attempted unscale_" + fix);
  EXPECT_EQ(error_of([&] { scaler.step(h.optimizer); }), "Attempted step" + fix);
  EXPECT_EQ(error_of([&] { scaler.update(); }), "Attempted update" + fix);
  EXPECT_EQ(error_of([&] { scaler.update(2.0); }), "Attempted update" + fix);
}

TEST(DynamicScaler, UnscaleTwiceThrows) {
  Harness h;
  amp::GradScaler scaler;
  scaler.scale(torch::ones({}));
  h.set_grad(1.0f);
  scaler.unscale_(h.optimizer);
  EXPECT_EQ(error_of([&] { scaler.unscale_(h.optimizer); }),
            "unscale_() has already been called on this optimizer since the last update().");
  // step() after an explicit unscale_ is the normal recipe.
  scaler.step(h.optimizer);
  scaler.update();
  // After update() the optimizer is READY again.
  h.set_grad(1.0f);
  EXPECT_EQ(error_of([&] { scaler.unscale_(h.optimizer); }), "<no error>");
}

TEST(DynamicScaler, UnscaleAfterStepThrows) {
  Harness h;
  amp::GradScaler scaler;
  scaler.scale(torch::ones({}));
  h.set_grad(1.0f);
  scaler.step(h.optimizer);
  EXPECT_EQ(error_of([&] { scaler.unscale_(h.optimizer); }), "unscale_() is being called after step().");
}

TEST(DynamicScaler, StepTwiceThrows) {
  Harness h;
  amp::GradScaler scaler;
  scaler.scale(torch::ones({}));
  h.set_grad(1.0f);
  scaler.step(h.optimizer);
  EXPECT_EQ(error_of([&] { scaler.step(h.optimizer); }), "step() has already been called since the last update().");
}

TEST(DynamicScaler, StepWithoutGradientsThrows) {
  Harness h;  // no grad was ever set: no inf check can be recorded
  amp::GradScaler scaler;
  scaler.scale(torch::ones({}));
  EXPECT_EQ(error_of([&] { scaler.step(h.optimizer); }), "No inf checks were recorded for this optimizer.");
}

TEST(DynamicScaler, UpdateWithoutInfChecksThrows) {
  amp::GradScaler scaler;
  scaler.scale(torch::ones({}));
  EXPECT_EQ(error_of([&] { scaler.update(); }), "No inf checks were recorded prior to update.");
}

TEST(DynamicScaler, Fp16GradientsAreRejected) {
  const torch::Tensor p = torch::zeros({3}, torch::TensorOptions().dtype(torch::kHalf).requires_grad(true));
  torch::optim::SGD optimizer({p}, torch::optim::SGDOptions(1.0));
  p.mutable_grad() = torch::ones({3}, torch::kHalf);
  amp::GradScaler scaler;
  scaler.scale(torch::ones({}));
  EXPECT_EQ(error_of([&] { scaler.unscale_(optimizer); }), "Attempting to unscale FP16 gradients.");
  // torch raises ValueError: LibTorch's ValueError is a c10::Error.
  try {
    scaler.step(optimizer);
    ADD_FAILURE() << "step() took fp16 gradients";
  } catch (const c10::ValueError& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()), "Attempting to unscale FP16 gradients.");
  }
}

TEST(DynamicScaler, UpdateWithNewScale) {
  Harness h;
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(4.0));
  scaler.scale(torch::ones({}));
  // A float: no inf check is needed (torch only consumes found_infs without new_scale).
  scaler.update(3.0);
  EXPECT_EQ(scaler.get_scale(), 3.0);
  scaler.update(0.1);
  EXPECT_EQ(scaler.get_scale(), static_cast<double>(0.1f));  // rounded to fp32
  // A 1-element fp32 tensor, copied: later changes to it do not leak in.
  torch::Tensor one_elem = torch::full({1}, 5.0f);
  scaler.update(one_elem);
  one_elem.fill_(7.0f);
  EXPECT_EQ(scaler.get_scale(), 5.0);
  scaler.update(torch::full({}, 6.0f));
  EXPECT_EQ(scaler.get_scale(), 6.0);
  const std::string reason =
      "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor with "
      "requires_grad=False.";
  EXPECT_EQ(error_of([&] { scaler.update(torch::full({2}, 1.0f)); }), reason);
  EXPECT_EQ(error_of([&] { scaler.update(torch::full({1}, 1.0, torch::kDouble)); }), reason);
  EXPECT_EQ(error_of([&] { scaler.update(torch::full({1}, 1.0f, torch::requires_grad())); }), reason);
  EXPECT_EQ(scaler.get_scale(), 6.0);
  // update(new_scale) ends the iteration: states reset, the tracker untouched.
  h.set_grad(1.0f);
  scaler.step(h.optimizer);
  scaler.update(8.0);
  h.set_grad(1.0f);
  EXPECT_EQ(error_of([&] { scaler.step(h.optimizer); }), "<no error>");
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
}

// --- unscale_: grouping, dtypes, sparse ------------------------------------------

TEST(DynamicScaler, UnscaleDividesEveryGroupAndSkipsMissingGrads) {
  const torch::Tensor a = torch::zeros({3}, torch::requires_grad());
  const torch::Tensor b = torch::zeros({2, 2}, torch::requires_grad());
  const torch::Tensor c = torch::zeros({5}, torch::requires_grad());  // no grad
  const torch::Tensor d = torch::zeros({2}, torch::TensorOptions().dtype(torch::kDouble).requires_grad(true));
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{a, c});
  groups.emplace_back(std::vector<torch::Tensor>{b, d},
                      std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.5)));
  torch::optim::SGD optimizer(groups, torch::optim::SGDOptions(1.0));
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(4.0));
  scaler.scale(torch::ones({}));
  a.mutable_grad() = torch::full({3}, 8.0f);
  b.mutable_grad() = torch::full({2, 2}, 2.0f);
  d.mutable_grad() = torch::full({2}, 1.0, torch::kDouble);
  scaler.unscale_(optimizer);
  EXPECT_TRUE(torch::equal(a.grad(), torch::full({3}, 2.0f)));
  EXPECT_TRUE(torch::equal(b.grad(), torch::full({2, 2}, 0.5f)));
  EXPECT_TRUE(torch::equal(d.grad(), torch::full({2}, 0.25, torch::kDouble)));
  EXPECT_FALSE(c.grad().defined());
  EXPECT_EQ(scaler.found_inf().item<float>(), 0.0f);
  scaler.step(optimizer);
  // Each group stepped with its own lr from the unscaled grads.
  EXPECT_TRUE(torch::equal(a.detach(), torch::full({3}, -2.0f)));
  EXPECT_TRUE(torch::equal(b.detach(), torch::full({2, 2}, -0.25f)));
  scaler.update();
}

TEST(DynamicScaler, InfInAnyGroupSkipsTheWholeStep) {
  const torch::Tensor a = torch::zeros({3}, torch::requires_grad());
  const torch::Tensor b = torch::zeros({3}, torch::requires_grad());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{a});
  groups.emplace_back(std::vector<torch::Tensor>{b});
  torch::optim::SGD optimizer(groups, torch::optim::SGDOptions(1.0));
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(4.0));
  scaler.scale(torch::ones({}));
  a.mutable_grad() = torch::full({3}, 8.0f);
  b.mutable_grad() = torch::tensor({1.0f, -kInf, 2.0f});
  scaler.step(optimizer);
  EXPECT_TRUE(torch::equal(a.detach(), torch::zeros({3})));
  EXPECT_TRUE(torch::equal(b.detach(), torch::zeros({3})));
  EXPECT_EQ(scaler.found_inf().item<float>(), 1.0f);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 2.0);
}

TEST(DynamicScaler, Bf16GradientsUnscaleInFp32LikeTheKernel) {
  // inv_scale = 1/3 is not a bf16 number: the product must be taken in fp32
  // (the kernel's opmath) and rounded once to bf16.
  const torch::Tensor p = torch::zeros({64}, torch::TensorOptions().dtype(torch::kBFloat16).requires_grad(true));
  torch::optim::SGD optimizer({p}, torch::optim::SGDOptions(1.0));
  torch::manual_seed(3);
  const torch::Tensor g = torch::randn({64}).mul(100).to(torch::kBFloat16);
  p.mutable_grad() = g.clone();
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(3.0));
  scaler.scale(torch::ones({}));
  scaler.unscale_(optimizer);
  const torch::Tensor inv = torch::full({}, 3.0f).to(torch::kDouble).reciprocal().to(torch::kFloat);
  EXPECT_TRUE(torch::equal(p.grad(), (g.to(torch::kFloat) * inv).to(torch::kBFloat16)));
  // (LibTorch 1.13's bf16 `g * inv` rounds inv to bf16 first and differs;
  // 2.x computes it in fp32 too, so the two agree there.)
}

TEST(DynamicScaler, SparseGradientsLikeTorch) {
  // test_grad_scaling_unscale_sparse on CPU (the fp32 part; fp16 is rejected).
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(4.0));
  scaler.scale(torch::ones({}));
  const torch::Tensor i = torch::tensor({0, 1, 1, 2, 0, 2}, torch::kLong).view({2, 3});
  const torch::Tensor s = torch::sparse_coo_tensor(i, torch::tensor({16.f, 32.f, 64.f}), {2, 3});
  const torch::Tensor p = torch::zeros({2, 3}, torch::requires_grad());
  torch::optim::SGD optimizer({p}, torch::optim::SGDOptions(1.0));

  p.mutable_grad() = s.clone();
  scaler.unscale_(optimizer);
  EXPECT_EQ(scaler.found_inf().item<float>(), 0.0f);
  EXPECT_TRUE(torch::equal(p.grad().to_dense(), (s / 4).to_dense()));
  scaler.update(4.0);

  p.mutable_grad() = torch::sparse_coo_tensor(i, torch::tensor({16.f, 32.f, kInf}), {2, 3});
  scaler.unscale_(optimizer);
  EXPECT_EQ(scaler.found_inf().item<float>(), 1.0f);
  scaler.update(4.0);

  p.mutable_grad() = torch::sparse_coo_tensor(i, torch::tensor({16.f, 32.f, kNaN}), {2, 3});
  scaler.unscale_(optimizer);
  EXPECT_EQ(scaler.found_inf().item<float>(), 1.0f);
  scaler.update(4.0);

  // Uncoalesced fp32 values are unscaled as they are.
  const torch::Tensor dup = torch::tensor({0, 1, 0, 2, 0, 2}, torch::kLong).view({2, 3});
  p.mutable_grad() = torch::sparse_coo_tensor(dup, torch::tensor({8.f, 4.f, 8.f}), {2, 3});
  scaler.unscale_(optimizer);
  EXPECT_TRUE(torch::equal(p.grad().to_dense(), torch::tensor({0.f, 0.f, 4.f, 1.f, 0.f, 0.f}).view({2, 3})));
}

// --- found_inf() -----------------------------------------------------------------

TEST(DynamicScaler, FoundInfIsATensorThatLivesUntilTheNextIteration) {
  Harness h;
  amp::GradScaler scaler;
  EXPECT_FALSE(scaler.found_inf().defined());
  scaler.scale(torch::ones({}));
  h.set_grad(kInf);
  scaler.unscale_(h.optimizer);
  const torch::Tensor flag = scaler.found_inf();
  EXPECT_EQ(flag.dim(), 0);
  EXPECT_EQ(flag.scalar_type(), torch::kFloat);
  EXPECT_EQ(flag.item<float>(), 1.0f);
  scaler.step(h.optimizer);
  scaler.update();
  EXPECT_EQ(scaler.found_inf().item<float>(), 1.0f);  // the flag update() consumed
  h.set_grad(1.0f);
  scaler.unscale_(h.optimizer);
  EXPECT_EQ(scaler.found_inf().item<float>(), 0.0f);  // a new iteration started
}

// --- state_dict ------------------------------------------------------------------

#ifndef AMP_TEST_DATA_DIR
#define AMP_TEST_DATA_DIR "tests/data"
#endif

// What torch::pickle_load gives for a Python torch.save(scaler.state_dict())
// file: a Dict<Any, Any>.
c10::impl::GenericDict python_state(const std::string& file) {
  std::ifstream in(std::string(AMP_TEST_DATA_DIR) + "/" + file, std::ios::binary);
  EXPECT_TRUE(in.good()) << "missing test data " << file;
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes).toGenericDict();
}

// tests/data/*.torchsave are torch.save zip files (named so that *.pt stays untracked).
// python_grad_scaler_stdlib.torchsave: written by tests/python/write_python_scaler_state.py
// in torch.save's layout. python_grad_scaler_torch_2_11.torchsave: written by torch
// 2.11's own torch.save (tests/parity/parity_twin.py). Both hold a
// GradScaler(init_scale=1024, growth_factor=3, growth_interval=7) after one overflow.
TEST(DynamicScaler, LoadsAStateDictWrittenByPython) {
  for (const char* file : {"python_grad_scaler_stdlib.torchsave", "python_grad_scaler_torch_2_11.torchsave"}) {
    SCOPED_TRACE(file);
    std::ifstream probe(std::string(AMP_TEST_DATA_DIR) + "/" + file);
    if (!probe.good()) continue;  // the torch-written file exists only once a GPU machine made it
    const c10::impl::GenericDict state = python_state(file);
    amp::GradScaler scaler;
    scaler.load_state_dict(state);
    EXPECT_EQ(scaler.get_scale(), 512.0);
    EXPECT_EQ(scaler.get_growth_factor(), 3.0);
    EXPECT_EQ(scaler.get_backoff_factor(), 0.5);
    EXPECT_EQ(scaler.get_growth_interval(), 7);
    EXPECT_EQ(scaler.get_growth_tracker(), 0);
    amp::StaticScaler fixed;
    fixed.load_state_dict(state);
    EXPECT_EQ(fixed.get_scale(), 512.0);
    amp::NoScaler none;
    none.load_state_dict(state);
  }
}

TEST(DynamicScaler, PythonStateDictErrorsAreTheSame) {
  c10::impl::GenericDict state = python_state("python_grad_scaler_stdlib.torchsave");
  (void)state.erase("growth_interval");
  amp::GradScaler scaler;
  EXPECT_EQ(error_of([&] { scaler.load_state_dict(state); }),
            "amp: the scaler state dict has no key 'growth_interval'");
  c10::impl::GenericDict bad(c10::AnyType::get(), c10::AnyType::get());
  bad.insert(int64_t{1}, 2.0);
  EXPECT_THAT(error_of([&] { scaler.load_state_dict(bad); }),
              ::testing::HasSubstr("amp: a scaler state dict's keys are strings"));
}

std::set<std::string> keys_of(const amp::StateDict& state) {
  std::set<std::string> keys;
  for (const auto& entry : state) {
    keys.insert(entry.key());
  }
  return keys;
}

const std::set<std::string> kTorchKeys{"scale", "growth_factor", "backoff_factor", "growth_interval",
                                       "_growth_tracker"};

TEST(DynamicScaler, StateDictHasExactlyTorchsKeysAndTypes) {
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(3.0).growth_interval(7));
  // Before any scale(): init_scale and the initial tracker, as torch.
  amp::StateDict state = scaler.state_dict();
  EXPECT_EQ(keys_of(state), kTorchKeys);
  EXPECT_TRUE(state.at("scale").isDouble());
  EXPECT_TRUE(state.at("growth_factor").isDouble());
  EXPECT_TRUE(state.at("backoff_factor").isDouble());
  EXPECT_TRUE(state.at("growth_interval").isInt());
  EXPECT_TRUE(state.at("_growth_tracker").isInt());
  EXPECT_EQ(state.at("scale").toDouble(), 3.0);
  EXPECT_EQ(state.at("growth_interval").toInt(), 7);
  EXPECT_EQ(state.at("_growth_tracker").toInt(), 0);
  Harness h;
  h.iterate(scaler, false);
  h.iterate(scaler, false);
  state = scaler.state_dict();
  EXPECT_EQ(state.at("_growth_tracker").toInt(), 2);
}

TEST(DynamicScaler, LoadStateDictLikeTorch) {
  // test_grad_scaling_state_dict, with and without a lazily created scale.
  for (bool lazy_init_scale : {true, false}) {
    amp::GradScaler s0(
        amp::DynamicScalerOptions().init_scale(3.0).growth_factor(4.0).backoff_factor(0.5).growth_interval(2));
    amp::GradScaler s1(
        amp::DynamicScalerOptions().init_scale(6.0).growth_factor(7.0).backoff_factor(0.8).growth_interval(1));
    if (lazy_init_scale) {
      s1.scale(torch::full({1}, 4.0f));
      Harness h;
      h.set_grad(1.0f);
      s1.step(h.optimizer);
      s1.update();  // tracker tensor now exists; load must overwrite it
    }
    s1.load_state_dict(s0.state_dict());
    EXPECT_EQ(s1.get_scale(), 3.0);
    EXPECT_EQ(s1.get_growth_factor(), 4.0);
    EXPECT_EQ(s1.get_backoff_factor(), 0.5);
    EXPECT_EQ(s1.get_growth_interval(), 2);
    EXPECT_EQ(s1.get_growth_tracker(), 0);
    EXPECT_EQ(s1.get_init_scale(), 3.0);
    // The loaded scale is what the next scale() multiplies by.
    EXPECT_EQ(s1.scale(torch::ones({})).item<float>(), 3.0f);
  }
}

TEST(DynamicScaler, LoadStateDictErrors) {
  amp::GradScaler scaler;
  amp::GradScaler disabled(amp::DynamicScalerOptions().enabled(false));
  EXPECT_EQ(error_of([&] { scaler.load_state_dict(disabled.state_dict()); }),
            "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler.");
  amp::StateDict partial = amp::GradScaler().state_dict();
  ASSERT_EQ(partial.erase("backoff_factor"), 1u);
  EXPECT_THAT(error_of([&] { scaler.load_state_dict(partial); }), HasSubstr("'backoff_factor'"));
  // Python writes ints where a float is expected (e.g. a hand-made dict): accepted.
  amp::StateDict ints = amp::GradScaler().state_dict();
  ints.insert_or_assign("scale", int64_t{1024});
  scaler.load_state_dict(ints);
  EXPECT_EQ(scaler.get_scale(), 1024.0);
}

// Runs `steps` iterations with a fixed overflow pattern and records (scale, tracker).
std::vector<std::pair<double, int64_t>> trajectory(amp::DynamicScaler& scaler, const std::vector<bool>& pattern) {
  Harness h;
  std::vector<std::pair<double, int64_t>> out;
  for (bool overflow : pattern) {
    h.iterate(scaler, overflow);
    out.emplace_back(scaler.get_scale(), scaler.get_growth_tracker());
  }
  return out;
}

std::vector<bool> overflow_pattern(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution overflow(0.15);
  std::vector<bool> pattern(n);
  for (size_t i = 0; i < n; ++i) {
    pattern[i] = overflow(rng);
  }
  return pattern;
}

TEST(DynamicScaler, RoundTripGivesTheSameTrajectory) {
  const auto options =
      amp::DynamicScalerOptions().init_scale(1024.0).growth_factor(1.5).backoff_factor(0.7).growth_interval(4);
  const std::vector<bool> first = overflow_pattern(37, 11);
  const std::vector<bool> second = overflow_pattern(200, 12);
  amp::GradScaler original(options);
  trajectory(original, first);
  const amp::StateDict saved = original.state_dict();
  // The fresh scaler has other options and no scale tensor: everything comes from the dict.
  amp::GradScaler resumed(amp::DynamicScalerOptions().init_scale(2.0).growth_factor(3.0).growth_interval(100));
  resumed.load_state_dict(saved);
  EXPECT_EQ(trajectory(original, second), trajectory(resumed, second));
}

TEST(DynamicScaler, StateDictPickleRoundTrip) {
  // torch::pickle_save writes what Python's torch.load reads; read it back here.
  amp::GradScaler original(amp::DynamicScalerOptions().init_scale(512.0).growth_interval(3));
  trajectory(original, {false, false, true, false});
  const std::vector<char> bytes = torch::pickle_save(original.state_dict());
  const c10::IValue loaded = torch::pickle_load(bytes);
  ASSERT_TRUE(loaded.isGenericDict());
  const amp::StateDict state = c10::impl::toTypedDict<std::string, c10::IValue>(loaded.toGenericDict());
  EXPECT_EQ(keys_of(state), kTorchKeys);
  EXPECT_TRUE(state.at("scale").isDouble());
  EXPECT_TRUE(state.at("_growth_tracker").isInt());
  EXPECT_EQ(state.at("scale").toDouble(), 256.0);
  EXPECT_EQ(state.at("_growth_tracker").toInt(), 1);
  amp::GradScaler resumed;
  resumed.load_state_dict(state);
  const std::vector<bool> rest = overflow_pattern(50, 5);
  EXPECT_EQ(trajectory(original, rest), trajectory(resumed, rest));
}

// --- disabled ----------------------------------------------------------------------

TEST(DynamicScaler, DisabledIsTransparent) {
  amp::GradScaler scaler(amp::DynamicScalerOptions().enabled(false).growth_factor(0.5));  // not validated
  EXPECT_FALSE(scaler.is_enabled());
  const torch::Tensor loss = torch::full({}, 3.0f);
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  EXPECT_EQ(scaler.get_scale(), 1.0);
  Harness h;
  h.set_grad(kInf);
  scaler.unscale_(h.optimizer);  // no-op
  EXPECT_TRUE(torch::equal(h.param.grad(), torch::full({4}, kInf)));
  scaler.step(h.optimizer);  // plain optimizer.step(), inf and all
  EXPECT_TRUE(torch::equal(h.param.detach(), torch::full({4}, -kInf)));
  scaler.step(h.optimizer);  // no state machine
  scaler.update();
  scaler.update(4.0);
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_EQ(scaler.state_dict().size(), 0u);
  scaler.load_state_dict(scaler.state_dict());  // no-op, as torch
  scaler.load_state_dict(amp::GradScaler().state_dict());
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_FALSE(scaler.found_inf().defined());
}

// --- options validation ---------------------------------------------------------------

TEST(DynamicScaler, OptionsAreValidated) {
  using O = amp::DynamicScalerOptions;
  auto message = [](O o) { return error_of([&] { amp::GradScaler s(o); }); };
  EXPECT_EQ(message(O().growth_factor(1.0)), "amp: DynamicScalerOptions::growth_factor must be > 1, got 1");
  EXPECT_THAT(message(O().growth_factor(0.5)), StartsWith("amp: DynamicScalerOptions::growth_factor must be > 1"));
  EXPECT_EQ(message(O().backoff_factor(1.0)), "amp: DynamicScalerOptions::backoff_factor must be in (0, 1), got 1");
  EXPECT_EQ(message(O().backoff_factor(0.0)), "amp: DynamicScalerOptions::backoff_factor must be in (0, 1), got 0");
  EXPECT_EQ(message(O().growth_interval(0)), "amp: DynamicScalerOptions::growth_interval must be >= 1, got 0");
  EXPECT_EQ(message(O().init_scale(0.0)), "amp: DynamicScalerOptions::init_scale must be finite and > 0, got 0");
  EXPECT_THAT(message(O().init_scale(-1.0)),
              StartsWith("amp: DynamicScalerOptions::init_scale must be finite and > 0"));
  EXPECT_THAT(message(O().init_scale(std::numeric_limits<double>::infinity())),
              StartsWith("amp: DynamicScalerOptions::init_scale must be finite and > 0"));
  EXPECT_EQ(message(O().hysteresis(0)),
            "amp: DynamicScalerOptions::hysteresis must be >= 1 (1 = no hysteresis), got 0");
  EXPECT_EQ(message(O().min_scale(-1.0)), "amp: DynamicScalerOptions::min_scale must be >= 0 (0 = no bound), got -1");
  EXPECT_EQ(message(O().max_scale(0.0)), "amp: DynamicScalerOptions::max_scale must be > 0 (+inf = no bound), got 0");
  EXPECT_EQ(message(O().min_scale(8.0).max_scale(4.0)),
            "amp: DynamicScalerOptions::min_scale must be <= max_scale, got 8 > 4");
  EXPECT_EQ(message(O().min_scale(4.0).max_scale(4.0)), "<no error>");
}

// --- extensions ------------------------------------------------------------------------

TEST(DynamicScalerExtensions, MinScaleBoundsTheBackoff) {
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(8.0).min_scale(2.0));
  Harness h;
  h.iterate(scaler, true);
  EXPECT_EQ(scaler.get_scale(), 4.0);
  h.iterate(scaler, true);
  EXPECT_EQ(scaler.get_scale(), 2.0);
  h.iterate(scaler, true);
  EXPECT_EQ(scaler.get_scale(), 2.0);
  const amp::StateDict state = scaler.state_dict();
  EXPECT_EQ(state.at("min_scale").toDouble(), 2.0);
  EXPECT_FALSE(state.contains("max_scale"));
}

TEST(DynamicScalerExtensions, MaxScaleBoundsTheGrowth) {
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(4.0).growth_interval(1).max_scale(10.0));
  Harness h;
  h.iterate(scaler, false);
  EXPECT_EQ(scaler.get_scale(), 8.0);
  h.iterate(scaler, false);
  EXPECT_EQ(scaler.get_scale(), 10.0);
  h.iterate(scaler, false);
  EXPECT_EQ(scaler.get_scale(), 10.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
  h.iterate(scaler, true);
  EXPECT_EQ(scaler.get_scale(), 5.0);
  EXPECT_EQ(scaler.state_dict().at("max_scale").toDouble(), 10.0);
}

TEST(DynamicScalerExtensions, HysteresisBacksOffAfterNConsecutiveOverflows) {
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(64.0).growth_interval(2).hysteresis(3));
  Harness h;
  h.iterate(scaler, false);
  EXPECT_EQ(scaler.get_growth_tracker(), 1);
  h.iterate(scaler, true);  // absorbed (3 -> 2): skipped, scale kept, growth count restarts
  EXPECT_EQ(scaler.get_scale(), 64.0);
  EXPECT_EQ(scaler.get_hysteresis_tracker(), 2);
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
  EXPECT_TRUE(torch::equal(h.param.detach(), torch::full({4}, -1.0f / 64)));  // only the clean step stepped
  h.iterate(scaler, true);                                                    // absorbed (2 -> 1)
  EXPECT_EQ(scaler.get_scale(), 64.0);
  EXPECT_EQ(scaler.get_hysteresis_tracker(), 1);
  h.iterate(scaler, true);  // third consecutive: back off, the counter stays at 1
  EXPECT_EQ(scaler.get_scale(), 32.0);
  EXPECT_EQ(scaler.get_hysteresis_tracker(), 1);
  h.iterate(scaler, true);
  EXPECT_EQ(scaler.get_scale(), 16.0);
  h.iterate(scaler, false);  // a clean step refills the counter
  EXPECT_EQ(scaler.get_hysteresis_tracker(), 3);
  EXPECT_EQ(scaler.get_growth_tracker(), 1);
  h.iterate(scaler, true);
  EXPECT_EQ(scaler.get_scale(), 16.0);
  EXPECT_EQ(scaler.get_hysteresis_tracker(), 2);
  EXPECT_TRUE(torch::equal(h.param.detach(), torch::full({4}, -1.0f / 64 - 1.0f / 16)));

  const amp::StateDict state = scaler.state_dict();
  EXPECT_EQ(state.at("hysteresis").toInt(), 3);
  EXPECT_EQ(state.at("_hysteresis_tracker").toInt(), 2);
  amp::GradScaler resumed(amp::DynamicScalerOptions().hysteresis(5));
  resumed.load_state_dict(state);
  EXPECT_EQ(resumed.get_hysteresis_tracker(), 2);
  EXPECT_EQ(resumed.options().hysteresis(), 3);
  const std::vector<bool> rest = overflow_pattern(100, 3);
  EXPECT_EQ(trajectory(scaler, rest), trajectory(resumed, rest));
}

TEST(DynamicScalerExtensions, DefaultStateDictHasNoExtensionKeys) {
  EXPECT_EQ(keys_of(amp::GradScaler().state_dict()), kTorchKeys);
  EXPECT_EQ(keys_of(amp::GradScaler(amp::DynamicScalerOptions().hysteresis(2)).state_dict()).size(), 7u);
}

// --- recipes: torch's _run_scaling_case on CPU --------------------------------------

// Two identical models (Linear(8,8), Linear(8,8)) with SGD(lr=1): a control
// trained without scaling, with its step skipped at skip_iter, and one trained
// through the scaler with an inf injected at skip_iter.
struct ScalingCase {
  torch::nn::Sequential control{torch::nn::Linear(8, 8), torch::nn::Linear(8, 8)};
  torch::nn::Sequential scaling{torch::nn::Linear(8, 8), torch::nn::Linear(8, 8)};
  std::vector<std::pair<torch::Tensor, torch::Tensor>> data;
  static constexpr int kSkipIter = 2;

  explicit ScalingCase(uint64_t seed) {
    torch::manual_seed(seed);
    control = torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8));
    scaling = torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8));
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < control->parameters().size(); ++i) {
      scaling->parameters()[i].copy_(control->parameters()[i]);
    }
    for (int i = 0; i < 4; ++i) {
      data.emplace_back(torch::randn({8, 8}), torch::randn({8, 8}));
    }
  }

  // Iteration kSkipIter overflows: an inf in one gradient of `scaling`, as
  // torch's tests inject it after backward.
  void overflow_at_skip_iter(int i) {
    if (i != kSkipIter) return;
    torch::NoGradGuard no_grad;
    scaling->parameters()[2].mutable_grad().fill_(kInf);
  }

  void expect_same_params(double atol = 0.0) const {
    for (size_t i = 0; i < control->parameters().size(); ++i) {
      const torch::Tensor c = control->parameters()[i];
      const torch::Tensor s = scaling->parameters()[i];
      if (atol == 0.0) {
        EXPECT_TRUE(torch::equal(c, s)) << "param " << i << " differs";
      } else {
        EXPECT_TRUE(torch::allclose(c, s, 1e-5, atol)) << "param " << i << " differs";
      }
    }
  }
};

amp::GradScaler case_scaler() {
  return amp::GradScaler(amp::DynamicScalerOptions().init_scale(128.0).growth_factor(2.0).growth_interval(1));
}

TEST(DynamicScalerRecipes, PlainLoopMatchesUnscaledTraining) {
  ScalingCase c(10);
  torch::optim::SGD opt_control(c.control->parameters(), torch::optim::SGDOptions(1.0));
  torch::optim::SGD opt_scaling(c.scaling->parameters(), torch::optim::SGDOptions(1.0));
  amp::GradScaler scaler = case_scaler();
  for (int i = 0; i < 4; ++i) {
    opt_control.zero_grad();
    torch::mse_loss(c.control->forward(c.data[i].first), c.data[i].second).backward();
    if (i != ScalingCase::kSkipIter) {
      opt_control.step();
    }
    opt_scaling.zero_grad();
    scaler.scale(torch::mse_loss(c.scaling->forward(c.data[i].first), c.data[i].second)).backward();
    c.overflow_at_skip_iter(i);
    scaler.step(opt_scaling);
    scaler.update();
  }
  EXPECT_EQ(scaler.get_scale(), 128.0 * 8.0 * 0.5);  // 3 growths, 1 backoff
  // Power-of-two scales multiply and divide exactly: bitwise the same training.
  c.expect_same_params();
}

TEST(DynamicScalerRecipes, ClippingSeparateUnscale) {
  // test_grad_scaling_clipping_separate_unscale: after unscale_, the norm that
  // clip_grad_norm_ sees is the true (unscaled) norm.
  ScalingCase c(20);
  torch::optim::SGD opt_control(c.control->parameters(), torch::optim::SGDOptions(1.0));
  torch::optim::SGD opt_scaling(c.scaling->parameters(), torch::optim::SGDOptions(1.0));
  amp::GradScaler scaler = case_scaler();
  const double max_norm = 0.2;
  for (int i = 0; i < 4; ++i) {
    opt_control.zero_grad();
    torch::mse_loss(c.control->forward(c.data[i].first), c.data[i].second).backward();
    const double control_norm = torch::nn::utils::clip_grad_norm_(c.control->parameters(), max_norm);
    if (i != ScalingCase::kSkipIter) {
      opt_control.step();
    }
    opt_scaling.zero_grad();
    scaler.scale(torch::mse_loss(c.scaling->forward(c.data[i].first), c.data[i].second)).backward();
    c.overflow_at_skip_iter(i);
    scaler.unscale_(opt_scaling);
    const double norm = torch::nn::utils::clip_grad_norm_(c.scaling->parameters(), max_norm);
    if (i != ScalingCase::kSkipIter) {
      EXPECT_EQ(norm, control_norm);
    } else {
      EXPECT_FALSE(std::isfinite(norm));
    }
    scaler.step(opt_scaling);
    scaler.update();
  }
  EXPECT_EQ(scaler.get_scale(), 128.0 * 8.0 * 0.5);
  c.expect_same_params();
}

TEST(DynamicScalerRecipes, ClippingScaledGradients) {
  // test_grad_scaling_clipping: clip the scaled grads at max_norm * scale.
  ScalingCase c(30);
  torch::optim::SGD opt_control(c.control->parameters(), torch::optim::SGDOptions(1.0));
  torch::optim::SGD opt_scaling(c.scaling->parameters(), torch::optim::SGDOptions(1.0));
  amp::GradScaler scaler = case_scaler();
  const double max_norm = 0.2;
  for (int i = 0; i < 4; ++i) {
    opt_control.zero_grad();
    torch::mse_loss(c.control->forward(c.data[i].first), c.data[i].second).backward();
    torch::nn::utils::clip_grad_norm_(c.control->parameters(), max_norm);
    if (i != ScalingCase::kSkipIter) {
      opt_control.step();
    }
    opt_scaling.zero_grad();
    scaler.scale(torch::mse_loss(c.scaling->forward(c.data[i].first), c.data[i].second)).backward();
    torch::nn::utils::clip_grad_norm_(c.scaling->parameters(), max_norm * scaler.get_scale());
    c.overflow_at_skip_iter(i);
    scaler.step(opt_scaling);
    scaler.update();
  }
  EXPECT_EQ(scaler.get_scale(), 128.0 * 8.0 * 0.5);
  c.expect_same_params(1e-5);  // clip's eps (1e-6) is not scaled: torch's tolerance
}

TEST(DynamicScalerRecipes, GradientAccumulation) {
  // test_grad_scaling_accumulation: two backward()s per step.
  ScalingCase c(40);
  torch::optim::SGD opt_control(c.control->parameters(), torch::optim::SGDOptions(1.0));
  torch::optim::SGD opt_scaling(c.scaling->parameters(), torch::optim::SGDOptions(1.0));
  amp::GradScaler scaler = case_scaler();
  const int iters_to_accumulate = 2;
  for (int i = 0; i < 4; ++i) {
    (torch::mse_loss(c.control->forward(c.data[i].first), c.data[i].second) / iters_to_accumulate).backward();
    scaler.scale(torch::mse_loss(c.scaling->forward(c.data[i].first), c.data[i].second) / iters_to_accumulate)
        .backward();
    if ((i + 1) % iters_to_accumulate == 0) {
      opt_control.step();
      opt_control.zero_grad();
      scaler.step(opt_scaling);
      scaler.update();
      opt_scaling.zero_grad();
    }
  }
  EXPECT_EQ(scaler.get_scale(), 128.0 * 4.0);  // 2 unskipped, 0 skipped
  c.expect_same_params();
}

TEST(DynamicScalerRecipes, TwoOptimizersOneScaler) {
  // test_grad_scaling_multiple: two models and two optimizers fed by two
  // losses; an inf in model1's grad skips optimizer1 only, and the one
  // update() backs off.
  ScalingCase c0(50);
  ScalingCase c1(51);
  torch::optim::SGD opt_control0(c0.control->parameters(), torch::optim::SGDOptions(1.0));
  torch::optim::SGD opt_control1(c1.control->parameters(), torch::optim::SGDOptions(1.0));
  torch::optim::SGD opt_scaling0(c0.scaling->parameters(), torch::optim::SGDOptions(1.0));
  torch::optim::SGD opt_scaling1(c1.scaling->parameters(), torch::optim::SGDOptions(1.0));
  amp::GradScaler scaler = case_scaler();
  for (int i = 0; i < 4; ++i) {
    const auto& [input, target] = c0.data[i];
    {
      opt_control0.zero_grad();
      opt_control1.zero_grad();
      const torch::Tensor out0 = c0.control->forward(input);
      const torch::Tensor out1 = c1.control->forward(input);
      torch::mse_loss(0.3 * out0 + 0.7 * out1, target).backward({}, /*retain_graph=*/true);
      torch::mse_loss(0.6 * out0 - 0.4 * out1, target).backward();
      opt_control0.step();
      if (i != ScalingCase::kSkipIter) {
        opt_control1.step();
      }
    }
    {
      opt_scaling0.zero_grad();
      opt_scaling1.zero_grad();
      const torch::Tensor out0 = c0.scaling->forward(input);
      const torch::Tensor out1 = c1.scaling->forward(input);
      scaler.scale(torch::mse_loss(0.3 * out0 + 0.7 * out1, target)).backward({}, /*retain_graph=*/true);
      scaler.scale(torch::mse_loss(0.6 * out0 - 0.4 * out1, target)).backward();
      c1.overflow_at_skip_iter(i);
      scaler.unscale_(opt_scaling0);  // as torch's stress test: one explicit unscale_
      scaler.step(opt_scaling0);
      scaler.step(opt_scaling1);
      if (i == ScalingCase::kSkipIter) {
        EXPECT_EQ(scaler.found_inf().item<float>(), 1.0f);
      }
      scaler.update();
    }
  }
  EXPECT_EQ(scaler.get_scale(), 128.0 * 8.0 * 0.5);
  c0.expect_same_params(1e-7);
  c1.expect_same_params(1e-7);
}

TEST(DynamicScalerRecipes, DisabledScalerRunsTheSameLoop) {
  // _run_scaling_case with enabled=False: same control flow, no scaling, no skipping.
  ScalingCase c(60);
  torch::optim::SGD opt_control(c.control->parameters(), torch::optim::SGDOptions(1.0));
  torch::optim::SGD opt_scaling(c.scaling->parameters(), torch::optim::SGDOptions(1.0));
  amp::GradScaler scaler(amp::DynamicScalerOptions().init_scale(128.0).growth_interval(1).enabled(false));
  for (int i = 0; i < 4; ++i) {
    opt_control.zero_grad();
    torch::mse_loss(c.control->forward(c.data[i].first), c.data[i].second).backward();
    opt_control.step();
    opt_scaling.zero_grad();
    scaler.scale(torch::mse_loss(c.scaling->forward(c.data[i].first), c.data[i].second)).backward();
    scaler.step(opt_scaling);
    scaler.update();
  }
  EXPECT_EQ(scaler.get_scale(), 1.0);
  c.expect_same_params();
}

}  // namespace
}  // namespace scaler_test
