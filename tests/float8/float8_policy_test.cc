// Tests for the Float8 policies (amp/float8/policy.h): a Trainer or Fabric
// under Float8<Tensorwise> / Float8<Delayed<...>> gives the bits of the same
// recipe written with the float8 building blocks by hand, keeps the delayed
// state in its checkpoints (resume bit for bit, a misfit refused with nothing
// changed), reports which linears run in float8, and refuses what cannot work.
// Runs where the CPU has at::_scaled_mm (LibTorch 2.8+; one skipped test before).
//
//   bazel test //tests:float8_policy_test
#include "amp/float8/policy.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "amp/amp.h"
#include "../error_of.h"
#include "../tmp_path.h"

namespace float8_policy_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

#if AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL

namespace f8 = amp::float8;
namespace fs = std::filesystem;
using amp_test::error_of;
using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;
using Tensorwise = amp::Float8<amp::Tensorwise>;
using Delayed4 = amp::Float8<amp::Delayed<4, 1>>;

// Two linears that fit float8 and a head that does not (10 outputs).
struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(32, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 32))),
        head(register_module("head", torch::nn::Linear(32, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1, fc2, head;
};
TORCH_MODULE(Mlp);

struct Batch {
  torch::Tensor x, y;
};
Batch batch(int64_t i) {
  torch::manual_seed(100 + i);
  return {torch::randn({24, 32}), torch::randint(0, 10, {24})};
}

torch::Tensor loss_of(Mlp& net, const Batch& b) {
  return torch::cross_entropy_loss(net->forward(b.x).to(torch::kFloat), b.y);
}

Mlp make_net() {
  torch::manual_seed(1);
  return Mlp();
}

using ::amp_test::tmp_path;

void expect_same(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters(), pb = b.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
}

// The recipe by hand: a routing bf16 region, the float8 guard, the optimizer's own step.
TEST(Float8Policy, TensorwiseTrainerIsTheRecipeByHand) {
  Mlp a = make_net(), b = make_net();
  torch::optim::Adam opt_a(a->parameters(), torch::optim::AdamOptions(1e-3));
  torch::optim::Adam opt_b(b->parameters(), torch::optim::AdamOptions(1e-3));
  amp::Trainer<Tensorwise, amp::CPU> trainer(
      a, opt_a, amp::TrainerOptions().progress(false).step(amp::StepOptions().fused(false)));
  for (int64_t i = 0; i < 5; ++i) {
    const Batch data = batch(i);
    const double got = trainer.step([&](auto&) { return loss_of(a, data); }).loss_value();
    torch::Tensor loss;
    {
      amp::Region<Bf16, amp::CPU> region;
      f8::LinearGuard fp8;
      loss = loss_of(b, data);
    }
    opt_b.zero_grad();
    loss.backward();
    opt_b.step();
    EXPECT_EQ(got, loss.item<double>()) << "step " << i;
  }
  expect_same(*a, *b);
}

TEST(Float8Policy, DelayedTrainerIsTheRecipeByHandStateIncluded) {
  Mlp a = make_net(), b = make_net();
  torch::optim::SGD opt_a(a->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD opt_b(b->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  amp::Trainer<Delayed4, amp::CPU> trainer(a, opt_a,
                                           amp::TrainerOptions().progress(false).step(amp::StepOptions().fused(false)));
  f8::DelayedScaling fp8(f8::DelayedOptions().history_length(4).margin(1));
  EXPECT_EQ(fp8.track(*b), 2);
  for (int64_t i = 0; i < 6; ++i) {
    const Batch data = batch(i);
    const double got = trainer.step([&](auto&) { return loss_of(a, data); }).loss_value();
    torch::Tensor loss;
    {
      amp::Region<Bf16, amp::CPU> region;
      f8::DelayedLinearGuard guard(fp8);
      loss = loss_of(b, data);
    }
    opt_b.zero_grad();
    loss.backward();
    opt_b.step();
    fp8.update();
    EXPECT_EQ(got, loss.item<double>()) << "step " << i;
  }
  expect_same(*a, *b);
  // The trainer's checkpoint holds the same scales and histories.
  std::stringstream state;
  trainer.save_state(state);
  torch::serialize::InputArchive archive;
  archive.load_from(state);
  f8::detail::TrainingState<amp::Delayed<4, 1>> holder;
  holder.track(*b);
  holder.read(archive);
  for (const auto& item : fp8.state_dict()) {
    const at::Tensor* mine = holder.scaling().state_dict().find(item.key());
    ASSERT_NE(mine, nullptr) << item.key();
    EXPECT_TRUE(torch::equal(*mine, item.value())) << item.key();
  }
  EXPECT_FALSE(torch::equal(fp8.state_dict()["fc1.fwd_scale"], torch::ones({2})));  // updated, not the start
}

TEST(Float8Policy, ACheckpointResumesBitForBit) {
  const std::string path = tmp_path("float8_delayed.pt");
  Mlp a = make_net();
  torch::optim::Adam opt_a(a->parameters(), torch::optim::AdamOptions(1e-3));
  amp::Trainer<Delayed4, amp::CPU> trainer(a, opt_a, amp::TrainerOptions().progress(false));
  for (int64_t i = 0; i < 3; ++i) trainer.step([&](auto&) { return loss_of(a, batch(i)); });
  trainer.save(path);
  std::vector<double> losses;
  for (int64_t i = 3; i < 6; ++i)
    losses.push_back(trainer.step([&](auto&) { return loss_of(a, batch(i)); }).loss_value());

  torch::manual_seed(9);
  Mlp b;  // other weights: the checkpoint must bring everything
  torch::optim::Adam opt_b(b->parameters(), torch::optim::AdamOptions(1e-3));
  amp::Trainer<Delayed4, amp::CPU> resumed(b, opt_b, amp::TrainerOptions().progress(false));
  resumed.load(path);
  EXPECT_EQ(resumed.steps(), 3);
  for (int64_t i = 3; i < 6; ++i)
    EXPECT_EQ(resumed.step([&](auto&) { return loss_of(b, batch(i)); }).loss_value(),
              losses[static_cast<size_t>(i - 3)]);
  expect_same(*a, *b);
}

TEST(Float8Policy, AStateOfAnotherHistoryLengthIsRefusedAndNothingChanges) {
  const std::string path = tmp_path("float8_history4.pt");
  Mlp a = make_net();
  torch::optim::Adam opt_a(a->parameters(), torch::optim::AdamOptions(1e-3));
  amp::Trainer<Delayed4, amp::CPU> trainer(a, opt_a, amp::TrainerOptions().progress(false));
  trainer.step([&](auto&) { return loss_of(a, batch(0)); });
  trainer.save(path);

  torch::manual_seed(9);
  Mlp b;
  torch::optim::Adam opt_b(b->parameters(), torch::optim::AdamOptions(1e-3));
  using Delayed8 = amp::Float8<amp::Delayed<8, 1>>;  // also "fp8-delayed"
  amp::Trainer<Delayed8, amp::CPU> other(b, opt_b, amp::TrainerOptions().progress(false));
  other.step([&](auto&) { return loss_of(b, batch(0)); });
  std::stringstream before;
  other.save_state(before);
  const std::string error = error_of([&] { other.load(path); });
  EXPECT_NE(error.find("amp: checkpoint '" + path + "' does not fit this model/optimizer (left unchanged)"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("(another history length?)"), std::string::npos) << error;
  std::stringstream after;
  other.save_state(after);
  EXPECT_EQ(before.str(), after.str());
  EXPECT_EQ(other.steps(), 1);
}

TEST(Float8Policy, PrecisionTracksEveryModelUnderItsIndex) {
  Mlp g = make_net(), d = make_net();
  torch::optim::Adam opt_g(g->parameters(), torch::optim::AdamOptions(1e-3));
  torch::optim::Adam opt_d(d->parameters(), torch::optim::AdamOptions(1e-3));
  amp::Fabric<Delayed4, amp::CPU> fabric;
  fabric.setup(g, opt_g);
  fabric.setup(d, opt_d);
  for (int64_t i = 0; i < 3; ++i) {
    const Batch data = batch(i);
    const at::Tensor loss = fabric.forward([&](auto&) { return loss_of(g, data) + loss_of(d, data); });
    fabric.backward(loss);
    fabric.optimizer_step(opt_g);
    fabric.optimizer_step(opt_d);
    fabric.update();
  }
  const std::string path = tmp_path("float8_precision.pt");
  fabric.save(path);
  Mlp g2 = make_net(), d2 = make_net();
  torch::optim::Adam opt_g2(g2->parameters(), torch::optim::AdamOptions(1e-3));
  torch::optim::Adam opt_d2(d2->parameters(), torch::optim::AdamOptions(1e-3));
  amp::Fabric<Delayed4, amp::CPU> fabric2;
  fabric2.setup(g2, opt_g2);
  fabric2.setup(d2, opt_d2);
  fabric2.load(path);
  const Batch data = batch(3);
  const double l1 = fabric.forward([&](auto&) { return loss_of(g, data) + loss_of(d, data); }).item<double>();
  const double l2 = fabric2.forward([&](auto&) { return loss_of(g2, data) + loss_of(d2, data); }).item<double>();
  EXPECT_EQ(l1, l2);
}

TEST(Float8Policy, CoverageNamesTheLinearsKeptInBf16) {
  Mlp net = make_net();
  const f8::Coverage c = f8::coverage(*net);
  EXPECT_EQ(c.converted, (std::vector<std::string>{"fc1", "fc2"}));
  EXPECT_EQ(c.kept, (std::vector<std::string>{"head [10, 32]"}));
  EXPECT_EQ(f8::detail::describe(c),
            "float8: 2 linear(s), 1 kept in bf16 (dimensions not multiples of 16: head [10, 32])");
}

// The linears really run in float8: the output differs from plain bf16
// autocast, and the head (which does not fit) is bf16 either way.
TEST(Float8Policy, TheRegionRunsTheLinearsInFloat8) {
  Mlp net = make_net();
  const auto x = torch::randn({24, 32});
  torch::Tensor fp8, bf16;
  {
    amp::Region<Tensorwise, amp::CPU> region;
    EXPECT_EQ(region.linear_routing(), amp::LinearRouting::kOn);
    fp8 = net->fc1(x);
  }
  {
    amp::Region<Bf16, amp::CPU> region;
    bf16 = net->fc1(x);
  }
  EXPECT_EQ(fp8.scalar_type(), torch::kBFloat16);
  EXPECT_FALSE(torch::equal(fp8, bf16));
  EXPECT_LT((fp8.to(torch::kFloat) - bf16.to(torch::kFloat)).abs().max().item<float>(), 0.25f);
}

// LibTorch's C++ nn::Linear runs matmul then `output += bias` for an input
// of more than 2 dims; in a Float8 region that bias is added in bf16, as
// float8::linear (and torchao) add it: the module's bits are the function's.
TEST(Float8Policy, ABiasAfterA3dInputIsAddedAsFloat8LinearAddsIt) {
  torch::manual_seed(2);
  torch::nn::Linear fc(64, 32);
  const auto x = torch::randn({5, 8, 64});
  torch::Tensor routed, direct;
  {
    amp::Region<Tensorwise, amp::CPU> region;
    routed = fc(x);
  }
  {
    amp::Region<Bf16, amp::CPU> region(amp::RegionOptions().linear_routing(amp::LinearRouting::kOff));
    direct = f8::linear(x, fc->weight, fc->bias);
  }
  EXPECT_TRUE(torch::equal(routed, direct));
  // An add_ that is not that bias's is left alone.
  {
    amp::Region<Tensorwise, amp::CPU> region;
    auto y = fc(x);
    auto z = torch::zeros({5, 8, 32}, torch::kBFloat16);
    const auto other = torch::randn({32});
    z += other;
    EXPECT_TRUE(torch::equal(z, torch::zeros({5, 8, 32}, torch::kBFloat16).add_(other)));
    (void)y;
  }
}

TEST(Float8Policy, ADelayedRegionWithoutItsStateIsAnError) {
  Mlp net = make_net();
  amp::Region<Delayed4, amp::CPU> region;
  EXPECT_NE(error_of([&] {
              net->forward(torch::randn({4, 32}));
            }).find("no DelayedScaling is bound on this thread"),
            std::string::npos);
}

TEST(Float8Policy, RoutingCannotBeTurnedOff) {
  const std::string error = error_of(
      [] { amp::Region<Tensorwise, amp::CPU> region(amp::RegionOptions().linear_routing(amp::LinearRouting::kOff)); });
  EXPECT_NE(error.find("amp: a fp8-tensorwise region runs its linears in float8 through linear routing"),
            std::string::npos)
      << error;
  EXPECT_EQ(amp::detail::set_linear_fn(nullptr), nullptr);  // nothing left installed
}

TEST(Float8Policy, NamesDispatchToThePolicies) {
  EXPECT_TRUE(amp::dispatch_precision<amp::CPU>(
      "fp8-tensorwise", [](auto p) { return std::is_same_v<typename decltype(p)::type, Tensorwise>; }));
  EXPECT_TRUE(amp::dispatch_precision<amp::CPU>(
      "fp8-delayed", [](auto p) { return std::is_same_v<typename decltype(p)::type, amp::Float8<amp::Delayed<>>>; }));
}

#endif  // AMP_DETAIL_HAS_CPU_FLOAT8_MATMUL (tests/BUILD.bazel and CMakeLists.txt build this test from LibTorch 2.8)

}  // namespace
}  // namespace float8_policy_test
