// Fabric<Policy, Device>: two models and two optimizers under one policy
// and one scaler (a small GAN), on CPU, under every CPU-supported policy:
// equal to the recipe written by hand from amp's pieces, bit for bit; inf in
// one optimizer's gradients skips that optimizer only and backs the scale off
// once; bitwise resume from a mid-run checkpoint; the amp: errors, each
// leaving everything as it was; evaluate() and autocast(fn); no host reads
// on the fused path (LibTorch >= 2.4). The loss-scaling cases need fp16
// autocast on CPU (LibTorch >= 2.3); before, the shared per-optimizer part
// is checked with DynamicScaler on fp32 gradients (OptimizerStepUnderOneScaler).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "amp/amp.h"
#include "amp/testing.h"
#include "../error_of.h"
#include "../tmp_path.h"
#include "../scalar_reads.h"

namespace fabric_test {  // a layer's test files share one TU (tests/BUILD.bazel)
namespace {

using amp_test::error_of;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

constexpr double kInf = std::numeric_limits<double>::infinity();

using ::amp_test::tmp_path;

std::vector<torch::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}
bool same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

// A small GAN on synthetic data: generator 8 -> 16 -> 4, discriminator 4 -> 16 -> 1.
struct Gan {
  torch::nn::Sequential gen{nullptr}, disc{nullptr};
  std::unique_ptr<torch::optim::AdamW> opt_g;
  std::unique_ptr<torch::optim::Adam> opt_d;
  torch::Tensor noise, real;

  template <class P>
  static Gan make(uint64_t seed = 3) {
    Gan g;
    torch::manual_seed(seed);
    g.gen = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
    g.disc = torch::nn::Sequential(torch::nn::Linear(4, 16), torch::nn::LeakyReLU(), torch::nn::Linear(16, 1));
    // In fp16 Adam's default eps is 0 (the policies' setup rejects it there).
    const double eps = std::is_same_v<typename amp::policy_traits<P>::param_type, amp::fp16> ? 1e-4 : 1e-8;
    g.opt_g = std::make_unique<torch::optim::AdamW>(g.gen->parameters(), torch::optim::AdamWOptions(2e-3).eps(eps));
    g.opt_d = std::make_unique<torch::optim::Adam>(g.disc->parameters(), torch::optim::AdamOptions(1e-3).eps(eps));
    g.noise = torch::randn({40, 32, 8});
    g.real = torch::randn({40, 32, 4}) * 0.5 + 1.0;
    return g;
  }

  template <class R>
  torch::Tensor d_loss(R&, int i) {
    const auto dt = R::param_dtype;
    auto fake = gen->forward(noise[i].to(dt)).detach();
    auto on_real = disc->forward(real[i].to(dt)), on_fake = disc->forward(fake);
    return torch::binary_cross_entropy_with_logits(on_real, torch::ones_like(on_real)) +
           torch::binary_cross_entropy_with_logits(on_fake, torch::zeros_like(on_fake));
  }
  template <class R>
  torch::Tensor g_loss(R&, int i) {
    auto on_fake = disc->forward(gen->forward(noise[i].to(R::param_dtype)));
    return torch::binary_cross_entropy_with_logits(on_fake, torch::ones_like(on_fake));
  }
};

// One GAN iteration through Fabric; d_poison multiplies D's loss (inf: D's gradients overflow).
template <class Prec>
void iteration(Prec& fabric, Gan& g, int i, double d_poison = 1.0, double g_poison = 1.0) {
  g.opt_d->zero_grad();
  fabric.backward(fabric.forward([&](auto& region) { return g.d_loss(region, i) * d_poison; }));
  fabric.optimizer_step(*g.opt_d);
  g.opt_g->zero_grad();
  fabric.backward(fabric.forward([&](auto& region) { return g.g_loss(region, i) * g_poison; }));
  fabric.optimizer_step(*g.opt_g);
  fabric.update();
}

template <class P>
double scale_of(const amp::Fabric<P, amp::CPU>& fabric) {
  return fabric.scaler().get_scale();
}

template <class P>
class FabricPolicies : public ::testing::Test {};
TYPED_TEST_SUITE(FabricPolicies, amp::testing::PolicyTypes<decltype(amp::supported_policies<amp::CPU>)>,
                 amp::testing::PolicyNames);

// The recipe by hand (torch's AMP docs, several optimizers sharing one
// scaler): Region, scaler.scale(loss).backward(), scaler.step(opt) per
// optimizer (with FusedStep where Fabric takes it), one scaler.update().
TYPED_TEST(FabricPolicies, TwoOptimizersEqualTheRecipeByHand) {
  using P = TypeParam;
  using Prec = amp::Fabric<P, amp::CPU>;
  using R = typename Prec::region_type;
  Gan a = Gan::make<P>(), b = Gan::make<P>();
  Prec fabric;
  fabric.setup(a.gen, *a.opt_g);
  fabric.setup(a.disc, *a.opt_d);
  EXPECT_EQ(fabric.num_models(), 2u);
  EXPECT_EQ(fabric.num_optimizers(), 2u);

  if constexpr (!amp::policy_traits<P>::uses_autocast) {  // True<D>: the model in D
    b.gen->to(R::param_dtype);
    b.disc->to(R::param_dtype);
  }
  typename Prec::scaler_type scaler;
  std::optional<amp::FusedStep> fused_g, fused_d;
  if (fabric.fused(*a.opt_g)) fused_g.emplace(*b.opt_g);
  if (fabric.fused(*a.opt_d)) fused_d.emplace(*b.opt_d);
  auto scaler_step = [&](torch::optim::Optimizer& opt, std::optional<amp::FusedStep>& fused) {
    if constexpr (amp::scaler_capabilities<typename Prec::scaler_type>::fused_step) {
      if (fused) return scaler.step(opt, *fused);
    } else if (fused) {
      return fused->step();
    }
    scaler.step(opt);
  };
  constexpr bool scaled = amp::policy_traits<P>::uses_loss_scaling;
  for (int i = 0; i < 12; ++i) {
    const double poison = scaled && (i == 3 || i == 7) ? kInf : 1.0;  // D overflows twice
    iteration(fabric, a, i, poison);

    b.opt_d->zero_grad();
    torch::Tensor loss_d;
    {
      R region;
      loss_d = b.d_loss(region, i) * poison;
    }
    scaler.scale(loss_d).backward();
    scaler_step(*b.opt_d, fused_d);
    b.opt_g->zero_grad();
    torch::Tensor loss_g;
    {
      R region;
      loss_g = b.g_loss(region, i);
    }
    scaler.scale(loss_g).backward();
    scaler_step(*b.opt_g, fused_g);
    scaler.update();
    ASSERT_EQ(fabric.scaler().get_scale(), scaler.get_scale()) << "iteration " << i;
  }
  EXPECT_TRUE(same(snapshot(*a.gen), snapshot(*b.gen)));
  EXPECT_TRUE(same(snapshot(*a.disc), snapshot(*b.disc)));
  EXPECT_EQ(fabric.steps(), 12);
  for (const auto& p : a.gen->parameters()) EXPECT_EQ(p.scalar_type(), R::param_dtype);
}

// torch's multi-optimizer semantics through Fabric (fp16 autocast on CPU: LibTorch >= 2.3).
template <class P>
void expect_per_optimizer_skips() {
  if constexpr (amp::is_supported_v<P, amp::CPU>) {
    Gan g = Gan::make<P>();
    amp::Fabric<P, amp::CPU> fabric({}, amp::DynamicScaler(amp::DynamicScalerOptions().init_scale(1024.0)));
    fabric.setup(g.gen, *g.opt_g);
    fabric.setup(g.disc, *g.opt_d);
    iteration(fabric, g, 0);
    EXPECT_EQ(scale_of(fabric), 1024.0);
    // inf in D's gradients: D keeps its parameters, G steps, the scale halves once.
    auto d0 = snapshot(*g.disc), g0 = snapshot(*g.gen);
    iteration(fabric, g, 1, kInf);
    EXPECT_TRUE(same(snapshot(*g.disc), d0));
    EXPECT_FALSE(same(snapshot(*g.gen), g0));
    EXPECT_EQ(scale_of(fabric), 512.0);
    // inf in G's only: the other way round.
    d0 = snapshot(*g.disc), g0 = snapshot(*g.gen);
    iteration(fabric, g, 2, 1.0, kInf);
    EXPECT_FALSE(same(snapshot(*g.disc), d0));
    EXPECT_TRUE(same(snapshot(*g.gen), g0));
    EXPECT_EQ(scale_of(fabric), 256.0);
    // inf in both: both skip, and the scale still backs off once, not twice.
    d0 = snapshot(*g.disc), g0 = snapshot(*g.gen);
    iteration(fabric, g, 3, kInf, kInf);
    EXPECT_TRUE(same(snapshot(*g.disc), d0));
    EXPECT_TRUE(same(snapshot(*g.gen), g0));
    EXPECT_EQ(scale_of(fabric), 128.0);
  } else {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << " has no fp16 autocast on CPU";
  }
}

TEST(Fabric, InfInOneOptimizerSkipsOnlyItAndTheScaleBacksOffOnce) {
  expect_per_optimizer_skips<amp::Mixed<amp::fp16, amp::DynamicScaler>>();
}

// The same semantics on any LibTorch, at the level Fabric shares with
// Stepper: two OptimizerSteps and one DynamicScaler on fp32 gradients.
TEST(Fabric, OptimizerStepUnderOneScaler) {
  Gan g = Gan::make<amp::True<amp::fp32>>();
  amp::DynamicScaler scaler(amp::DynamicScalerOptions().init_scale(1024.0));
  amp::detail::OptimizerStep<amp::DynamicScaler> step_d(*g.opt_d, true, 1.0, 2.0), step_g(*g.opt_g, true, 0.0, 2.0);
  amp::Region<amp::True<amp::fp32>, amp::CPU> region;
  const std::vector<std::tuple<double, bool, bool, double>> cases = {
      {1.0, false, false, 1024.0}, {kInf, true, false, 512.0}, {1.0, false, false, 512.0}, {kInf, true, false, 256.0}};
  for (const auto& [d_poison, d_skips, g_skips, scale] : cases) {
    const auto d0 = snapshot(*g.disc), g0 = snapshot(*g.gen);
    g.opt_d->zero_grad();
    scaler.scale(g.d_loss(region, 0) * d_poison).backward();
    step_d.run(scaler);
    g.opt_g->zero_grad();
    scaler.scale(g.g_loss(region, 0)).backward();
    step_g.run(scaler);
    scaler.update();
    EXPECT_EQ(same(snapshot(*g.disc), d0), d_skips);
    EXPECT_EQ(same(snapshot(*g.gen), g0), g_skips);
    EXPECT_EQ(scaler.get_scale(), scale);
  }
}

// Resume: 2N iterations straight == N, save, a fresh Fabric loads, N more.
TYPED_TEST(FabricPolicies, MidRunCheckpointResumesBitwise) {
  using P = TypeParam;
  using Prec = amp::Fabric<P, amp::CPU>;
  constexpr bool scaled = amp::policy_traits<P>::uses_loss_scaling;
  const std::string path = tmp_path(std::string("precision_") + amp::policy_traits<P>::name + ".pt");
  Gan straight = Gan::make<P>();
  Prec a;
  a.setup(straight.gen, *straight.opt_g);
  a.setup(straight.disc, *straight.opt_d);
  double saved_scale = 0;
  for (int i = 0; i < 16; ++i) {
    iteration(a, straight, i, scaled && i == 2 ? kInf : 1.0);
    if (i == 7) a.save(path), saved_scale = a.scaler().get_scale();
  }
  Gan resumed = Gan::make<P>(/*seed=*/99);  // other weights: the checkpoint must bring them
  resumed.noise = straight.noise, resumed.real = straight.real;
  Prec b;
  b.setup(resumed.gen, *resumed.opt_g);
  b.setup(resumed.disc, *resumed.opt_d);
  b.load(path);
  EXPECT_EQ(b.steps(), 8);
  EXPECT_EQ(b.scaler().get_scale(), saved_scale);
  for (int i = 8; i < 16; ++i) iteration(b, resumed, i);
  EXPECT_TRUE(same(snapshot(*straight.gen), snapshot(*resumed.gen)));
  EXPECT_TRUE(same(snapshot(*straight.disc), snapshot(*resumed.disc)));
  EXPECT_EQ(a.scaler().get_scale(), b.scaler().get_scale());
}

using Bf16 = amp::Mixed<amp::bf16, amp::NoScaler>;

TEST(Fabric, CheckpointRefusalsLeaveEverythingAsItWas) {
  Gan g = Gan::make<Bf16>();
  amp::Fabric<Bf16, amp::CPU> fabric;
  fabric.setup(g.gen, *g.opt_g);
  fabric.setup(g.disc, *g.opt_d);
  iteration(fabric, g, 0);
  const std::string path = tmp_path("precision_refusals.pt");
  fabric.save(path);
  iteration(fabric, g, 1);
  const auto gen0 = snapshot(*g.gen), disc0 = snapshot(*g.disc);

  // Another policy's checkpoint.
  {
    Gan o = Gan::make<amp::True<amp::fp32>>();
    amp::Fabric<amp::True<amp::fp32>, amp::CPU> other;
    other.setup(o.gen, *o.opt_g);
    other.setup(o.disc, *o.opt_d);
    iteration(other, o, 0);
    other.save(tmp_path("precision_fp32.pt"));
  }
  EXPECT_THAT(error_of([&] { fabric.load(tmp_path("precision_fp32.pt")); }),
              HasSubstr("was saved under precision \"32-true\" but this Fabric's policy is \"bf16-mixed\""));
  // A checkpoint of one model (a Trainer's), and one with another count.
  {
    Gan t = Gan::make<Bf16>();
    amp::Trainer<Bf16, amp::CPU> trainer(t.disc, *t.opt_d, amp::TrainerOptions().progress(false));
    trainer.save(tmp_path("precision_trainer.pt"));
    amp::Fabric<Bf16, amp::CPU> one;
    one.setup(t.gen, *t.opt_g);
    one.save(tmp_path("precision_one.pt"));
  }
  EXPECT_THAT(error_of([&] { fabric.load(tmp_path("precision_trainer.pt")); }),
              HasSubstr("the checkpoint holds one model and optimizer (amp::Trainer::save)"));
  EXPECT_THAT(error_of([&] { fabric.load(tmp_path("precision_one.pt")); }),
              HasSubstr("the checkpoint holds 1 models and 1 optimizers, but 2 models and 2 optimizers are set up"));
  EXPECT_THAT(error_of([&] { fabric.load(tmp_path("no_such_file.pt")); }), HasSubstr("amp: could not read checkpoint"));
  EXPECT_TRUE(same(snapshot(*g.gen), gen0));
  EXPECT_TRUE(same(snapshot(*g.disc), disc0));
  EXPECT_EQ(fabric.steps(), 2);

  // save() and load() between iterations only.
  g.opt_d->zero_grad();
  fabric.backward(fabric.forward([&](auto& r) { return g.d_loss(r, 2); }));
  fabric.optimizer_step(*g.opt_d);
  EXPECT_THAT(error_of([&] { fabric.save(tmp_path("mid.pt")); }),
              HasSubstr("amp: save() in the middle of an iteration: optimizer 1 stepped"));
  EXPECT_FALSE(fs::exists(tmp_path("mid.pt")));
  EXPECT_THAT(error_of([&] { fabric.load(path); }), HasSubstr("amp: load() in the middle of an iteration"));
  fabric.update();
  fabric.load(path);
  EXPECT_EQ(fabric.steps(), 1);
}

TEST(Fabric, SetupErrorsChangeNothing) {
  Gan g = Gan::make<Bf16>();
  amp::Fabric<Bf16, amp::CPU> fabric;
  // An optimizer over parameters of a model that was not set up.
  EXPECT_THAT(error_of([&] { fabric.setup(g.gen, *g.opt_d); }),
              HasSubstr("amp: setup(): parameter 0 of param group 0 of this optimizer belongs to no model that was set "
                        "up"));
  EXPECT_EQ(fabric.num_models(), 0u);
  EXPECT_EQ(fabric.num_optimizers(), 0u);
  fabric.setup(g.gen, *g.opt_g);
  // The same optimizer twice.
  EXPECT_THAT(error_of([&] { fabric.setup(g.gen, *g.opt_g); }),
              HasSubstr("amp: setup(): this optimizer was already set up (optimizer 0); set up each optimizer once"));
  EXPECT_EQ(fabric.num_optimizers(), 1u);
  // An optimizer over two models: fine once both are set up.
  torch::optim::SGD both(g.disc->parameters(), torch::optim::SGDOptions(0.1));
  both.add_param_group(torch::optim::OptimizerParamGroup(g.gen->parameters()));
  fabric.setup(g.disc);
  fabric.setup(g.disc, both);
  EXPECT_EQ(fabric.num_models(), 2u);
  // LBFGS, fp64 parameters under a Mixed policy.
  torch::optim::LBFGS lbfgs(g.disc->parameters(), torch::optim::LBFGSOptions(0.1));
  EXPECT_THAT(error_of([&] { fabric.setup(g.disc, lbfgs); }),
              HasSubstr("amp: Fabric steps each optimizer with step()"));
  torch::nn::Linear wide(4, 4);
  wide->to(torch::kFloat64);
  EXPECT_THAT(error_of([&] { fabric.setup(wide); }),
              HasSubstr("amp: bf16-mixed keeps parameters in fp32, but parameter 'weight' is Double; call "
                        "model->to(torch::kFloat32) before fabric.setup(model)"));
  EXPECT_EQ(fabric.num_models(), 2u);
  EXPECT_EQ(fabric.num_optimizers(), 2u);
  EXPECT_THAT(error_of([&] { fabric.setup(g.gen, *g.opt_d, amp::StepOptions().max_grad_norm(-1)); }),
              HasSubstr("amp: max_grad_norm must be >= 0"));
  EXPECT_THAT(
      error_of([&] { fabric.setup(g.gen, *g.opt_d, amp::StepOptions().accumulation_steps(2)); }),
      HasSubstr("amp: Fabric steps an optimizer at each fabric.optimizer_step(opt), so StepOptions::accumulation_steps "
                "must be 1 in setup(), got 2"));
  EXPECT_EQ(fabric.num_optimizers(), 2u);
}

// FabricOptions::region is honoured by forward() and evaluate().
TEST(Fabric, RegionOptionsReachForwardAndEvaluate) {
  for (const amp::LinearRouting mode : {amp::LinearRouting::kOn, amp::LinearRouting::kOff}) {
    Gan g = Gan::make<Bf16>();
    amp::Fabric<Bf16, amp::CPU> fabric(amp::FabricOptions().region(amp::RegionOptions().linear_routing(mode)));
    fabric.setup(g.gen, *g.opt_g);
    amp::LinearRouting in_forward = amp::LinearRouting::kOff, in_eval = amp::LinearRouting::kOff;
    (void)fabric.forward([&](auto&) {
      in_forward = amp::detail::current_linear_routing();
      return g.gen->forward(g.noise).sum();
    });
    fabric.evaluate([&](auto&) {
      in_eval = amp::detail::current_linear_routing();
      return 0;
    });
    EXPECT_EQ(in_forward, mode);
    EXPECT_EQ(in_eval, mode);
  }
}

TEST(Fabric, StepAndUpdateOutOfOrderAreErrorsThatChangeNothing) {
  Gan g = Gan::make<Bf16>();
  amp::Fabric<Bf16, amp::CPU> fabric;
  fabric.setup(g.gen, *g.opt_g);
  fabric.setup(g.disc, *g.opt_d);
  auto d0 = snapshot(*g.disc);
  // optimizer_step() without backward().
  EXPECT_THAT(error_of([&] { fabric.optimizer_step(*g.opt_d); }),
              HasSubstr("amp: optimizer_step() without backward(): no backward() since optimizer 1's last step; "
                        "call fabric.backward(loss) first"));
  EXPECT_TRUE(same(snapshot(*g.disc), d0));
  // update() without an optimizer_step().
  EXPECT_THAT(error_of([&] { fabric.update(); }),
              HasSubstr("amp: update() without an optimizer_step() since the last update()"));
  EXPECT_EQ(fabric.steps(), 0);
  // An optimizer that was not set up.
  torch::optim::SGD stranger(g.disc->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_THAT(
      error_of([&] { fabric.optimizer_step(stranger); }),
      HasSubstr("amp: optimizer_step(): this optimizer was not set up; call fabric.setup(model, optimizer) first"));
  // A whole iteration, then: update() twice, optimizer_step() twice, one after its backward was used.
  iteration(fabric, g, 0);
  EXPECT_EQ(fabric.steps(), 1);
  EXPECT_THAT(error_of([&] { fabric.update(); }),
              HasSubstr("amp: update() without an optimizer_step() since the last update()"));
  EXPECT_EQ(fabric.steps(), 1);
  g.opt_d->zero_grad();
  fabric.backward(fabric.forward([&](auto& r) { return g.d_loss(r, 1); }));
  fabric.optimizer_step(*g.opt_d);
  d0 = snapshot(*g.disc);
  EXPECT_THAT(error_of([&] { fabric.optimizer_step(*g.opt_d); }),
              HasSubstr("amp: optimizer_step(): optimizer 1 already stepped in this iteration; call fabric.update()"));
  EXPECT_TRUE(same(snapshot(*g.disc), d0));
  fabric.update();
  EXPECT_THAT(error_of([&] { fabric.optimizer_step(*g.opt_d); }),
              HasSubstr("amp: optimizer_step() without backward()"));
  EXPECT_THAT(error_of([&] { fabric.backward(torch::ones({2}, torch::requires_grad())); }),
              HasSubstr("amp: backward(): the loss must have one element"));
  // Training goes on.
  iteration(fabric, g, 2);
  EXPECT_EQ(fabric.steps(), 3);
}

// evaluate(): the policy's region, no autograd, eval mode, modes restored.
TEST(Fabric, EvaluateRunsUnderThePolicyWithoutGradInEvalMode) {
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::Dropout(0.5), torch::nn::Linear(8, 2));
  torch::nn::Sequential frozen(torch::nn::Linear(2, 2), torch::nn::BatchNorm1d(2));
  frozen[1]->eval();  // a submodule the user keeps in eval mode
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  amp::Fabric<Bf16, amp::CPU> fabric;
  fabric.setup(net, opt);
  fabric.setup(frozen);
  const auto x = torch::randn({16, 4});
  auto y = fabric.evaluate([&](auto& region) {
    (void)region;
    EXPECT_FALSE(net->is_training());
    EXPECT_FALSE(net[1]->is_training());
    EXPECT_FALSE(frozen->is_training());
    EXPECT_FALSE(torch::GradMode::is_enabled());
    return net->forward(x);
  });
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);  // the last Linear under bf16 autocast
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(torch::equal(y, fabric.evaluate([&](auto&) { return net->forward(x); })));  // no dropout
  EXPECT_TRUE(net->is_training());
  EXPECT_TRUE(net[1]->is_training());
  EXPECT_TRUE(frozen->is_training());
  EXPECT_FALSE(frozen[1]->is_training());
  EXPECT_TRUE(torch::GradMode::is_enabled());
  EXPECT_FALSE(amp::detail::compat::autocast_enabled(c10::DeviceType::CPU));
  // Restored when fn throws, too.
  EXPECT_THAT(error_of([&] { fabric.evaluate([&](auto&) -> int { throw std::runtime_error("boom"); }); }),
              HasSubstr("boom"));
  EXPECT_TRUE(net->is_training());
  EXPECT_FALSE(frozen[1]->is_training());
  EXPECT_TRUE(torch::GradMode::is_enabled());
}

TEST(Trainer, EvaluateRunsUnderThePolicyWithoutGradInEvalMode) {
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::Dropout(0.5), torch::nn::Linear(8, 2));
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  amp::Trainer<amp::True<amp::fp64>, amp::CPU> trainer(net, opt, amp::TrainerOptions().progress(false));
  const auto x = torch::randn({16, 4}, torch::kFloat64);
  auto y = trainer.evaluate([&](auto&) {
    EXPECT_FALSE(net[1]->is_training());
    return net->forward(x);
  });
  EXPECT_EQ(y.scalar_type(), torch::kFloat64);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(net[1]->is_training());
  trainer.evaluate([&](auto&) {});  // fn may return nothing
}

TEST(Autocast, FunctionFormReturnsFnsValueUnderAutocast) {
  torch::nn::Linear lin(4, 4);
  const auto x = torch::randn({2, 4});
  auto y = amp::autocast<amp::bf16, amp::CPU>([&] {
    EXPECT_TRUE(amp::detail::compat::autocast_enabled(c10::DeviceType::CPU));
    return lin(x);
  });
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_FALSE(amp::detail::compat::autocast_enabled(c10::DeviceType::CPU));
  EXPECT_EQ(lin(x).scalar_type(), torch::kFloat32);
}

// No host reads per iteration on the fused path (ATen's CPU fused optimizers: LibTorch >= 2.4).
template <class P>
void expect_no_host_reads() {
  if constexpr (amp::detail::compat::kCpuHasFusedOptimizers && amp::is_supported_v<P, amp::CPU>) {
    Gan g = Gan::make<P>();
    amp::Fabric<P, amp::CPU> fabric;
    fabric.setup(g.gen, *g.opt_g, amp::StepOptions().max_grad_norm(1.0));  // clipping, too
    fabric.setup(g.disc, *g.opt_d);
    ASSERT_TRUE(fabric.fused(*g.opt_g)) << fabric.optimizer_path(*g.opt_g);
    ASSERT_TRUE(fabric.fused(*g.opt_d)) << fabric.optimizer_path(*g.opt_d);
    iteration(fabric, g, 0);  // state made
    ScalarReads reads;
    for (int i = 1; i < 21; ++i)
      iteration(fabric, g, i, amp::policy_traits<P>::uses_loss_scaling && i == 5 ? kInf : 1.0);
    EXPECT_EQ(ScalarReads::outside, 0) << amp::policy_traits<P>::name;
  } else {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR
                 << " has no CPU fused optimizers (2.4+)";
  }
}

TEST(Fabric, FusedPathReadsNothingBackToTheHost) {
  expect_no_host_reads<amp::Mixed<amp::fp16, amp::DynamicScaler>>();
  expect_no_host_reads<Bf16>();
}

}  // namespace
}  // namespace fabric_test
