// The Trainer's step makes no host sync on the fused path: 20 steps of
// Trainer<Mixed<fp16, DynamicScaler>, CPU> (LibTorch >= 2.4) and of
// Trainer<Mixed<bf16, NoScaler>, CPU>, for Adam, AdamW and SGD with momentum,
// clipping off and on, read nothing back to the host (aten::_local_scalar_dense
// / aten::item outside ATen's fused kernels, whose CPU versions read their own
// step counter from host memory). Also: fused and unfused steps agree to fp32
// rounding, skipped steps match, and checkpoints move between the paths.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "amp/amp.h"
#include "../scalar_reads.h"

namespace zero_sync_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

enum class Opt { kAdam, kAdamW, kSgd };
const char* name_of(Opt o) { return o == Opt::kAdam ? "Adam" : o == Opt::kAdamW ? "AdamW" : "SGD"; }

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt o, const std::vector<torch::Tensor>& params) {
  switch (o) {
    case Opt::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2).weight_decay(1e-4));
    case Opt::kAdamW:
      return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2));
    default:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true));
  }
}

struct Model {
  std::shared_ptr<Net> net;
  std::unique_ptr<torch::optim::Optimizer> opt;
};

Model make_run(Opt o, uint64_t seed = 1) {
  torch::manual_seed(seed);
  Model r{std::make_shared<Net>(), nullptr};
  r.opt = make_optimizer(o, r.net->parameters());
  return r;
}

torch::Tensor batch_x(int i) { return torch::randn({64, 16}, torch::TensorOptions()).add(static_cast<double>(i % 3)); }

template <class P>
int64_t host_reads_in_20_steps(Opt o, double max_grad_norm) {
  Model r = make_run(o);
  amp::Trainer<P, amp::CPU> trainer(
      r.net, *r.opt, amp::TrainerOptions().progress(false).step(amp::StepOptions().max_grad_norm(max_grad_norm)));
  EXPECT_TRUE(trainer.fused()) << trainer.optimizer_path();
  torch::manual_seed(2);
  const auto x = batch_x(0), y = torch::randint(0, 4, {64}, torch::kLong);
  trainer.step([&](auto&) { return torch::cross_entropy_loss(r.net->forward(x), y); });  // state made
  ScalarReads reads;
  for (int i = 0; i < 20; ++i) trainer.step([&](auto&) { return torch::cross_entropy_loss(r.net->forward(x), y); });
  return ScalarReads::outside;
}

constexpr bool kFusedCpu = amp::detail::compat::kCpuHasFusedOptimizers;

// True<bf16> with SGD on CPU: the Trainer decides its path for the converted
// (bf16) parameters: the unfused step where ATen's CPU fused SGD skips 16-bit
// parameters (pytorch#191763, before 2.14), the fused one where it does not;
// either trains every weight. Adam keeps the fused path.
TEST(ZeroSync, TrueBf16SgdOnCpuTakesAWorkingStepAndTrains) {
  torch::manual_seed(0);
  torch::nn::Linear lin(16, 4);
  torch::optim::SGD sgd(lin->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  amp::Trainer<amp::True<amp::bf16>, amp::CPU> trainer(lin, sgd, amp::TrainerOptions().progress(false));
  EXPECT_EQ(trainer.fused(), kFusedCpu && amp::detail::compat::kCpuFusedSgdUpdatesHalfTypes)
      << trainer.optimizer_path();
  const auto before = lin->weight.clone();
  const auto x = torch::randn({32, 16}).to(torch::kBFloat16), y = torch::randn({32, 4}).to(torch::kBFloat16);
  // (1.13 has no bf16 mse_loss on CPU)
  for (int i = 0; i < 3; ++i) trainer.step([&](auto&) { return (lin(x) - y).pow(2).mean(); });
  EXPECT_GT((lin->weight - before).abs().min().item<float>(), 0.f) << "every weight moves";
  torch::nn::Linear lin2(16, 4);
  torch::optim::Adam adam(lin2->parameters(), torch::optim::AdamOptions(1e-2));
  amp::Trainer<amp::True<amp::bf16>, amp::CPU> adam_trainer(lin2, adam, amp::TrainerOptions().progress(false));
  EXPECT_EQ(adam_trainer.fused(), kFusedCpu) << adam_trainer.optimizer_path();
}

TEST(ZeroSync, ObserverSeesReads) {
  ScalarReads reads;
  (void)torch::ones({}).item<float>();
  EXPECT_GT(ScalarReads::outside, 0) << "RecordFunction callbacks did not see item()";
}

template <class P>
void expect_zero_reads() {
  if constexpr (amp::is_supported_v<P, amp::CPU>) {
    if (!kFusedCpu) GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no CPU fused optimizer kernels (2.4+)";
    for (Opt o : {Opt::kAdam, Opt::kAdamW, Opt::kSgd}) {
      for (double clip : {0.0, 1.0}) {
        SCOPED_TRACE(std::string(name_of(o)) + (clip > 0 ? " with clipping" : ""));
        EXPECT_EQ(host_reads_in_20_steps<P>(o, clip), 0);
      }
    }
  } else {
    GTEST_SKIP() << amp::policy_traits<P>::name << " is not supported on CPU with this LibTorch";
  }
}

TEST(ZeroSync, Fp16MixedTwentyStepsReadNothing) { expect_zero_reads<amp::Mixed<amp::fp16, amp::DynamicScaler>>(); }
TEST(ZeroSync, Bf16MixedTwentyStepsReadNothing) { expect_zero_reads<amp::Mixed<amp::bf16, amp::NoScaler>>(); }

// LibTorch < 2.4 (no CPU fused kernels): the unfused path, whose count this
// states. bf16-mixed has no scaler, so nothing is read there either; a
// loss-scaling Stepper reads the found-inf flag once per step to decide the
// skip (as torch's unfused GradScaler.step does) and the portable CPU unscale
// reads the 0-dim inverse scale from host memory once per step.
TEST(ZeroSync, UnfusedPathCountsOnOldLibTorch) {
  if (kFusedCpu) GTEST_SKIP() << "the fused path serves CPU on this LibTorch";
  Model r = make_run(Opt::kAdam);
  amp::Trainer<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> trainer(r.net, *r.opt,
                                                                       amp::TrainerOptions().progress(false));
  EXPECT_FALSE(trainer.fused());
  const auto x = batch_x(0), y = torch::randint(0, 4, {64}, torch::kLong);
  ScalarReads reads;
  for (int i = 0; i < 20; ++i) trainer.step([&](auto&) { return torch::cross_entropy_loss(r.net->forward(x), y); });
  EXPECT_EQ(ScalarReads::outside, 0);

  Model s = make_run(Opt::kSgd);
  amp::Stepper<amp::DynamicScaler> stepper(*s.opt);
  EXPECT_FALSE(stepper.fused());
  ScalarReads::outside = 0;
  for (int i = 0; i < 20; ++i) stepper.step(torch::cross_entropy_loss(s.net->forward(x), y));
  // Two reads per step (each seen as aten::item and aten::_local_scalar_dense).
  EXPECT_EQ(ScalarReads::outside, 2 * 2 * 20);
}

// Fused and unfused Trainer steps: same skip decisions and scale trajectory,
// parameters close after 30 training steps (measured on 2.6: 3.6e-5 at most,
// Adam), with an inf on some steps.
template <class P>
void fused_matches_unfused(Opt o) {
  Model a = make_run(o), b = make_run(o);
  const auto opts = amp::TrainerOptions().progress(false).step(amp::StepOptions().max_grad_norm(5.0));
  amp::Trainer<P, amp::CPU> fused(a.net, *a.opt, amp::TrainerOptions(opts).step(amp::StepOptions().fused(true)));
  amp::Trainer<P, amp::CPU> plain(b.net, *b.opt, amp::TrainerOptions(opts).step(amp::StepOptions().fused(false)));
  ASSERT_TRUE(fused.fused());
  ASSERT_FALSE(plain.fused());
  torch::manual_seed(3);
  for (int i = 0; i < 30; ++i) {
    auto x = batch_x(i);
    // An inf on some steps: skipped by a loss-scaling policy (without one it
    // would make every parameter NaN, on both paths alike).
    if (amp::policy_traits<P>::uses_loss_scaling && i % 9 == 4) x[0][0] = std::numeric_limits<float>::infinity();
    const auto y = torch::randint(0, 4, {64}, torch::kLong);
    auto rf = fused.step([&](auto&) { return torch::cross_entropy_loss(a.net->forward(x), y); });
    auto rp = plain.step([&](auto&) { return torch::cross_entropy_loss(b.net->forward(x), y); });
    ASSERT_EQ(rf.skipped(), rp.skipped()) << "step " << i;
    ASSERT_EQ(fused.scaler().get_scale(), plain.scaler().get_scale()) << "step " << i;
  }
  auto pa = a.net->parameters(), pb = b.net->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    const double diff = (pa[i] - pb[i]).abs().max().template item<double>();
    const double scale = pb[i].abs().max().template item<double>();
    // Each step's update agrees to fp32 rounding (tests/optim/fused_optimizer_test.cc,
    // on the same gradients); here the parameters feed the next forward, and
    // Adam's division by sqrt(v) amplifies 1-ulp differences over 30 steps.
    EXPECT_LE(diff, 1e-4 * (1.0 + scale)) << "parameter " << i;
  }
}

TEST(FusedTrainer, MatchesUnfusedWithinFp32Rounding) {
  if (!kFusedCpu) GTEST_SKIP() << "no CPU fused kernels before LibTorch 2.4";
  for (Opt o : {Opt::kAdam, Opt::kAdamW, Opt::kSgd}) {
    SCOPED_TRACE(name_of(o));
    fused_matches_unfused<amp::Mixed<amp::bf16, amp::NoScaler>>(o);
    if constexpr (amp::is_supported_v<amp::Mixed<amp::fp16, amp::DynamicScaler>, amp::CPU>)
      fused_matches_unfused<amp::Mixed<amp::fp16, amp::DynamicScaler>>(o);
  }
}

// Save after N fused steps, load into a fresh Trainer (fused, and unfused),
// continue: bitwise the uninterrupted fused run / loads either way.
TEST(FusedTrainer, CheckpointsResumeBitwiseAndCrossPaths) {
  if (!kFusedCpu) GTEST_SKIP() << "no CPU fused kernels before LibTorch 2.4";
  using P = amp::Mixed<amp::bf16, amp::NoScaler>;
  const auto path = (std::filesystem::temp_directory_path() / "amp_zero_sync_ckpt.pt").string();
  auto run_steps = [](amp::Trainer<P, amp::CPU>& t, Net& net, int from, int to) {
    for (int i = from; i < to; ++i) {
      torch::manual_seed(100 + i);
      const auto x = batch_x(i), y = torch::randint(0, 4, {64}, torch::kLong);
      t.step([&](auto&) { return torch::cross_entropy_loss(net.forward(x), y); });
    }
  };
  for (Opt o : {Opt::kAdam, Opt::kSgd}) {
    SCOPED_TRACE(name_of(o));
    Model a = make_run(o);
    amp::Trainer<P, amp::CPU> straight(a.net, *a.opt, amp::TrainerOptions().progress(false));
    run_steps(straight, *a.net, 0, 20);

    Model b = make_run(o);
    amp::Trainer<P, amp::CPU> first(b.net, *b.opt, amp::TrainerOptions().progress(false));
    run_steps(first, *b.net, 0, 10);
    first.save(path);
    Model c = make_run(o, 9);  // other initial weights: all of it must come from the file
    amp::Trainer<P, amp::CPU> resumed(c.net, *c.opt, amp::TrainerOptions().progress(false));
    resumed.load(path);
    run_steps(resumed, *c.net, 10, 20);
    auto pa = a.net->parameters(), pc = c.net->parameters();
    for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pc[i])) << "parameter " << i;

    // The same file into an unfused Trainer: it loads and trains on.
    Model d = make_run(o, 9);
    amp::Trainer<P, amp::CPU> unfused(d.net, *d.opt,
                                      amp::TrainerOptions().progress(false).step(amp::StepOptions().fused(false)));
    unfused.load(path);
    EXPECT_EQ(unfused.steps(), 10);
    run_steps(unfused, *d.net, 10, 12);
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace zero_sync_test
